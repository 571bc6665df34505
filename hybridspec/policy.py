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
class Policy(Protocol):
    """What a round asks of a length policy. `select` picks the nominal length w0 on the device;
    `correction` (or None) decides on one more token at the Layer-0 router boundary; `two_stage`
    says whether the chosen tokens resume from that boundary (True) or are verified again from the
    embedding (the "no_two_stage" ablation); `prepare` builds device constants before capture."""

    name: str
    correction: RoutingCorrection | None
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
        if self.acceptance is None:
            c = block.confidence
        else:
            c = self.acceptance.predict(block.confidence, block.entropy)
        prefix = prefix_probabilities(c)
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
    """Verify `length` tokens every round (capped by the budget): vanilla DFlash at W, or "static"."""

    name: str
    length: int
    correction: ClassVar[None] = None
    two_stage: ClassVar[bool] = True

    def prepare(self, device) -> None:
        pass

    def select(self, block: DraftBlock, max_w: int | torch.Tensor) -> Selection:
        B = block.tokens.shape[0]
        cap = budget(max_w, B, block.tokens.device)
        return Selection(cap.clamp(1, self.length), prefix_probabilities(block.confidence))


def from_calibration(name: str, calibration, max_len: int):
    """The policy `name` built from a `hybridspec.calibration.Calibration`."""
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


# one object per (name, length), so the runner recognises it across calls; a handful of names
# and lengths exist, the bound only makes that explicit
_DEFAULTS = BoundedCache(64)
_WARNED = BoundedCache(1)


def default_policy(name: str, max_len: int) -> AdaptivePolicy:
    """The uncalibrated fallback of the adaptive policies (one object per name and length, so the
    runner recognises it across calls); warns once per process."""
    if _WARNED.first_time("default-policy"):
        warnings.warn(
            f"hybridspec: policy={name!r} without calibration uses the built-in default length policy (raw "
            "drafter confidence, linear cost). Lengths adapt per round but are not tuned to this model or GPU, "
            "and the routing correction (which needs calibration) is off; run "
            "`hybridspec calibrate` and pass generate(..., calibration=path).",
            stacklevel=4,
        )
    return _DEFAULTS.get((name, max_len), lambda: AdaptivePolicy(name, LengthPolicy.builtin_default(max_len)))
