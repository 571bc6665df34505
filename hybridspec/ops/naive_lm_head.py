"""Top-1 token, its probability and the entropy of an LM head's softmax, through the full `[N, V]`
logits: the oracle for `lm_head_triton.py`, the op's body on CPU, and what `DFlashDrafter.propose`
computed before the fused op (`compute_logits` without softcapping, then argmax and an fp32 softmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_head_top1(hidden: torch.Tensor, weight: torch.Tensor, scale: float = 1.0):
    """`hidden` `[N, H]` and `weight` `[V, H]` in one dtype. The logits are `F.linear(hidden, weight)`
    in that dtype (rounded from fp32 accumulation) times `scale` (rounded again); returns the
    argmax token (int64, the first index of the maximum, as `torch.argmax`), its softmax probability
    and the softmax's entropy in nats (fp32, the softmax taken in fp32), each `[N]`."""
    logits = F.linear(hidden, weight) * scale
    tokens = torch.argmax(logits, dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)
    confidence = probs.gather(-1, tokens[:, None])[:, 0]
    return tokens, confidence, torch.special.entr(probs).sum(-1)
