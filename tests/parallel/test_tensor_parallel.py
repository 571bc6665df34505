"""HybridSpec on targets sharded by transformers' tensor-parallel plan (docs/design.md, "Tensor
parallelism"), on CPU processes.

- Two gloo processes under `torchrun`, both families: `examples/tp_generate.py --tiny`, run twice:
  greedy equals the unsharded model's greedy (with the random drafter and with a replay drafter that
  gets several drafts accepted per round), every rank chose the same verification lengths and
  emitted the same sample, and the seeded sample repeats across the two invocations.
- One process, world size 1 (gloo): the sharded path in-process, runner and reference loop.
- `check_sharding`'s refusals, on a fake process group of several ranks in one process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList

import hybridspec
from hybridspec.policy import FixedPolicy
from hybridspec.runner import Runner
from hybridspec.sharding import shard
from hybridspec.sim.replay import DeviceReplayDrafter
from hybridspec.tiny import TARGET, tiny_drafter, tiny_next_target, tiny_target
from tests.models import qwen35_checkpoint_layout

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tp_generate.py"
PROMPT = torch.tensor([[1, 17, 33, 64, 5, 90, 12, 7]])
BUILD = {"qwen3_5_moe": tiny_target, "qwen3_next": tiny_next_target}


def _torchrun(*args: str, nproc: int = 2) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # --standalone: a free rendezvous port, so concurrent runs on one machine do not collide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE),
           *args]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{' '.join(cmd)} exited {run.returncode}\n{run.stdout}\n{run.stderr[-6000:]}"
    return run.stdout


def _digests(out: str) -> list[str]:
    return re.findall(r"sample digest \(seed \d+\): (\w+)", out)


def test_two_cpu_processes_match_the_unsharded_target_for_both_families():
    first = _torchrun("--tiny", "--device", "cpu", "--new-tokens", "32")
    for family in BUILD:
        assert f"{family} on 2 rank(s), cpu" in first, first
    assert first.count("identical to target-only greedy: True") == 4, first
    assert first.count("verification lengths agree across ranks: True") == 2, first
    assert first.count("reproducible: True, the same on every rank: True") == 2, first
    assert first.count("ranks seeded differently: sampling refused: True") == 2, first
    # a second invocation with the same seed draws the same sample
    second = _torchrun("--tiny", "--device", "cpu", "--new-tokens", "32", "--family", "qwen3_5_moe")
    assert _digests(second) == _digests(first)[:1], (first, second)


@pytest.fixture
def group(request):
    """A process group of `request.param` = (backend, world size) in this process: gloo with one
    rank runs for real; the fake backend pretends to more ranks (collectives do nothing), enough to
    build their shards and check them."""
    backend, size = request.param
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        store = FakeStore()
    else:
        store = dist.HashStore()
    dist.init_process_group(backend, rank=0, world_size=size, store=store)
    try:
        yield init_device_mesh("cpu", (size,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("group", [("gloo", 1)], indirect=True)
@pytest.mark.parametrize("build", [*BUILD.values(), qwen35_checkpoint_layout], ids=[*BUILD, "checkpoint_layout"])
def test_world_size_one_runs_the_sharded_path_exactly(group, build):
    reference = build(seed=0).generate(PROMPT, max_new_tokens=24, do_sample=False)
    model = hybridspec.enable(shard(build(seed=0), group))
    assert isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor)
    drafter = tiny_drafter(seed=0)
    replay = DeviceReplayDrafter(drafter, reference[0, PROMPT.shape[1]:])
    for d, kwargs in ((drafter, {}), (drafter, dict(reference_loop=True)), (replay, {}), (replay, dict(verify_length=4))):
        torch.manual_seed(0)
        out = model.generate(PROMPT, assistant_model=d, hybridspec=True, max_new_tokens=24, do_sample=False, **kwargs)
        assert torch.equal(out, reference), (type(d).__name__, kwargs)
    with pytest.raises(ValueError, match="max_time"):
        model.generate(PROMPT, assistant_model=drafter, hybridspec=True, max_new_tokens=4, max_time=10.0)
    with pytest.raises(ValueError, match="MaxTimeCriteria"):
        model.generate(PROMPT, assistant_model=drafter, hybridspec=True, max_new_tokens=4,
                       stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(10.0)]))
    with pytest.raises(ValueError, match="dispatch='cond' is not supported on a tensor-parallel model"):
        Runner(model, drafter, FixedPolicy("fixed", 4), capacity=64, dispatch="cond")
    hybridspec.disable(model)


def _sharded(mesh, **overrides):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    return shard(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**TARGET, **overrides})).eval(), mesh)


@pytest.mark.parametrize("group", [("fake", 2)], indirect=True)
def test_expert_parallel_experts_are_refused(group):
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _sharded(group)
    experts = model.model.layers[0].mlp.experts
    full = experts.gate_up_proj.full_tensor().detach()
    experts.gate_up_proj = torch.nn.Parameter(distribute_tensor(full, group, [Shard(0)], src_data_rank=None))
    with pytest.raises(ValueError, match="expert-parallel.*no ep_size"):
        hybridspec.enable(model)


@pytest.mark.parametrize("group", [("fake", 4)], indirect=True)
def test_a_tp_size_that_splits_heads_is_refused(group):
    # 2 KV heads over 4 ranks: every weight divides, the heads do not
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not a multiple of 4.*divides 2"):
        hybridspec.enable(_sharded(group))


@pytest.mark.parametrize("group", [("fake", 2)], indirect=True)
def test_uneven_shards_are_refused(group):
    # transformers 5.24 shards a colwise output unevenly (the last rank holds less); we need equal shards
    with pytest.raises(ValueError, match="size of 2 does not divide .*shared_expert.gate_proj.weight evenly"):
        hybridspec.enable(_sharded(group, shared_expert_intermediate_size=33))


@pytest.mark.parametrize("group", [("fake", 2)], indirect=True)
def test_expert_width_per_rank_must_fit_the_moe_kernel(group):
    with pytest.raises(ValueError, match="each rank holds 8 of the experts' 16 .* multiple of 16"):
        hybridspec.enable(_sharded(group, moe_intermediate_size=16))


@pytest.mark.parametrize("group", [("fake", 2)], indirect=True)
def test_a_style_other_than_the_default_plan_is_refused(group):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TARGET)).eval()
    # attention heads gathered on every rank: transformers would run it, our KV buffers would not match
    model.tp_plan = {**model.tp_plan, "model.layers.*.self_attn.k_proj": "colwise_gather_output"}
    with pytest.raises(ValueError, match="k_proj.weight is sharded as 'colwise_gather_output'.*supports colwise"):
        hybridspec.enable(shard(model, group))


@pytest.mark.gpu
def test_one_gpu_world_size_one_on_nccl_captures_graphs():
    out = _torchrun("--tiny", "--device", "cuda", nproc=1)
    assert out.count("graphs captured") == 2 and out.count("identical to target-only greedy: True") == 4, out
