"""`ContextCache`: the drafter's per-layer context keys/values, indexed by target position.

Row p of a batch row holds the keys/values of that row's target position p. Writes land at each
row's device-resident length L ("write w rows at L..L+w-1, advance L by m <= w"), so no shape
depends on a length and nothing reads one on the host. A host-side bound on the lengths (exact
while lengths advance by Python ints, conservative under device tensors) decides when the cache
must grow; a cache sized with `max_length` never grows.

A left-padded batch row starts at its padding count `start` (`[B]`): rows before it hold the
padding's features, which attention masks out, and a row's RoPE position is `index - start`, the
position transformers gives the same token in the padded batch.
"""

from __future__ import annotations

import torch

# rows allocated when the caller names no maximum length; the cache doubles when it fills
MIN_ROWS = 64


class ContextCache:
    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, rows, dtype, device):
        shape = (num_layers, batch_size, num_kv_heads, rows, head_dim)
        # zeros, not empty: masked rows still enter the attention product, and 0 * NaN is NaN
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, KVH, rows, d]
        self.v = torch.zeros_like(self.k)
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.start = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] first valid row
        # the batch index of an index_put into the cache, made once (not a kernel every round)
        self.batch = torch.arange(batch_size, device=device)[:, None]  # [B, 1]
        self.limit: int | None = None
        self.bound = 0

    @property
    def rows(self) -> int:
        return self.k.shape[3]

    def fits(self, batch_size, rows, dtype, device) -> bool:
        return self.k.shape[1] == batch_size and self.rows >= rows and self.k.dtype == dtype and self.k.device == device

    def clear(self, limit: int | None, start: torch.Tensor | None = None) -> None:
        self.length.zero_()
        if start is None:
            self.start.zero_()
        else:
            self.start.copy_(start)
        self.limit, self.bound = limit, 0

    def reserve(self, n: int) -> None:
        """Make rows up to every length + n exist."""
        need = self.bound + n
        if need <= self.rows:
            return
        k, v = (x.new_zeros(*x.shape[:3], max(need, 2 * self.rows), x.shape[4]) for x in (self.k, self.v))
        k[:, :, :, : self.rows] = self.k
        v[:, :, :, : self.rows] = self.v
        self.k, self.v = k, v

    def positions(self, n: int) -> torch.Tensor:
        """Cache rows L..L+n-1 of every row `[B, n]` (`observe` and `propose` write there by index_put)."""
        return self.length[:, None] + torch.arange(n, device=self.length.device)

    def rope_positions(self, rows: torch.Tensor) -> torch.Tensor:
        """RoPE positions of cache rows `[B, n]`: the row index less the row's left padding."""
        return rows - self.start[:, None]

    def advance(self, written: int, num_commit: torch.Tensor | int) -> None:
        if isinstance(num_commit, torch.Tensor):
            self.length += num_commit.to(self.length.device, torch.long)
            self.bound += written
        else:
            self.length += num_commit
            self.bound += num_commit
        if self.limit is not None:
            self.bound = min(self.bound, self.limit)
