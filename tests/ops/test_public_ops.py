"""Every public op, called twice in a row through `hybridspec.ops`: a kernel module imported on the
first Triton launch must not shadow the op of the same package attribute (it once did:
`hybridspec.ops.gdn_verify` became the kernel module after the first call)."""

import torch

import hybridspec.ops
from tests.ops.gdn_inputs import GDNCase, make_inputs
from tests.ops.moe_inputs import MoECase
from tests.ops.moe_inputs import make_inputs as moe_inputs

GDN = GDNCase(B=1, T=4, HK=2, group=2, K=16, V=16, dtype=torch.float32, decay="mixed", gate="random", seed=3)
MOE = MoECase(T=3, K=2, E=4, H=32, I=32, dtype=torch.float32, routing="random", n=None, seed=3)


def test_every_public_op_is_callable_twice(device):
    ops = hybridspec.ops
    for _ in range(2):
        q, k, v, g, beta, state = make_inputs(GDN, device)
        o, factors = ops.gdn_verify(q, k, v, g, beta, state)
        assert torch.isfinite(o).all()
        states = state[None].clone()
        ops.gdn_commit(states, ops.stack_factors([factors]), torch.full((GDN.B,), GDN.T, device=device))
        assert torch.isfinite(states).all()
        hidden, ids, weights, gate_up, down, _ = moe_inputs(MOE, device)
        assert torch.isfinite(ops.moe_experts(hidden, ids, weights, gate_up, down)).all()
        keys = torch.randn(1, 2, 8, 16, device=device)
        out = ops.decode_attention(torch.randn(1, 2, 4, 16, device=device), keys, keys.clone(),
                                   torch.tensor([3], device=device))
        assert torch.isfinite(out).all()
        tokens, conf, ent = ops.lm_head_top1(torch.randn(3, 16, device=device), torch.randn(40, 16, device=device))
        assert torch.isfinite(conf).all() and torch.isfinite(ent).all()
        weights, ids = ops.route_topk(torch.randn(3, 20, device=device), 4)
        assert torch.isfinite(weights).all() and ids.shape == (3, 4)
        assert torch.isfinite(ops.small_linear(torch.randn(3, 20, device=device), torch.randn(7, 20, device=device))).all()
    for name in hybridspec.ops.__all__:
        assert not isinstance(getattr(ops, name), type(hybridspec.ops)), f"hybridspec.ops.{name} is a module"
