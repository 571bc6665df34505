"""moe_experts kernels against the naive twin (hybridspec.ops.naive_moe) and transformers' eager experts."""

import contextlib
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import moe as moe_mod
from hybridspec.ops import dispatch, moe_experts, naive_moe
from hybridspec.ops.dispatch import TRITON_INTERPRET
from hybridspec.ops.moe import BLOCK_ROWS, MoEKernelConfig, down_blocks, piece_rows
from tests.helpers import assert_rel
from tests.ops.conftest import expect_launch
from tests.ops.moe_inputs import MoECase, make_inputs, make_shared, moe_cases

# bf16: the kernels and the twin round at the same points (SwiGLU output, result); what is left
# is fp32 summation order flipping a rounding now and then
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@contextlib.contextmanager
def expect_pieces(T: int):
    """Each piece (16 rows, or up to 64: a batch of verification windows) launches the gate/up,
    down and reduce kernels once."""
    pieces = math.ceil(T / piece_rows(T))
    with expect_launch("moe_gate_up", pieces), expect_launch("moe_down", pieces), expect_launch("moe_reduce", pieces):
        yield


def _run(case: MoECase, device: str):
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    with expect_pieces(case.T):
        out = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt)
    return out, (hidden, ids, wts, gate_up, down, nt)


def _check_past_rows_zero(out: torch.Tensor, n: int | None):
    if n is not None:
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), "rows past num_tokens must be zero"


@settings(max_examples=14)
@given(case=moe_cases())
@example(case=MoECase(T=16, K=8, E=16, H=64, I=32, dtype=torch.bfloat16, routing="random", n=13, seed=0))
def test_matches_naive(device, case):
    out, args = _run(case, device)
    ref = naive_moe.moe_experts(*(None if a is None else a.cpu() for a in args))
    assert out.dtype == case.dtype and out.shape == (case.T, case.H)
    assert_rel(out.cpu().float(), ref.float(), OUT_TOL[case.dtype], "out vs naive")
    _check_past_rows_zero(out.cpu(), case.n)


def _transformers_experts(gate_up: torch.Tensor, down: torch.Tensor):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    E, I2, H = gate_up.shape
    config = Qwen3_5MoeTextConfig(hidden_size=H, moe_intermediate_size=I2 // 2, num_experts=E, hidden_act="silu")
    config._experts_implementation = "eager"
    experts = Qwen3_5MoeExperts(config).to(device=gate_up.device, dtype=gate_up.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    return experts


@settings(max_examples=8)
@given(case=moe_cases(dtypes=(torch.float32,)))
@example(case=MoECase(T=16, K=8, E=12, H=48, I=16, dtype=torch.float32, routing="random", n=None, seed=1))
def test_matches_transformers_eager(device, case):
    out, (hidden, ids, wts, gate_up, down, _) = _run(case, device)
    n = case.T if case.n is None else case.n
    _check_past_rows_zero(out, case.n)
    if n == 0:
        return
    # eager takes no num_tokens (and chokes on garbage ids): give it the valid rows only
    with torch.no_grad():
        ref = _transformers_experts(gate_up, down)(hidden[:n], ids[:n], wts[:n])
    assert_rel(out[:n], ref, 1e-5, "out vs transformers eager")


@settings(max_examples=6)
@given(case=moe_cases(with_num_tokens=False), data=st.data())
def test_rows_past_num_tokens_touch_no_expert(device, case, data):
    n = data.draw(st.integers(0, case.T - 1), label="num_tokens")
    case = MoECase(**{**case.__dict__, "n": n})
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    clean = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt)
    # poison every expert that only rows past n name (in range): reading one would give NaN
    used = ids[:n][(ids[:n] >= 0) & (ids[:n] < case.E)].unique()
    idle = torch.ones(case.E, dtype=torch.bool, device=device)
    idle[used] = False
    gate_up, down = gate_up.clone(), down.clone()
    gate_up[idle] = float("nan")
    down[idle] = float("nan")
    dirty = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt)
    assert torch.isfinite(dirty).all()
    assert torch.equal(clean, dirty)
    _check_past_rows_zero(dirty, n)


