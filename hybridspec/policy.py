"""Verification length per round (docs/design.md, "Length policy"), on the device.

    p_i = prod_{j <= i} c_j,   w0 = argmax_{2 <= w <= W} [1 + sum_{i < w} p_i - rho * C(w)]

ties to the shorter w, capped by the remaining output budget. Every w is scored (the curve may
be nonconvex). With a calibration artifact (`hybridspec calibrate`), `c_i` comes from the fitted
acceptance model, `C` and `rho` from measured round times, and the "hybridspec" policy adds the
routing correction at the Layer-0 router boundary. Without one, the built-in default takes `c_i`
as the raw top-1 confidence and a linear cost curve, and runs no correction.

The policies that `generate(..., policy=...)` names:

- "hybridspec": calibrated selection, routing correction, two-stage verification (Stage 0 up to the
  Layer-0 router for `u = w0 + 1` tokens, Stage 1 resumes there for the chosen w).
- "no_two_stage": the same lengths, but Stage 0 only feeds the correction and the chosen w tokens
  are then verified from the embedding again (the ablation of the resumable split).
- "nominal": calibrated selection without correction (`w = w0`).
- "static": the calibrated best fixed length.
- "dcut": lengths {4, 8, 12, 16} by expected tokens / profiled round time, raw confidences.
- "evict": every length 2..W by expected tokens / profiled round time, raw confidences.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import ClassVar, NamedTuple, Protocol, runtime_checkable

import torch

from hybridspec.cache import BoundedCache
from hybridspec.drafter.protocol import DraftBlock
from hybridspec.ops.routing import distinct_prefix_counts


class Constants(dict):
    """A policy's constant tensors per (values, device), built on first use. The first build copies
    from the host, which a CUDA-graph capture forbids, so the runner's warm-up round builds them
    before capture; they live as long as the policy, so a captured graph never reads a freed one."""

    def tensor(self, values: tuple, device) -> torch.Tensor:
        key = (values, torch.device(device))
        if key not in self:
            self[key] = torch.tensor(values, device=device)
        return self[key]


def _constants():
    return field(default_factory=Constants, compare=False, repr=False)


@dataclass(frozen=True)
class LengthPolicy:
    """`cost[w - 1]` = target cost of verifying w tokens; `rho` = tokens per unit cost that an
    extra verified token must beat (the calibrated pooled throughput)."""

    cost: tuple[float, ...]
    rho: float
    constants: Constants = _constants()

    @classmethod
    def builtin_default(cls, max_len: int = 16) -> LengthPolicy:
        # verifying w tokens costs about one AR step plus 3% per extra token (launch-bound small
        # batches); a draft token is worth verifying while its prefix probability exceeds ~0.06
        return cls(cost=tuple(1.0 + 0.03 * (w - 1) for w in range(1, max_len + 1)), rho=2.0)

    def select(self, c: torch.Tensor, max_w: int | torch.Tensor) -> torch.Tensor:
        """Conditional acceptance probabilities `c` `[B, D]` -> w0 `[B]` in `2..min(D + 1, max_w)`
        (or 1 when `max_w` is 1). `max_w`: an int, or a `[B]` device tensor (the runner)."""
        return self.select_prefix(prefix_probabilities(c), max_w)

    def select_prefix(self, prefix: torch.Tensor, max_w: int | torch.Tensor) -> torch.Tensor:
        """`select` from the prefix probabilities `p` `[B, D]`."""
        B, D = prefix.shape
        cap = budget(max_w, B, prefix.device)
        top = min(D + 1, len(self.cost))
        if top <= 1:
            return torch.ones(B, dtype=torch.long, device=prefix.device)
        ws = self.constants.tensor(tuple(range(2, top + 1)), prefix.device)
        gain = expected_tokens(prefix)[:, ws - 1]
        score = gain - self.rho * self.constants.tensor(self.cost[1:top], prefix.device)
        score = score.masked_fill(ws > cap[:, None], float("-inf"))
        # argmax returns the first maximum: ties go to the shorter length
        return torch.where(cap < 2, cap.clamp(min=1), ws[score.argmax(dim=-1)])


def budget(max_w: int | torch.Tensor, batch_size: int, device) -> torch.Tensor:
    """The remaining output budget as a `[B]` long tensor (the runner passes one already)."""
    if isinstance(max_w, torch.Tensor):
        return max_w
    return torch.full((batch_size,), max_w, dtype=torch.long, device=device)


def conditional_acceptance(acceptance: AcceptanceModel | None, block: DraftBlock) -> torch.Tensor:
    """`[B, D]` conditional acceptance probabilities of a block's drafts: the calibrated model's, or
    the raw top-1 confidence without one."""
    return block.confidence if acceptance is None else acceptance.predict(block.confidence, block.entropy)


def prefix_probabilities(c: torch.Tensor) -> torch.Tensor:
    """`[B, D]` conditional probabilities -> `p_i = prod_{j <= i} c_j`, float32."""
    return torch.cumprod(c.float().clamp(0, 1), dim=-1)


def expected_tokens(prefix: torch.Tensor) -> torch.Tensor:
    """Prefix probabilities `[B, D]` -> `[B, D + 1]`: column w - 1 is the expected tokens of a round
    verified at length w, the anchor's token plus `p_1 .. p_{w-1}`."""
    return 1 + torch.cat([prefix.new_zeros(prefix.shape[0], 1), torch.cumsum(prefix, dim=-1)], dim=-1)


