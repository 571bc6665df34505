"""On CUDA the kernels (Triton GDN verify/commit, the MoE experts op) carry the same exactness."""

import pytest
import torch

import hybridspec
import hybridspec.experts
from hybridspec.sim.scripted import ScriptedReplayDrafter
from hybridspec.sim.replay import ReplayDrafter
from hybridspec.tiny import tiny_drafter
from tests.calibration.synthetic import synthetic_calibration
from tests.models import qwen3_next_causal_lm, qwen35_causal_lm


def _fla_importable() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen3_next_causal_lm])
@pytest.mark.parametrize("experts", ["eager", "hybridspec"])
def test_cuda_generation_equals_target_only(build, experts, record_property):
    # which prefill ran (transformers' own GDN path, with fla's kernels where importable), in the report
    record_property("fla_importable", _fla_importable())
    hybridspec.experts.register()
    model = build(seed=4).cuda()
    prompt = torch.arange(3, 14, device="cuda")[None]
    ref = model.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None)
    model.set_experts_implementation(experts)
    hybridspec.enable(model)
    for drafter, w in ((ScriptedReplayDrafter(11, ref[0, 11:], [0, 7, 15, 3]), 16), (tiny_drafter().cuda(), None)):
        got = model.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None, assistant_model=drafter,
                             hybridspec=True, verify_length=w)
        assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["hybridspec", "no_two_stage", "evict"])
def test_cuda_calibrated_policies_equal_target_only(policy):
    """Stage 0 / Stage 1 and the device-side correction on CUDA tensors."""
    hybridspec.experts.register()
    model = qwen35_causal_lm(seed=4).cuda()
    prompt = torch.arange(3, 14, device="cuda")[None]
    ref = model.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None)
    hybridspec.enable(model)
    replay = ReplayDrafter(tiny_drafter().cuda(), ref[0, 11:], seed=3)
    calibration = synthetic_calibration(model, replay)
    out = model.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None, assistant_model=replay,
                         hybridspec=True, policy=policy, calibration=calibration, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    stats = out.hybridspec_stats
    if policy != "evict":
        assert any(w == w0 + 1 for w, w0 in zip(stats.verify_lengths, stats.nominal_lengths))


@pytest.mark.gpu
def test_cuda_sampling_is_seeded_and_top_k_one_is_greedy():
    """The point-mass draws on CUDA tensors: `torch.manual_seed` reproduces them, and a one-token
    support gives the greedy output."""
    model = qwen35_causal_lm(seed=4).cuda()
    prompt = torch.arange(3, 14, device="cuda")[None]
    greedy = model.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None)
    hybridspec.enable(model)
    drafter = ScriptedReplayDrafter(11, greedy[0, 11:], [0, 7, 15, 3])
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(model.generate(prompt, max_new_tokens=32, do_sample=True, temperature=0.8, eos_token_id=None,
                                   assistant_model=drafter, hybridspec=True, verify_length=8))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    one = model.generate(prompt, max_new_tokens=32, do_sample=True, top_k=1, eos_token_id=None,
                         assistant_model=drafter, hybridspec=True, verify_length=8)
    assert torch.equal(one, greedy)