@settings(max_examples=7)
@given(case=moe_cases(max_tokens=20))
@example(case=MoECase(T=1, K=8, E=16, H=64, I=32, dtype=torch.bfloat16, routing="random", n=None, seed=3))
@example(case=MoECase(T=16, K=8, E=12, H=48, I=16, dtype=torch.bfloat16, routing="repeat", n=11, seed=4))
def test_shared_expert_matches_naive(device, case):
    """The block's shared expert as one more slot of the same three launches: the twin's whole block
    (its block-level roundings), zero past num_tokens (NaN gates there)."""
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    shared = make_shared(case, device)
    with expect_pieces(case.T):
        out = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt, shared=shared)
    args = (hidden, ids, wts, gate_up, down, nt, *shared)
    ref = naive_moe.moe_experts(*(None if a is None else a.cpu() for a in args))
    assert out.dtype == case.dtype and out.shape == (case.T, case.H)
    assert_rel(out.cpu().float(), ref.float(), OUT_TOL[case.dtype], "out with the shared expert vs naive")
    _check_past_rows_zero(out.cpu(), case.n)
    if case.dtype != torch.float32 and device == "cpu":
        # the block's five roundings in the weights' dtype, as the twin makes them: under the
        # interpreter (fp32 products and sums, as the twin) only summation order may flip one now
        # and then, where leaving any rounding out changes ~30% of the values. On the GPU the
        # tensor cores' order flips the SwiGLU roundings more often: the relative error above applies
        differ = (out.cpu() != ref).float().mean().item()
        assert differ <= 0.02, f"{differ:.1%} of the values differ from the twin's roundings"
    n = case.T if case.n is None else case.n
    routed = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt)
    assert n == 0 or not torch.equal(out[:n], routed[:n]), "the shared expert added nothing"


