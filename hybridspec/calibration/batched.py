"""The batched entries of a calibration (`hybridspec calibrate --batch-sizes 1 2 4`).

For each batch size B >= 2:

- `C_B(w)`: the measured time of the fixed-shape batched round at each length of the batched set
  (docs/design.md, "Batched rounds"), timed on left-padded batches of B calibration prompts.
- `rho_B`: Dinkelbach's fixed point of pooled throughput over batches of B recorded rounds (the
  capture run's, grouped in order), with a batch's gain at w the sum of its rows' expected tokens.
- `nbar_B`: the mean Layer-0 experts that the positions between two lengths of the set add to the
  union over a batch, from the same groups' recorded routing; `eta` is the per-expert cost of B = 1.
- the best fixed length of the set for "static".
"""

from __future__ import annotations

import numpy as np
import torch

from hybridspec.calibration.artifact import BatchCalibration
from hybridspec.calibration.capture import mean_round_ms
from hybridspec.calibration.costs import best_static_length, dinkelbach_rho
from hybridspec.ops.routing import distinct_prefix_counts
from hybridspec.policy import batch_lengths


def left_padded(prompts: list[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[1, n_b]` prompts -> left-padded `[B, P]` ids and their attention mask."""
    P = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - p.shape[1]:] = p[0]
        mask[b, P - p.shape[1]:] = 1
    return ids, mask


def stacked_continuations(continuations: list[torch.Tensor]) -> torch.Tensor:
    """`[n_b]` continuations -> `[B, max n_b]`, zeros after a shorter one (drafts there are wrong)."""
    n = max(c.shape[0] for c in continuations)
    out = torch.zeros(len(continuations), n, dtype=torch.long, device=continuations[0].device)
    for b, c in enumerate(continuations):
        out[b, : c.shape[0]] = c
    return out


def groups_of(items: list, size: int) -> list[list]:
    """Consecutive groups of `size` (the last partial group dropped); one group cycling the items
    when there are fewer than `size`."""
    groups = [items[i: i + size] for i in range(0, len(items) - size + 1, size)]
    return groups or [[items[i % len(items)] for i in range(size)]]


def timed_batch_round_ms(model, drafter, runs, batch_size: int, max_new_tokens: int, w: int, timed_groups: int | None,
                         accept=None) -> float:
    """Mean round time of left-padded batches of `batch_size` calibration prompts at length w, on
    the runner (the first batch only warms up: capture, compiles)."""
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad)
    groups = groups_of(runs, batch_size)
    groups = groups if timed_groups is None else groups[: timed_groups + 1]
    calls = []
    for group in groups:
        ids, mask = left_padded([ids for ids, _ in group], pad)
        continuation = stacked_continuations([c for _, c in group]) if group[0][1] is not None else None
        calls.append((ids, mask, continuation))
    return mean_round_ms(model, drafter, calls, f"timing B = {batch_size}, w = {w}", verify_length=w,
                         max_new_tokens=max_new_tokens, hybridspec_accept=accept, pad_token_id=pad)


def batch_union_new(layer0_ids: list[torch.Tensor], batch_size: int, lengths: tuple[int, ...],
                    num_experts: int) -> tuple[float, ...]:
    """`nbar_B[i]`: mean over groups of `batch_size` full rounds (Layer-0 ids `[W, k]` each) of the
    experts positions `lengths[i]..lengths[i+1]-1` add to the union over the group; 0 for the last."""
    if len(layer0_ids) < batch_size:
        return tuple(0.0 for _ in lengths)
    added = []
    for group in groups_of(layer0_ids, batch_size):
        ids = torch.stack(group)  # [B, W, k]
        B, W, k = ids.shape
        union = distinct_prefix_counts(ids.transpose(0, 1).reshape(1, W, B * k), num_experts)[0]
        added.append([float(union[b - 1] - union[a - 1]) for a, b in zip(lengths, lengths[1:])] + [0.0])
    return tuple(float(v) for v in np.mean(added, axis=0))


def batch_gains(gains: np.ndarray, tokens: np.ndarray, batch_size: int, lengths: tuple[int, ...]):
    """Per-round `[R, W]` expected gains and emitted tokens -> per batch of `batch_size` consecutive
    rounds, their sums, with columns outside `lengths` made unchoosable."""
    R, W = gains.shape
    n = R // batch_size
    if n == 0:
        raise ValueError(f"fewer recorded rounds ({R}) than the batch size {batch_size}: add prompts or tokens")
    g = gains[: n * batch_size].reshape(n, batch_size, W).sum(1)
    t = tokens[: n * batch_size].reshape(n, batch_size, W).sum(1).astype(np.float64)
    off = np.ones(W, dtype=bool)
    off[[w - 1 for w in lengths]] = False
    g[:, off] = -1e9
    t[:, off] = -1e9
    return g, t


def calibrate_batch(model, drafter, runs, batch_size: int, block_size: int, gains: np.ndarray, tokens: np.ndarray,
                    layer0_ids: list[torch.Tensor], eta_ms: float, num_experts: int, max_new_tokens: int,
                    timed_groups: int | None, accept=None) -> BatchCalibration:
    """One batch size's entry (module docstring)."""
    lengths = batch_lengths(block_size)
    round_ms = [timed_batch_round_ms(model, drafter, runs, batch_size, max_new_tokens, w, timed_groups, accept)
                for w in lengths]
    # the measured round times stand for the whole round (no fixed part split off); lengths off
    # the set get the next measured time (never chosen: their gains are -inf)
    cost = np.array([round_ms[min(i for i, L in enumerate(lengths) if L >= w)] if w <= lengths[-1] else round_ms[-1]
                     for w in range(1, block_size + 1)])
    g, t = batch_gains(gains, tokens, batch_size, lengths)
    rho = dinkelbach_rho(g, cost, 0.0)
    static = best_static_length(t, cost, 0.0)
    return BatchCalibration(batch_size=batch_size, lengths=lengths, cost=tuple(float(c) for c in round_ms), rho=rho,
                            eta_ms=eta_ms, nbar=batch_union_new(layer0_ids, batch_size, lengths, num_experts),
                            static_length=static)
