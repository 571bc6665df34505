"""The accept stage of a round: which verified positions to keep and the token that follows them.

The target scored `w` positions: position i predicts the token after `(x_0, d_1, .., d_i)`. With
`processed` the logits after transformers' processors and warpers at every position, and `draft`
holding `d_1 .. d_{w-1}`, both rules return

    tokens [B, w]: tokens[:, :A] = d_1 .. d_A, tokens[:, A] = x_new, later columns arbitrary
    accepted [B]:  A, the number of leading drafts kept (0 .. w - 1)

on the device, with no host read and a fixed amount of random draws per round.

Greedy: `A` = longest prefix with `d_i == argmax`; `x_new` = the argmax at position A.

Sampling, the point-mass rule: the drafts are the drafter's top-1 tokens, a point mass at `d_i`,
so speculative sampling's `min(1, p_t / p_d)` becomes `p_t(d_i)`. Accept `d_i` with probability
`p_t(d_i)`; at the first rejection sample `x_new` from `p_t` with `d_i` removed and renormalised;
after the last draft sample the bonus `x_new` from `p_t`. Each emitted token then has exactly the
target's processed distribution given the tokens before it, whatever `w` was chosen before the
draws, so the output distribution is that of target-only sampling (not its tokens for a seed).
"""

from __future__ import annotations

import torch


def process_positions(logits_processor, seq: torch.Tensor, draft: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Logits `[B, w, V]` of the w verified positions after `logits_processor`; position i sees the
    context `cat(seq, draft[:, :i])`, the sequence target-only decoding would hold there if
    d_1 .. d_i are accepted. Returns `[B, w, V]`."""
    w = logits.shape[1]
    return torch.stack(
        [logits_processor(torch.cat([seq, draft[:, :i]], dim=-1), logits[:, i]) for i in range(w)], dim=1
    )


def _accepted(keep: torch.Tensor) -> torch.Tensor:
    """`keep` bool `[B, w - 1]`: draft i passes its test -> A `[B]`, the length of the passing prefix."""
    return keep.long().cumprod(dim=-1).sum(dim=-1)


def _take_drafts(draft: torch.Tensor, new: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Columns before A from `draft`, the rest from `new` `[B, w]`."""
    w = new.shape[1]
    column = torch.arange(w, device=new.device)
    padded = torch.cat([draft[:, : w - 1], new[:, w - 1 :]], dim=-1)
    return torch.where(column < accepted[:, None], padded, new)


def _counted(w: int, num_tokens: torch.Tensor | None, device) -> torch.Tensor | bool:
    """Bool `[B, w - 1]`: draft column i belongs to the round (i < num_tokens - 1); True when all do."""
    if num_tokens is None:
        return True
    return torch.arange(w - 1, device=device) < (num_tokens[:, None] - 1)


def greedy_accept(processed: torch.Tensor, draft: torch.Tensor,
                  num_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of `processed` `[B, w, V]` against `draft` `[B, >= w - 1]`. The runner
    scores a fixed w rows and passes the round's own length `num_tokens` `[B]`; positions from it
    on are ignored."""
    return greedy_accept_tokens(processed.argmax(dim=-1), draft, num_tokens)


def greedy_accept_tokens(best: torch.Tensor, draft: torch.Tensor,
                         num_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_accept` given each position's argmax `best` `[B, w]` (the fused LM head's top-1)."""
    w = best.shape[1]
    accepted = _accepted((best[:, : w - 1] == draft[:, : w - 1]) & _counted(w, num_tokens, best.device))
    # where the drafts are kept they equal the argmax, so the argmax row is the answer
    return best, accepted


def sample_accept(processed: torch.Tensor, draft: torch.Tensor,
                  num_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The point-mass rule on `processed` `[B, w, V]` against `draft` `[B, >= w - 1]`, drawing from
    torch's global generator (so `torch.manual_seed` reproduces a run). `num_tokens` as in
    `greedy_accept`: the round's last counted position draws the bonus from the full `p_t`."""
    B, w, _ = processed.shape
    d = draft[:, : w - 1]
    counted = _counted(w, num_tokens, d.device)
    # the distribution transformers samples from: softmax of the processed scores, -inf -> 0
    probs = processed.float().softmax(dim=-1)  # [B, w, V]
    p_draft = probs[:, : w - 1].gather(-1, d[..., None]).squeeze(-1)  # [B, w - 1]
    # u < p is never true for p = 0 and always true for p = 1 (u is in [0, 1))
    uniform = torch.rand(B, w - 1, device=processed.device)
    accepted = _accepted((uniform < p_draft) & counted)
    # the residual at position i < w - 1 removes d_{i+1}; the last position keeps p_t for the bonus
    residual = probs.clone()
    removed = torch.zeros_like(p_draft) if num_tokens is None else torch.where(counted, 0.0, p_draft)
    residual[:, : w - 1].scatter_(-1, d[..., None], removed[..., None])
    # exponential race: argmax_j r_j / E_j with E_j ~ Exp(1) is distributed as r / sum(r), so no
    # renormalisation, no host sync; an all-zero residual (p_t(d) = 1, never used) gives index 0
    race = torch.empty_like(residual).exponential_()
    # E = 0 would make 0 / 0 = NaN for a token of zero probability, and argmax prefers NaN
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    new = (residual / race).argmax(dim=-1)  # [B, w]
    return _take_drafts(d, new, accepted), accepted


EMPTY_MESSAGE = ("probability tensor contains either `inf`, `nan` or element < 0: every token of a sampled "
                 "position was masked (all processed scores -inf or NaN)")


def first_empty(processed: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """`[B]` long: the first emitted position (0..A) whose processed scores are all -inf or NaN,
    where transformers' sampler raises rather than emit a token; `w + 1` where there is none."""
    w = processed.shape[1]
    bad = processed.amax(-1).isneginf() | processed.isnan().any(-1)  # [B, w]
    bad &= torch.arange(w, device=bad.device) <= accepted[:, None]
    return torch.where(bad.any(-1), bad.int().argmax(-1), w + 1)


def read_accepted(accepted: torch.Tensor, processed: torch.Tensor, sampling: bool) -> tuple[int, int]:
    """The host read of the eager loop, batch row 0: A, and (when sampling) the first emitted
    position with an empty distribution (`w + 1` if none; greedy picks a token as argmax does).
    The caller raises `RuntimeError(EMPTY_MESSAGE)` on reaching that position: a stop token
    before it ends generation first, as it would end target-only sampling."""
    if not sampling:
        return int(accepted[0]), processed.shape[1] + 1
    kept, empty = torch.stack([accepted[0], first_empty(processed, accepted)[0]]).tolist()
    return kept, empty