@settings(max_examples=6)
@given(case=moe_cases(dtypes=(torch.float32,)))
def test_shared_expert_matches_transformers_block(device, case):
    """fp32: routed experts (transformers' eager experts) plus `sigmoid(gate) * shared_expert(x)` on
    transformers' own MLP module, as its sparse MoE block adds them."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeMLP

    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    s_gate_up, s_down, logits = make_shared(case, device)
    out = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt, shared=(s_gate_up, s_down, logits))
    n = case.T if case.n is None else case.n
    _check_past_rows_zero(out, case.n)
    if n == 0:
        return
    config = Qwen3_5MoeTextConfig(hidden_size=case.H, hidden_act="silu")
    mlp = Qwen3_5MoeMLP(config, intermediate_size=case.I).to(device=device, dtype=case.dtype)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(s_gate_up[: case.I])
        mlp.up_proj.weight.copy_(s_gate_up[case.I :])
        mlp.down_proj.weight.copy_(s_down)
        x = hidden[:n]
        ref = _transformers_experts(gate_up, down)(x, ids[:n], wts[:n]) + torch.sigmoid(logits[:n]) * mlp(x)
    assert_rel(out[:n], ref, 1e-5, "out with the shared expert vs transformers")


@pytest.mark.parametrize("T, K, n", [(21, 2, None), (37, 1, 30), (64, 4, 50), (130, 2, 100)])
def test_more_than_16_rows_run_in_pieces(device, T, K, n):
    """Up to 64 rows (four verification windows) run as one piece, more as 64-row pieces."""
    assert piece_rows(T) == min(64, 1 << (T - 1).bit_length()) and math.ceil(T / piece_rows(T)) == (1 if T <= 64 else 3)
    case = MoECase(T=T, K=K, E=6, H=32, I=16, dtype=torch.float32, routing="random", n=n, seed=T)
    out, args = _run(case, device)
    ref = naive_moe.moe_experts(*(None if a is None else a.cpu() for a in args))
    assert_rel(out.cpu(), ref, 1e-5, "out vs naive")
    _check_past_rows_zero(out.cpu(), n)
    # the shared expert too: each piece has its slot and its rows' gates
    shared = make_shared(case, device)
    out = moe_experts(*args[:5], num_tokens=args[5], shared=shared)
    ref = naive_moe.moe_experts(*(None if a is None else a.cpu() for a in (*args, *shared)))
    assert_rel(out.cpu(), ref, 1e-5, "out with the shared expert vs naive")
    _check_past_rows_zero(out.cpu(), n)


def test_down_chunk_of_gathered_pieces():
    """16-row pieces keep `down_block_i` (the B = 1 sweep's best), gathered pieces take
    `down_block_i_gather`; both are capped by what divides I."""
    cfg = MoEKernelConfig(down_block_h=64, down_block_i=128, down_block_i_gather=64)
    assert down_blocks(cfg, 2048, 512, BLOCK_ROWS) == (64, 128)
    assert down_blocks(cfg, 2048, 512, 64) == (64, 64) == down_blocks(cfg, 2048, 512, 32)
    assert down_blocks(cfg, 2048, 48, 64) == (64, 16)


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_piece_down_chunk_loops(monkeypatch, device, chunk, dtype):
    """A gathered piece whose down kernel loops over I in several chunks (I = 64) matches the twin,
    with and without the shared expert."""
    monkeypatch.setattr(moe_mod, "KERNEL_CONFIG", MoEKernelConfig(down_block_i_gather=chunk))
    case = MoECase(T=45, K=4, E=8, H=32, I=64, dtype=dtype, routing="repeat", n=41, seed=chunk)
    out, args = _run(case, device)
    ref = naive_moe.moe_experts(*(None if a is None else a.cpu() for a in args))
    assert_rel(out.float().cpu(), ref.float(), OUT_TOL[dtype], "out vs naive")
    _check_past_rows_zero(out.cpu(), case.n)
    shared = make_shared(case, device)
    out = moe_experts(*args[:5], num_tokens=args[5], shared=shared)
    ref = naive_moe.moe_experts(*(None if a is None else a.cpu() for a in (*args, *shared)))
    assert_rel(out.float().cpu(), ref.float(), OUT_TOL[dtype], "out with the shared expert vs naive")


def test_num_tokens_forms_and_determinism(device):
    case = MoECase(T=5, K=2, E=4, H=32, I=16, dtype=torch.bfloat16, routing="repeat", n=3, seed=1)
    hidden, ids, wts, gate_up, down, nt = make_inputs(case, device)
    a = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt)
    b = moe_experts(hidden, ids.int(), wts.float(), gate_up, down, num_tokens=nt.reshape(()).int())
    assert torch.equal(a, b)
    clean = tuple(x[:3] for x in (hidden, ids, wts))
    assert torch.equal(a[:3], moe_experts(*clean, gate_up, down))


# a verification window with NaN rows past num_tokens, three pieces sharing the scratch buffers, an AR step
PDL_CASES = [
    MoECase(T=16, K=8, E=16, H=64, I=32, dtype=torch.bfloat16, routing="repeat", n=13, seed=9),
    MoECase(T=37, K=2, E=6, H=32, I=16, dtype=torch.float32, routing="random", n=35, seed=10),
    MoECase(T=1, K=8, E=12, H=48, I=16, dtype=torch.float32, routing="random", n=None, seed=11),
]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["pdl_off", "pdl_on"])
@pytest.mark.parametrize("case", PDL_CASES, ids=["window-bf16", "pieces-fp32", "one_row"])
def test_pdl_on_and_off(monkeypatch, pdl, case):
    """Compiled kernels with and without programmatic dependent launch (on only on sm90+): same
    launches, each kernel waits for the output it reads (the scratch is NaN-poisoned), same bits
    every call."""
    monkeypatch.setattr(moe_mod, "KERNEL_CONFIG", MoEKernelConfig(pdl=pdl))
    a, args = _run(case, "cuda")
    b, _ = _run(case, "cuda")
    assert torch.equal(a, b)
    ref = naive_moe.moe_experts(*(None if x is None else x.cpu() for x in args))
    assert_rel(a.cpu().float(), ref.float(), OUT_TOL[case.dtype], "out vs naive")
    _check_past_rows_zero(a.cpu(), case.n)


@pytest.mark.gpu
@pytest.mark.skipif(TRITON_INTERPRET, reason="the interpreter copies CUDA tensors to the host, which capture forbids")
@pytest.mark.parametrize("pdl", [False, True], ids=["pdl_off", "pdl_on"])
def test_cuda_graph_replays_new_inputs(monkeypatch, pdl):
    """Captured once and replayed on other routings and lengths, as the benchmark and a decode loop run it."""
    monkeypatch.setattr(moe_mod, "KERNEL_CONFIG", MoEKernelConfig(pdl=pdl))
    first = PDL_CASES[0]
    bufs = make_inputs(first, "cuda")
    hidden, ids, wts, gate_up, down, nt = bufs
    # compiles the kernels, which capture cannot
    moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(hidden, ids, wts, gate_up, down, num_tokens=nt)
    for case in (first, MoECase(**{**first.__dict__, "routing": "one_expert", "n": 6, "seed": 12})):
        new = make_inputs(case, "cuda")
        for buf, value in zip(bufs, new):
            buf.copy_(value)
        graph.replay()
        ref = naive_moe.moe_experts(*(x.cpu() for x in new))
        assert_rel(out.cpu().float(), ref.float(), OUT_TOL[case.dtype], "replayed out vs naive")
        _check_past_rows_zero(out.cpu(), case.n)


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pdl_only_compiled_on_sm90(device_type):
    """The interpreter (which also runs CUDA tensors) cannot run `gdc_*`: pdl is off there, on CPU
    and before sm90, whatever the config says; `HYBRIDSPEC_PDL=0` (`dispatch.PDL`) turns it off too."""
    x = torch.zeros(1, device=device_type)
    sm90 = device_type == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert moe_mod._use_pdl(MoEKernelConfig(pdl=True), x) == (sm90 and not TRITON_INTERPRET and dispatch.PDL)
    assert not moe_mod._use_pdl(MoEKernelConfig(pdl=False), x)


def _small_args(device):
    case = MoECase(T=3, K=2, E=4, H=32, I=16, dtype=torch.float32, routing="shared", n=2, seed=5)
    return make_inputs(case, device)


def test_opcheck(device):
    hidden, ids, wts, gate_up, down, nt = _small_args(device)
    torch.library.opcheck(torch.ops.hybridspec.moe_experts.default, (hidden, ids, wts, gate_up, down, nt))
    shared = make_shared(MoECase(T=3, K=2, E=4, H=32, I=16, dtype=torch.float32, routing="shared", n=2, seed=5), device)
    torch.library.opcheck(torch.ops.hybridspec.moe_experts.default, (hidden, ids, wts, gate_up, down, nt, *shared))
    hidden, ids, wts = (x[:2] for x in (hidden, ids, wts))
    torch.library.opcheck(torch.ops.hybridspec.moe_experts.default, (hidden, ids, wts, gate_up, down, None))


def test_fullgraph_compile(device):
    hidden, ids, wts, gate_up, down, nt = _small_args(device)

    def layer(hidden, ids, wts, gate_up, down, nt):
        return moe_experts(hidden * 2, ids, wts, gate_up, down, num_tokens=nt) + 1

    eager = layer(hidden, ids, wts, gate_up, down, nt)
    compiled = torch.compile(layer, fullgraph=True)(hidden, ids, wts, gate_up, down, nt)
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "down_proj": a["down_proj"][:, :, :8]}, r"down_proj must be \[E, H, I\] = \[4, 32, 16\]"),
        (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, r"topk_weights must be \[T, k\] = \[3, 2\]"),
        (lambda a: {**a, "gate_up_proj": a["gate_up_proj"].double()}, "must have hidden's dtype"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids must be an integer tensor"),
        (lambda a: {**a, "num_tokens": torch.tensor([1, 2])}, r"num_tokens must be an integer tensor of shape \[1\]"),
        (lambda a: {**a, "hidden": a["hidden"][:, :24], "gate_up_proj": a["gate_up_proj"][..., :24],
                    "down_proj": a["down_proj"][:, :24]}, "multiples of 16"),
        (lambda a: {**a, "shared": (torch.zeros(16, 32), torch.zeros(32, 16), torch.zeros(3, 1))},
         r"the shared expert must have the routed experts' sizes, gate_up \[2I, H\] = \[32, 32\]"),
        (lambda a: {**a, "shared": (torch.zeros(32, 32), torch.zeros(32, 16), torch.zeros(2))},
         r"shared gate logits must be \[T\] or \[T, 1\] with T = 3"),
        (lambda a: {**a, "shared": (torch.zeros(32, 32).bfloat16(), torch.zeros(32, 16), torch.zeros(3))},
         "the shared expert's weights must have hidden's dtype"),
        (lambda a: {**a, "shared": (torch.zeros(32, 64)[:, ::2], torch.zeros(32, 16), torch.zeros(3))},
         "the shared expert's weights must be contiguous"),
    ],
)
def test_wrapper_validates(change, match):
    hidden, ids, wts, gate_up, down, nt = _small_args("cpu")
    args = dict(hidden=hidden, topk_ids=ids, topk_weights=wts, gate_up_proj=gate_up, down_proj=down, num_tokens=nt)
    args = change(args)
    with pytest.raises(ValueError, match=match):
        moe_experts(args.pop("hidden"), args.pop("topk_ids"), args.pop("topk_weights"),
                    args.pop("gate_up_proj"), args.pop("down_proj"), **args)