class Selection(NamedTuple):
    """A round's nominal choice: `w0` `[B]` and the prefix probabilities `p` `[B, D]` behind it."""

    w0: torch.Tensor
    prefix: torch.Tensor


@dataclass(frozen=True)
class RoutingCorrection:
    """Step 4: keep token `w0 + 1` only if `p_{w0} > rho * dL`, with
    `dL = C(w0+1) - C(w0) - s + eta * (nbar_given[w0, n_new] - nbar[w0])` (tables from calibration,
    indexed by w0 as in `hybridspec.calibration.costs.routing_tables`)."""

    cost: torch.Tensor  # [W] C(w) at index w - 1, ms
    rho: float  # tokens / ms
    s: float  # ms per Stage-0 token
    eta: float  # ms per distinct expert per MoE layer
    nbar: torch.Tensor
    nbar_given: torch.Tensor

    def to(self, device) -> RoutingCorrection:
        """The same correction with its tables on `device`."""
        return replace(self, cost=self.cost.to(device), nbar=self.nbar.to(device), nbar_given=self.nbar_given.to(device))

    def keep_extra(self, prefix: torch.Tensor, w0: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
        """Bool `[B]`: verify `w0 + 1` tokens instead of `w0`. No host read."""
        p_w0 = prefix.gather(1, (w0 - 1).clamp(max=prefix.shape[1] - 1)[:, None])[:, 0]
        return keep_extra_token(p_w0, self.rho, self.cost, w0, self.s, self.eta, self.nbar, self.nbar_given, n_new)

    def extend(self, selection: Selection, topk_ids: torch.Tensor, cap: torch.Tensor, num_experts: int,
               distinct: torch.Tensor | None = None) -> torch.Tensor:
        """The verified length `[B]`: w0, or w0 + 1 where the correction keeps token w0 + 1, given
        Stage 0's Layer-0 expert ids `[B, W, k]` and the budget `cap` `[B]`; `distinct` `[B, W]`:
        their `distinct_prefix_counts` where the caller has them."""
        w0 = selection.w0
        if distinct is None:
            distinct = distinct_prefix_counts(topk_ids, num_experts)  # [B, W]
        W = distinct.shape[1]
        # token w0 + 1 against the union of the first w0: entry w0 of the new-expert counts
        at = w0.clamp(1, W - 1)[:, None]
        n_new = (distinct.gather(1, at) - distinct.gather(1, at - 1))[:, 0]
        room = (w0 < cap) & (w0 < W)
        return w0 + (self.keep_extra(selection.prefix, w0, n_new) & room).long()


def keep_extra_token(p_w0: torch.Tensor, rho: float, cost: torch.Tensor, w0: torch.Tensor, s: float, eta: float,
                     nbar: torch.Tensor, nbar_given: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Routing correction: True where the round verifies `w0 + 1` tokens instead of `w0`.

    `p_w0` `[B]` prefix probability of draft w0 (the extra token's expected gain); `rho` tokens/ms;
    `cost` `[W]` ms with `cost[w - 1] = C_tgt(w)`; `w0` `[B]` long, the selector's length; `s` ms
    per Stage-0 token; `eta` ms per distinct expert per MoE layer; `nbar` `[W]`, `nbar_given`
    `[W, k + 1]` (`RoutingTables`); `n` `[B]` long, Layer-0 experts token w0 + 1 adds.
    Returns bool `[B]`; False where `w0 >= W` (no longer input exists). Gathers only: no host reads."""
    W = cost.shape[0]
    room = w0 < W
    # 0-based: cost[w0] = C_tgt(w0 + 1); w0 = W has no such entry, its index is clamped and `room` masks it
    i = w0.clamp(1, W - 1)
    nn = n.clamp(0, nbar_given.shape[1] - 1)
    step = cost[i] - cost[i - 1]
    deviation = nbar_given[i, nn] - nbar[i]
    dL = step - s + eta * deviation
    return room & (p_w0 > rho * dL)


@runtime_checkable
class AcceptanceModel(Protocol):
    """Calibrated conditional acceptance probabilities from the drafter's signals (fitted by
    `hybridspec.calibration.acceptance`; the policy only evaluates it)."""

    def predict(self, confidence: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """`[B, D]` confidences and entropies -> `[B, D]` conditional acceptance probabilities."""
        ...

    def prepare(self, device) -> object:
        """Build its device tensors on `device` (before a CUDA-graph capture)."""
        ...


@runtime_checkable
class Correction(Protocol):
    """The routing correction at the Layer-0 router boundary: may lengthen the nominal choice."""

    def to(self, device) -> Correction:
        ...

    def extend(self, selection: Selection, topk_ids: torch.Tensor, cap: torch.Tensor, num_experts: int,
               distinct: torch.Tensor | None = None) -> torch.Tensor:
        """w `[B]` from the selection, Stage 0's Layer-0 expert ids `[B, W, k]` and the budget `[B]`;
        `distinct` `[B, W]`: each row's `distinct_prefix_counts` of those ids, where the caller has
        them (an implementation may need other counts and ignore it)."""
        ...


@runtime_checkable
class Policy(Protocol):
    """What a round asks of a length policy. `select` picks the nominal length w0 on the device;
    `correction` (or None) decides on one more token at the Layer-0 router boundary; `two_stage`
    says whether the chosen tokens resume from that boundary (True) or are verified again from the
    embedding (the "no_two_stage" ablation); `prepare` builds device constants before capture."""

    name: str
    correction: Correction | None
    two_stage: bool

    def select(self, block: DraftBlock, max_w: int | torch.Tensor) -> Selection:
        ...

    def prepare(self, device) -> None:
        ...


@dataclass(frozen=True)
class AdaptivePolicy:
    """Per-round `w0` from an acceptance model (raw confidence when `acceptance` is None) and a
    cost curve; with `correction`, the routing correction decides on one more token."""

    name: str
    length: LengthPolicy
    acceptance: AcceptanceModel | None = None
    correction: RoutingCorrection | None = None
    two_stage: bool = True

    def prepare(self, device) -> None:
        if self.acceptance is not None:
            self.acceptance.prepare(device)

    def select(self, block: DraftBlock, max_w: int | torch.Tensor) -> Selection:
        prefix = prefix_probabilities(conditional_acceptance(self.acceptance, block))
        return Selection(self.length.select_prefix(prefix, max_w), prefix)


@dataclass(frozen=True)
class RatioPolicy:
    """D-Cut and EVICT: the length in `lengths` that maximises expected tokens (raw confidences)
    per profiled round time `fixed_ms + C(w)`; ties to the shorter."""

    name: str
    lengths: tuple[int, ...]
    cost: tuple[float, ...]
    fixed_ms: float
    constants: Constants = _constants()
    correction: ClassVar[None] = None
    two_stage: ClassVar[bool] = True

    def prepare(self, device) -> None:
        pass

    def select(self, block: DraftBlock, max_w: int | torch.Tensor) -> Selection:
        prefix = prefix_probabilities(block.confidence)
        B, D = prefix.shape
        cap = budget(max_w, B, prefix.device)
        usable = tuple(w for w in self.lengths if w <= D + 1)
        if not usable:
            return Selection(cap.clamp(1, D + 1), prefix)
        ws = self.constants.tensor(usable, prefix.device)
        gain = expected_tokens(prefix)[:, ws - 1]
        time = self.fixed_ms + self.constants.tensor(tuple(self.cost[w - 1] for w in usable), prefix.device)
        ratio = (gain / time).masked_fill(ws > cap[:, None], float("-inf"))
        # a budget below the smallest candidate verifies what is left
        short = cap < min(usable)
        return Selection(torch.where(short, cap.clamp(1, D + 1), ws[ratio.argmax(-1)]), prefix)


@dataclass(frozen=True)
class FixedPolicy:
    """Verify `length` tokens every round: vanilla DFlash at W, or "static". One length for the
    whole batch, capped by the largest budget (a row with less verifies all w rows and counts its
    own; batch one: capped by its budget)."""

    name: str
    length: int
    correction: ClassVar[None] = None
    two_stage: ClassVar[bool] = True

    def prepare(self, device) -> None:
        pass

    def select(self, block: DraftBlock, max_w: int | torch.Tensor) -> Selection:
        B = block.tokens.shape[0]
        cap = budget(max_w, B, block.tokens.device)
        shared = cap.amax(dim=0, keepdim=True).clamp(1, self.length)
        return Selection(shared.expand(B), prefix_probabilities(block.confidence))

# the verification lengths of a batched round (the method's batched form): one fixed-shape graph
# serves every length, and a few lengths keep the calibration (one timed length each) cheap
BATCH_LENGTHS = (2, 4, 8, 12, 16)
# the batch sizes hybridspec decodes (graphs are captured per size; a batch of 3 runs as 4)
BATCH_SIZES = (1, 2, 4)


def batch_lengths(block_size: int) -> tuple[int, ...]:
    """The batched lengths a drafter of `block_size` can verify."""
    return tuple(w for w in BATCH_LENGTHS if w <= block_size) or (block_size,)


def graph_batch_size(batch_size: int) -> int:
    """The captured size a batch runs as: the smallest of `BATCH_SIZES` that holds it (3 runs as 4)."""
    return next(size for size in BATCH_SIZES if size >= batch_size)


def batch_gain(prefix: torch.Tensor, lengths: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """`[n]`: sum over the batch of each row's expected emitted tokens at each of `lengths` `[n]`,
    a row verifying at most its budget `cap` `[B]` (a finished row, cap 1, adds 1 everywhere)."""
    gain = expected_tokens(prefix)  # [B, D + 1]
    at = torch.minimum(lengths[None, :], cap[:, None]).clamp(min=1) - 1  # [B, n]
    return gain.gather(1, at).sum(dim=0)


@dataclass(frozen=True)
class BatchRoutingCorrection:
    """The routing correction of a batched round: keep the next length of the set, w', if

        sum_b (G_b(w') - G_b(w)) > rho_B * (C_B(w') - C_B(w) + eta * (n_new - nbar_B(w)))

    with `n_new` the Layer-0 experts positions w..w'-1 add to the union over the batch (Stage 0's
    routing) and `nbar_B(w)` its calibrated mean. `cost`, `nbar` index like `lengths`."""

    lengths: tuple[int, ...]
    cost: tuple[float, ...]
    rho: float
    eta: float
    nbar: tuple[float, ...]
    constants: Constants = _constants()

    def to(self, device) -> BatchRoutingCorrection:
        return self

    def extend(self, selection: Selection, topk_ids: torch.Tensor, cap: torch.Tensor, num_experts: int,
               distinct: torch.Tensor | None = None) -> torch.Tensor:
        # the batch's union of experts decides here, not each row's own counts (`distinct`)
        w0, prefix = selection.w0, selection.prefix
        B, W, k = topk_ids.shape
        lengths = self.constants.tensor(self.lengths, w0.device)
        # the union over the batch: every row's k choices at a position are that position's slots
        union = distinct_prefix_counts(topk_ids.transpose(0, 1).reshape(1, W, B * k), num_experts)[0]  # [W]
        i = torch.searchsorted(lengths, w0[:1]).clamp(max=len(self.lengths) - 1)  # [1], index of w0
        j = (i + 1).clamp(max=len(self.lengths) - 1)
        # clamp, not a tensor made from W: a host-to-device copy inside a CUDA-graph capture fails
        w, w_next = w0[:1], lengths[j].clamp(max=W)
        n_new = union[w_next - 1] - union[w - 1]
        gain = batch_gain(prefix, torch.cat([w, w_next]), cap)
        cost, nbar = self.constants.tensor(self.cost, w0.device), self.constants.tensor(self.nbar, w0.device)
        dL = cost[j] - cost[i] + self.eta * (n_new - nbar[i])
        keep = (j > i) & (w_next > w) & (w_next <= cap.amax()) & (gain[1] - gain[0] > self.rho * dL)
        return torch.where(keep, w_next, w).expand(B)


@dataclass(frozen=True)
class BatchPolicy:
    """A batched round's one length (B >= 2), from `lengths`, maximising

        sum_b G_b(w) - rho_B * C_B(w)

    (`G_b` row b's expected emitted tokens at w, from the acceptance model, or the raw confidence
    when `acceptance` is None; `cost[i]` = C_B(lengths[i])); ties to the shorter. A row whose
    budget is below w verifies all w rows and counts its own. `correction` may move the choice to
    the next length of the set."""

    name: str
    batch_size: int
    lengths: tuple[int, ...]
    cost: tuple[float, ...]
    rho: float
    acceptance: AcceptanceModel | None = None
    correction: BatchRoutingCorrection | None = None
    two_stage: bool = True
    constants: Constants = _constants()

    @classmethod
    def builtin_default(cls, name: str, batch_size: int, max_len: int = 16) -> BatchPolicy:
        # B rows cost about B times a row's extra tokens over one fixed launch-bound round
        # (the B = 1 default's slope, per row); rho per row as at B = 1
        lengths = batch_lengths(max_len)
        cost = tuple(1.0 + 0.03 * batch_size * (w - 1) for w in lengths)
        return cls(name, batch_size, lengths, cost, rho=2.0 * batch_size)

    def prepare(self, device) -> None:
        if self.acceptance is not None:
            self.acceptance.prepare(device)

    def select(self, block: DraftBlock, max_w: int | torch.Tensor) -> Selection:
        prefix = prefix_probabilities(conditional_acceptance(self.acceptance, block))
        B, D = prefix.shape
        cap = budget(max_w, B, prefix.device)
        usable = [(w, cost) for w, cost in zip(self.lengths, self.cost) if w <= D + 1] or [(D + 1, self.cost[0])]
        ws = self.constants.tensor(tuple(w for w, _ in usable), prefix.device)
        top = cap.amax(dim=0, keepdim=True)  # [1]
        # a length past every row's budget verifies the largest budget instead
        eff = torch.minimum(ws, top).clamp(min=1)
        score = batch_gain(prefix, eff, cap) - self.rho * self.constants.tensor(tuple(c for _, c in usable), prefix.device)
        # argmax returns the first maximum: ties go to the shorter length. Index with a [1] tensor:
        # a 0-d index tensor is read on the host (a sync, which a CUDA-graph capture refuses)
        return Selection(eff[score.argmax().reshape(1)].expand(B), prefix)


def from_calibration(name: str, calibration, max_len: int, batch_size: int = 1):
    """The policy `name` built from a `hybridspec.calibration.Calibration` (at batch size 2 or 4,
    from its entry for that size: `BatchPolicy`, or the size's best fixed length for "static")."""
    if batch_size > 1:
        return _batch_from_calibration(name, calibration, max_len, batch_size)
    cost = tuple(calibration.cost[:max_len])
    if name == "static":
        return FixedPolicy(name, min(calibration.static_length, max_len))
    if name == "dcut":
        return RatioPolicy(name, tuple(w for w in (4, 8, 12, 16) if w <= max_len), cost, calibration.fixed_ms)
    if name == "evict":
        return RatioPolicy(name, tuple(range(2, max_len + 1)), cost, calibration.fixed_ms)
    length = LengthPolicy(cost=cost, rho=calibration.rho)
    correction = None
    if name in ("hybridspec", "no_two_stage"):
        correction = RoutingCorrection(
            cost=torch.tensor(cost), rho=calibration.rho, s=calibration.stage0_slope_ms, eta=calibration.eta_ms,
            nbar=torch.tensor(calibration.nbar, dtype=torch.float32),
            nbar_given=torch.tensor(calibration.nbar_given, dtype=torch.float32),
        )
    # every policy but the "no_two_stage" ablation resumes Stage 1 at the router boundary: the round
    # runs Stage 0 anyway where Layer 0 has one, and resuming is the same arithmetic, minus a re-run
    return AdaptivePolicy(name, length, calibration.acceptance, correction, two_stage=name != "no_two_stage")


def _batch_from_calibration(name: str, calibration, max_len: int, batch_size: int):
    entry = calibration.batch_entry(batch_size)
    if name == "static":
        return FixedPolicy(name, min(entry.static_length, max_len))
    usable = [i for i, w in enumerate(entry.lengths) if w <= max_len] or [0]
    lengths = tuple(entry.lengths[i] for i in usable)
    cost = tuple(entry.cost[i] for i in usable)
    correction = BatchRoutingCorrection(lengths, cost, entry.rho, entry.eta_ms, tuple(entry.nbar[i] for i in usable))
    return BatchPolicy(name, batch_size, lengths, cost, entry.rho, calibration.acceptance, correction)


# one object per (name, length), so the runner recognises it across calls; a handful of names
# and lengths exist, the bound only makes that explicit
_DEFAULTS = BoundedCache(64)
_WARNED = BoundedCache(1)


def default_policy(name: str, max_len: int, batch_size: int = 1) -> AdaptivePolicy | BatchPolicy:
    """The uncalibrated fallback of the adaptive policies (one object per name, length and batch
    size, so the runner recognises it across calls); warns once per process."""
    if _WARNED.first_time("default-policy"):
        warnings.warn(
            f"hybridspec: policy={name!r} without calibration uses the built-in default length policy (raw "
            "drafter confidence, linear cost). Lengths adapt per round but are not tuned to this model or GPU, "
            "and the routing correction (which needs calibration) is off; run "
            "`hybridspec calibrate` and pass generate(..., calibration=path).",
            stacklevel=4,
        )
    if batch_size > 1:
        return _DEFAULTS.get((name, max_len, batch_size), lambda: BatchPolicy.builtin_default(name, batch_size, max_len))
    return _DEFAULTS.get((name, max_len), lambda: AdaptivePolicy(name, LengthPolicy.builtin_default(max_len)))
