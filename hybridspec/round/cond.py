"""Per-length dispatch with `torch.cond`: the other formulation of a round's verification.

The default round (`round.py`) verifies all 16 rows and lets the kernels skip the rows past w.
Here the w tokens are verified by one of 16 branches, each traced at exactly its length, picked on
the device by a binary tree of `torch.cond` (4 levels). A branch may not mutate its inputs, so each
verifies into `HybridState.scratch()` copies of the round's buffers (GDN factors, conv inputs, KV
buffers) and returns what the commit needs, padded to the block's width; `CondVerify` then writes
those into the state in place. Outputs equal the fixed-shape round's (`tests/runner/test_cond.py`).

Why it is not the default (measured in docs/benchmarks.md): on torch 2.11 a step holding
`torch.cond` cannot become one CUDA graph. Run eagerly, `torch.cond` reads each predicate on the
host (capture fails on that sync); under `torch.compile(mode="reduce-overhead")` the graph runs
without CUDA graphs. So this form pays a launch per kernel and a host sync per tree level.
"""

from __future__ import annotations

import torch

from hybridspec.patches.forward import Stage0, stage1, verify_forward
from hybridspec.state import HybridState


class CondVerify:
    """`(w, operands) -> (hidden, features)`, both `[B, width, ...]` (rows past w are zero), for
    one target: the whole-stack verification (`operands` = the block's tokens `[B, width]`), or
    Stage 1 after a Stage 0 the caller ran (`operands` = the `Stage0` fields for `width` rows).

    The tree is traced once by dynamo and its branches run as traced (what `torch.cond` does when
    called eagerly). Inductor cannot compile them on torch 2.11: functionalization inside a
    `torch.cond` branch rejects custom ops that write into their arguments, as `hybridspec::gdn_verify`
    writes the round's factors."""

    def __init__(self, family, model, state: HybridState, taps: tuple[int, ...], width: int, after_stage0: bool):
        self.family, self.model, self.state, self.taps = family, model, state, taps
        self.width, self.after_stage0 = width, after_stage0
        self._dispatch = torch.compile(self._tree, backend="eager", fullgraph=True, dynamic=False)

    def __call__(self, w: torch.Tensor, *operands: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._dispatch(w, 1, self.width, *operands)
        hidden, feats, z, k, g, conv_inputs = out[:6]
        keys, values = out[6:6 + len(self.state.keys)], out[6 + len(self.state.keys):]
        state = self.state
        for buf, new in zip(state.factors, (z, k, g)):
            buf.copy_(new)
        state.conv_inputs.copy_(conv_inputs)
        rows = _rows(state.length, self.width, state.keys[0])
        for buf, new in zip(state.keys + state.values, keys + values):
            buf.scatter_(2, rows, new)
        # the commit reads the first m of `width` rows
        state.written = self.width
        return hidden, feats

    def _tree(self, w, lo: int, hi: int, *operands):
        """The branch for lengths lo..hi: a leaf at one length, else a `torch.cond` on w."""
        if lo == hi:
            return self._leaf(lo, *operands)
        mid = (lo + hi) // 2

        def low(*ops):
            return self._tree(w, lo, mid, *ops)

        def high(*ops):
            return self._tree(w, mid + 1, hi, *ops)

        return torch.cond(w[0] <= mid, low, high, operands)

    def _leaf(self, n: int, *operands):
        """Verify exactly n rows into scratch buffers; return the outputs padded to the width."""
        scratch = self.state.scratch()
        if self.after_stage0:
            hidden, feats = stage1(self.family, self.model, Stage0(*operands), n, scratch, self.taps)
        else:
            hidden, feats = verify_forward(self.family, self.model, operands[0][:, :n], scratch, self.taps)
        rows = _rows(scratch.length, self.width, scratch.keys[0])
        return (_pad_rows(hidden, self.width), _pad_rows(feats, self.width), *scratch.factors, scratch.conv_inputs,
                *(buf.gather(2, rows) for buf in scratch.keys + scratch.values))


def _rows(length: torch.Tensor, width: int, like: torch.Tensor) -> torch.Tensor:
    """Each row's cache indices `length_b .. length_b + width - 1`, as a gather/scatter index into a
    KV buffer shaped like `like` `[B, Hkv, rows, D]`."""
    rows = length[:, None] + torch.arange(width, device=length.device)  # [B, width]
    return rows[:, None, :, None].expand(like.shape[0], like.shape[1], width, like.shape[3])


def _pad_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, n, ...]` -> `[B, width, ...]`, zeros after row n, with the same (contiguous) strides in
    every branch: torch.cond fails to merge branch outputs whose strides differ (for instance the
    empty features of a target without taps, padded by `F.pad`)."""
    out = x.new_zeros(x.shape[0], width, *x.shape[2:])
    out[:, : x.shape[1]] = x
    return out
