"""Batched decoding on CUDA (issue 18): captured graphs at batch sizes 2, 3 (run as 4) and 4 equal
the unpatched model's batched greedy `generate` on left-padded prompts, with rows stopping early."""

import pytest
import torch

import hybridspec
import hybridspec.experts
from hybridspec.sim.replay import DeviceReplayDrafter
from hybridspec.tiny import tiny_drafter
from tests.generation.test_batched import PAD, padded_batch
from tests.models import qwen3_next_causal_lm, qwen35_causal_lm, qwen35_checkpoint_layout

MAX_NEW = 40


@pytest.mark.gpu
@pytest.mark.parametrize("build", [qwen35_causal_lm, qwen35_checkpoint_layout, qwen3_next_causal_lm])
@pytest.mark.parametrize("experts", ["eager", "hybridspec"])
def test_captured_batches_equal_target_only(build, experts):
    hybridspec.experts.register()
    model = build(seed=4).cuda()
    model.set_experts_implementation(experts)
    dflash = tiny_drafter().cuda()
    for batch_size in (2, 3, 4):
        ids, mask = (t.cuda() for t in padded_batch(batch_size, seed=batch_size))
        P = ids.shape[1]
        free = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD)
        eos = int(free[0, P + 5])
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=PAD)
        hybridspec.enable(model)
        replay = DeviceReplayDrafter(dflash, free[:, P:])
        for lengths in (dict(verify_length=16), dict(policy="hybridspec"), dict(verify_length=4)):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                                 pad_token_id=PAD, assistant_model=replay, hybridspec=True,
                                 return_dict_in_generate=True, **lengths)
            assert torch.equal(out.sequences, ref), (batch_size, lengths)
            assert max(out.hybridspec_stats.accepted) >= 2
        size = 4 if batch_size == 3 else batch_size
        runner = getattr(model, "_hybridspec_runner" if size == 1 else f"_hybridspec_runner_b{size}")
        assert runner.captured and runner.batch_size == size
        # the real drafter, drafting every row from its own context, in the captured graph
        got = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=PAD, assistant_model=dflash, hybridspec=True)
        assert torch.equal(got, ref), batch_size
        hybridspec.disable(model)


@pytest.mark.gpu
def test_captured_batched_sampling_is_seeded():
    model = hybridspec.enable(qwen35_causal_lm(seed=4).cuda())
    ids, mask = (t.cuda() for t in padded_batch(4, seed=1))
    dflash = tiny_drafter().cuda()

    def run(seed):
        torch.manual_seed(seed)
        return model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, temperature=0.8,
                              pad_token_id=PAD, eos_token_id=None, assistant_model=dflash, hybridspec=True)

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert model._hybridspec_runner_b4.captured
