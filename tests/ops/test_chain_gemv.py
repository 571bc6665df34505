"""`benchmarks/chain_gemv.py`'s persistent chain under the interpreter, on one program (the
interpreter runs programs one after another, so programs cannot wait for each other there): the
same bits as one `small_linear` launch a layer, with and without the weights loaded before the
wait, and every program count on a GPU (`gpu`)."""

from __future__ import annotations

import pytest
import torch

from hybridspec.ops.dispatch import TRITON_INTERPRET


def _chain(device, L=3, D=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(L, D, D, generator=gen) / D**0.5).to(torch.bfloat16).to(device)
    x = torch.randn(D, generator=gen).to(torch.bfloat16).to(device)
    return x, weights


@pytest.mark.skipif(not TRITON_INTERPRET, reason="one program under TRITON_INTERPRET=1; the gpu test covers CUDA")
@pytest.mark.parametrize("prefetch", [False, True])
def test_one_program_gives_small_linears_bits(prefetch):
    from benchmarks.chain_gemv import launched_chain, persistent_chain
    from hybridspec.ops.linear import small_linear

    x, weights = _chain("cpu")
    got = persistent_chain(x, weights, 1, prefetch)
    want = launched_chain(x, weights, small_linear)
    assert torch.equal(got, want)
    # and the chain is the product it claims, to bf16 rounding
    ref = x.float()
    for w in weights:
        ref = (w.float() @ ref).to(torch.bfloat16).float()
    torch.testing.assert_close(got[-1].float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("D", [512, 4096])
def test_every_sm_gives_small_linears_result_on_cuda(prefetch, D):
    from benchmarks.chain_gemv import launched_chain, persistent_chain
    from hybridspec.ops.linear import small_linear

    x, weights = _chain("cuda", L=8, D=D)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = launched_chain(x, weights, small_linear)
    for _ in range(3):
        got = persistent_chain(x, weights, sms, prefetch)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2


def test_shapes_are_checked():
    from benchmarks.chain_gemv import check_shapes

    with pytest.raises(ValueError, match=r"\[L, D, D\]"):
        check_shapes(torch.zeros(256), torch.zeros(2, 256, 512))
    with pytest.raises(ValueError, match="multiple of 256"):
        check_shapes(torch.zeros(128), torch.zeros(2, 128, 128))
    with pytest.raises(ValueError, match="share a dtype"):
        check_shapes(torch.zeros(256), torch.zeros(2, 256, 256, dtype=torch.bfloat16))
