"""Emitting a round's tokens on the host, as target-only decoding would: token by token, with the
stopping decision after each, and transformers' empty-distribution error at the same token."""

from __future__ import annotations

from typing import Callable, Sequence

from hybridspec.round.accept import EMPTY_MESSAGE


def emit(tokens: Sequence[int], empty: int, take: Callable[[int, int], bool]) -> tuple[int, bool]:
    """Hand the round's emitted `tokens` (the first m) to `take(i, token)`, which appends token i
    and returns True to stop after it. `empty`: the first position whose sampled distribution was
    empty (raise on reaching it; a stop before it ends generation first). Returns `(kept, done)`:
    the drafts kept (the index of the last token taken) and whether generation stops here."""
    for i, token in enumerate(tokens):
        if i == empty:
            raise RuntimeError(EMPTY_MESSAGE)
        if take(i, token):
            return i, True
    return len(tokens) - 1, False
