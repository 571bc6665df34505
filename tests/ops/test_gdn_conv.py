"""gdn_conv_verify (conv, SiLU, gates and verification in one launch) against its naive twin
(hybridspec.ops.naive_gdn_conv) and, through the model families' GDN layer, transformers' module."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridspec.ops import GDNFactors, gdn_conv_verify, naive, naive_gdn_conv
from tests.gdn_layer import check_against_transformers, layer_inputs, tiny_layer, verify_layer
from tests.helpers import assert_rel, rel_err
from tests.ops.conftest import expect_launch
from tests.ops.gdn_inputs import CONV_ARGS, ConvCase, conv_cases, make_conv_inputs

FACTOR_TOL = 1e-5
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def factor_tol(dtype: torch.dtype, device: str) -> float:
    """The factors' tolerance against the CPU twin. bf16 on the GPU: the conv's fp32 sum contracts
    to FMAs and `exp` is the GPU's, so a bf16 rounding of q, k, v or beta can flip against the twin's
    (one flip among Qwen's 128-wide heads moves the factors by ~1e-4); the interpreter computes as
    the twin does."""
    return 5e-4 if dtype == torch.bfloat16 and device == "cuda" else FACTOR_TOL


def _run(args: dict, sentinel: float = 7.0):
    """The op into an inputs buffer wider than T, filled with `sentinel` (the columns past T must keep it)."""
    B, T, C = args["mixed"].shape
    inputs = torch.full((B, C, 16), sentinel, dtype=args["mixed"].dtype, device=args["mixed"].device)
    with expect_launch("gdn_conv_verify"):
        o, f, got = gdn_conv_verify(*(args[k] for k in CONV_ARGS), num_tokens=args["num_tokens"], inputs_out=inputs)
    assert got is inputs
    return o, f, inputs


def _twin(args: dict):
    return naive_gdn_conv.gdn_conv_verify(*(None if args[k] is None else args[k].cpu() for k in CONV_ARGS),
                                          num_tokens=None if args["num_tokens"] is None else args["num_tokens"].cpu())


def _check_inputs(inputs: torch.Tensor, mixed: torch.Tensor, sentinel: float = 7.0):
    """The round's raw inputs, bit for bit (NaN rows past num_tokens included), and nothing past T."""
    T = mixed.shape[1]
    torch.testing.assert_close(inputs[:, :, :T].cpu(), mixed.transpose(1, 2).cpu(), rtol=0, atol=0, equal_nan=True)
    assert (inputs[:, :, T:] == sentinel).all(), "columns past T must be left as they were"


def _check_matches_naive(case: ConvCase, device: str):
    args = make_conv_inputs(case, device)
    o, f, inputs = _run(args)
    ref_o, ref_z, ref_k, ref_g = _twin(args)
    assert o.dtype == case.dtype and o.shape == (case.B, case.T, case.HV, case.V)
    assert_rel(o.float().cpu(), ref_o.float(), OUT_TOL[case.dtype], "o")
    for got, ref, what in ((f.z, ref_z, "z"), (f.k, ref_k, "k"), (f.g_cum, ref_g, "g_cum")):
        assert_rel(got.cpu(), ref, factor_tol(case.dtype, device), what)
    _check_inputs(inputs, args["mixed"])


@settings(max_examples=24)
@given(case=conv_cases())
@example(case=ConvCase(B=2, T=16, HK=2, group=2, K=16, V=32, dtype=torch.bfloat16, bias=True, a_scale=30.0,
                       n=(16, 5), seed=1))
@example(case=ConvCase(B=1, T=1, HK=1, group=1, K=32, V=16, dtype=torch.float32, bias=False, a_scale=1.0,
                       n=None, seed=2))
def test_matches_naive(device, case):
    """Outputs, factors and the kept inputs against the twin; rows past num_tokens hold NaN in every
    input (a NaN or inf anywhere in an output fails the relative error)."""
    _check_matches_naive(case, device)


def _dropped(args: dict, drop: str):
    """The twin's factors with one rounding left out: the conv's to the weight dtype (`conv`), SiLU's
    to the activations' (`silu`) or beta's to b's (`beta`)."""
    cpu = {k: None if v is None else v.cpu() for k, v in args.items()}
    state = cpu["state"]
    HV, K, V = state.shape[1:]
    HK = (cpu["mixed"].shape[-1] - HV * V) // (2 * K)
    weight = cpu["conv_weight"].float() if drop == "conv" else cpu["conv_weight"]
    x = F.silu(naive_gdn_conv.causal_conv(cpu["window"], cpu["mixed"].transpose(1, 2), weight, cpu["conv_bias"]).float())
    if drop != "silu":
        x = x.to(cpu["mixed"].dtype)
    q, k, v = naive_gdn_conv.split_heads(x.transpose(1, 2), HK, K, HV, V)
    b = cpu["b"].float() if drop == "beta" else cpu["b"]
    g, beta = naive_gdn_conv.gates(cpu["a"], b, cpu["A_log"], cpu["dt_bias"])
    return naive.gdn_verify(q, k, v, g, beta, state, num_tokens=cpu["num_tokens"])[1:]


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_roundings_are_the_twins(device, seed):
    """bf16: the kernel rounds where the unfused path does. Its fp32 factors match the twin to fp32
    accuracy, and each rounding left out of the twin moves them by bf16's (>= 10x further). Under
    the interpreter only: on the GPU a rounding flips now and then (`factor_tol`)."""
    if device != "cpu":
        pytest.skip("the GPU's FMAs and exp flip a bf16 rounding now and then: test_matches_naive bounds them")
    case = ConvCase(B=2, T=11, HK=2, group=2, K=16, V=32, dtype=torch.bfloat16, bias=True, a_scale=3.0, n=(11, 8),
                    seed=seed)
    args = make_conv_inputs(case, device)
    _, f, _ = _run(args)
    _, ref_z, ref_k, _ = _twin(args)
    exact = max(rel_err(f.z.cpu(), ref_z), rel_err(f.k.cpu(), ref_k))
    assert exact <= FACTOR_TOL
    for drop in ("conv", "silu", "beta"):
        z, k, _ = _dropped(args, drop)
        off = max(rel_err(f.z.cpu(), z), rel_err(f.k.cpu(), k))
        assert off >= 10 * max(exact, 1e-7), f"leaving out the {drop} rounding moved the factors by {off:.1e} only"


@pytest.mark.gpu
@settings(max_examples=16)
@given(case=conv_cases(head_dims=(128,)))
def test_matches_naive_qwen_head_dim(case):
    _check_matches_naive(case, "cuda")


@settings(max_examples=4)
@given(case=conv_cases(), poison=st.sampled_from(["nan", "inf", "-inf"]))
def test_rows_past_num_tokens_change_nothing(device, case, poison):
    """What rows past num_tokens hold (NaN, inf) changes no output of the counted rows, nor a factor."""
    if case.n is None:
        case = ConvCase(**{**case.__dict__, "n": (case.T - 1,) * case.B})
    clean = make_conv_inputs(ConvCase(**{**case.__dict__, "n": None}), device)
    clean["num_tokens"] = torch.tensor(case.n, device=device)
    dirty = dict(clean)
    past = (torch.arange(case.T, device=device)[None, :] >= clean["num_tokens"][:, None])[..., None]
    for name in ("mixed", "a", "b"):
        dirty[name] = torch.where(past, torch.full_like(clean[name], float(poison)), clean[name])
    o1, f1, _ = _run(clean)
    o2, f2, _ = _run(dirty)
    keep = ~past[..., 0]
    assert torch.equal(o1[keep], o2[keep])
    for x, y in zip(f1, f2):
        assert torch.equal(x, y)
    assert torch.isfinite(o2).all(), "rows past num_tokens must be written as finite values"


def _small(device):
    case = ConvCase(B=2, T=5, HK=1, group=2, K=16, V=16, dtype=torch.float32, bias=True, a_scale=3.0, n=(5, 3), seed=3)
    args = make_conv_inputs(case, device)
    B, T, C = args["mixed"].shape
    f = GDNFactors(torch.empty(B, T, 2, 16, device=device), torch.empty(B, T, 1, 16, device=device),
                   torch.empty(B, T, 2, device=device))
    return args, torch.zeros(B, C, 16, device=device), f


def test_opcheck(device):
    args, inputs, f = _small(device)
    # finite inputs: opcheck compares outputs of several runs, and NaN inputs rows would be copied
    mixed, a, b = (torch.nan_to_num(args[k]) for k in ("mixed", "a", "b"))
    for bias, nt in ((args["conv_bias"], args["num_tokens"]), (None, None)):
        torch.library.opcheck(
            torch.ops.hybridspec.gdn_conv_verify.default,
            (mixed, args["window"], args["conv_weight"], bias, a, b, args["A_log"], args["dt_bias"], args["state"], nt,
             inputs, *f, 0.25, True),
        )


def test_fullgraph_compile(device):
    args, inputs, f = _small(device)

    def step(args, inputs, z, k, g):
        o, _, _ = gdn_conv_verify(*(args[name] for name in CONV_ARGS), num_tokens=args["num_tokens"],
                                  inputs_out=inputs, factors_out=GDNFactors(z, k, g))
        return o

    eager_in, compiled_in = inputs.clone(), inputs.clone()
    eager_f, compiled_f = [x.clone() for x in f], [x.clone() for x in f]
    eager = step(args, eager_in, *eager_f)
    compiled = torch.compile(step, fullgraph=True)(args, compiled_in, *compiled_f)
    assert torch.equal(eager, compiled)
    torch.testing.assert_close(eager_in, compiled_in, rtol=0, atol=0, equal_nan=True)
    for x, y in zip(eager_f, compiled_f):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["qwen35", "qwen3_next"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("w, n", [(1, None), (9, None), (16, 11), (3, 0)])
def test_layer_matches_transformers(device, name, fused, w, n):
    """The family's GDN layer, fused or not, continues transformers' module from its cache."""
    check_against_transformers(name, device, fused, w, n)


@pytest.mark.parametrize("name", ["qwen35", "qwen3_next"])
def test_bf16_layer_fused_equals_unfused(device, name):
    """bf16: the fused layer rounds as the unfused one (conv, SiLU, beta in bf16): its outputs and
    factors agree, its kept inputs are the same bits."""
    model, mod = tiny_layer(name, device, dtype=torch.bfloat16)
    _, state, window, new = layer_inputs(model, mod, 13, 10)
    fused, fused_slot = verify_layer(model, new, state, window, 10, True)
    unfused, unfused_slot = verify_layer(model, new, state, window, 10, False)
    assert_rel(fused[:, :10].float(), unfused[:, :10].float(), OUT_TOL[torch.bfloat16], "layer output")
    for x, y, what in zip(fused_slot.factors, unfused_slot.factors, ("z", "k", "g_cum")):
        assert_rel(x, y, factor_tol(torch.bfloat16, device), what)
    torch.testing.assert_close(fused_slot.inputs, unfused_slot.inputs, rtol=0, atol=0, equal_nan=True)


def _bad(change):
    args, inputs, f = _small("cpu")
    args = {**args, "inputs_out": inputs}
    return change(args)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "mixed": a["mixed"][0]}, r"mixed must be \[B, T, C\]"),
        (lambda a: {**a, "mixed": a["mixed"].repeat(1, 4, 1)}, r"T must be in 1..16"),
        (lambda a: {**a, "mixed": a["mixed"][..., :-16]}, r"mixed's 48 channels must be 2 \* HK \* 16 \(q, k\) \+ 2 \* 16"),
        (lambda a: {**a, "state": a["state"].double()}, r"state must be contiguous fp32"),
        (lambda a: {**a, "state": a["state"][..., :12].contiguous()}, r"value head dim must be a power of two"),
        (lambda a: {**a, "window": a["window"][:, :-1]}, r"window must be \[B, C, KW\] = \[2, 64, KW\]"),
        (lambda a: {**a, "conv_weight": a["conv_weight"][:, :3]}, r"conv_weight must be \[C, KW\] = \[64, 4\]"),
        (lambda a: {**a, "conv_bias": a["conv_bias"][:-1]}, r"conv_bias must be contiguous \[C\] = \[64\]"),
        (lambda a: {**a, "a": a["a"][:, :, :1]}, r"a must be \[B, T, HV\] = \[2, 5, 2\]"),
        (lambda a: {**a, "b": torch.zeros(2, 2, 5).transpose(1, 2)}, r"b must be contiguous in its last dim"),
        (lambda a: {**a, "A_log": a["A_log"][:1]}, r"A_log must be contiguous \[HV\] = \[2\]"),
        (lambda a: {**a, "a": a["a"].int()}, r"a must be fp32, bf16 or fp16"),
        (lambda a: {**a, "num_tokens": torch.tensor([1.0, 2.0])}, r"num_tokens must be an integer tensor of shape \[B\]"),
        (lambda a: {**a, "inputs_out": a["inputs_out"][..., :4]}, r"inputs_out must be \[B, C, W\] = \[2, 64, W >= 5\]"),
        (lambda a: {**a, "inputs_out": a["inputs_out"].double()}, r"inputs_out must be torch.float32 on cpu as mixed"),
    ],
)
def test_rejects_bad_input_naming_shapes(change, message):
    args = _bad(change)
    with pytest.raises(ValueError, match=message):
        gdn_conv_verify(*(args[k] for k in CONV_ARGS), num_tokens=args["num_tokens"], inputs_out=args["inputs_out"])
