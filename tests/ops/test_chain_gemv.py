"""`benchmarks/chain_gemv.py`'s chains: under the interpreter on one program (it runs programs one
after another, so programs cannot wait for each other there), every form of a chain gives the same
bits as its reference row (one `small_linear` launch a layer; a norm kernel and `small_linear`), with
and without the weights loaded before the wait, and the product it claims; on a GPU (`gpu`), one
program per SM gives the reference's result."""

from __future__ import annotations

import pytest
import torch

from hybridspec.ops.dispatch import TRITON_INTERPRET


def _chain(device, L=3, D=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(L, D, D, generator=gen) / D**0.5).to(torch.bfloat16).to(device)
    x = torch.randn(D, generator=gen).to(torch.bfloat16).to(device)
    g = (0.1 * torch.randn(D, generator=gen)).to(torch.bfloat16).to(device)
    return x, weights, g


def _reference(x, weights, g=None, eps=1e-6):
    """fp32 products, each layer's output (and normed input) rounded to bf16."""
    y, out = x.float(), [x.float()]
    for w in weights:
        if g is not None:
            y = (y * torch.rsqrt(y.pow(2).mean() + eps) * (1 + g.float())).to(torch.bfloat16).float()
        y = (w.float() @ y).to(torch.bfloat16).float()
        out.append(y)
    return torch.stack(out)


interpreted = pytest.mark.skipif(not TRITON_INTERPRET, reason="one program under TRITON_INTERPRET=1; the gpu tests cover CUDA")


@interpreted
@pytest.mark.parametrize("prefetch", [False, True])
def test_one_persistent_program_gives_small_linears_bits(prefetch):
    from benchmarks.chain_gemv import launched_chain, persistent_chain
    from hybridspec.ops.linear import small_linear

    x, weights, _ = _chain("cpu")
    got = torch.stack(persistent_chain(x, weights, 1, prefetch))
    want = torch.stack(launched_chain(x, weights, small_linear))
    assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), _reference(x, weights), rtol=2e-2, atol=2e-2)


@interpreted
@pytest.mark.parametrize("form", ["fused", "persistent", "persistent-prefetch"])
def test_every_normed_form_gives_the_two_launch_forms_bits(form):
    from benchmarks.chain_gemv import normed_launched_chain, persistent_chain

    x, weights, g = _chain("cpu", seed=1)
    want = torch.stack(normed_launched_chain(x, weights, g, fused=False))
    if form == "fused":
        got = normed_launched_chain(x, weights, g, fused=True)
    else:
        got = persistent_chain(x, weights, 1, form.endswith("prefetch"), g)
    assert torch.equal(torch.stack(got), want)
    torch.testing.assert_close(want.float(), _reference(x, weights, g), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or TRITON_INTERPRET, reason="needs CUDA, not interpreted")
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("D", [512, 4096])
def test_every_sm_gives_the_references_result_on_cuda(prefetch, norm, D):
    from benchmarks.chain_gemv import launched_chain, normed_launched_chain, persistent_chain
    from hybridspec.ops.linear import small_linear

    x, weights, g = _chain("cuda", L=8, D=D)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if norm:
        want = torch.stack(normed_launched_chain(x, weights, g, fused=False)).float()
    else:
        want = torch.stack(launched_chain(x, weights, small_linear)).float()
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(3):
        got = torch.stack(persistent_chain(x, weights, sms, prefetch, g if norm else None, err=err)).float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert err.item() == 0


def test_shapes_are_checked():
    from benchmarks.chain_gemv import check_shapes

    with pytest.raises(ValueError, match=r"\[L, D, D\]"):
        check_shapes(torch.zeros(256), torch.zeros(2, 256, 512))
    with pytest.raises(ValueError, match="multiple of 256"):
        check_shapes(torch.zeros(128), torch.zeros(2, 128, 128))
    with pytest.raises(ValueError, match="share a dtype"):
        check_shapes(torch.zeros(256), torch.zeros(2, 256, 256, dtype=torch.bfloat16))


def test_more_programs_than_can_be_resident_are_refused():
    from benchmarks.chain_gemv import persistent_chain

    x, weights, _ = _chain("cpu", L=1, D=256)
    with pytest.raises(ValueError, match="cannot all be resident"):
        persistent_chain(x, weights, 2, prefetch=True)


@interpreted
def test_a_program_that_waits_in_vain_gives_up_and_says_so():
    # two programs under the interpreter: the first waits at layer 1 for the second, which has not
    # run yet, spins its budget out and raises the error flag instead of hanging
    from benchmarks.chain_gemv import BLOCK_K, BLOCK_M, BLOCK_N, EPS, _chain_kernel

    x, weights, _ = _chain("cpu", L=2, D=256)
    ys = torch.zeros(3, 256, dtype=torch.bfloat16)
    ys[0] = x
    done, err = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _chain_kernel[(2,)](ys, weights, x, done, err, 2, 256, weights.stride(1), weights.stride(0), EPS, 20,
                        NORM=False, PREFETCH=True, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                        PRECISION="ieee", INTERPRET=True, num_warps=4)
    assert err.item() == 1
