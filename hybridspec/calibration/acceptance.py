"""Acceptance model: drafter confidence and entropy -> conditional acceptance probabilities c_i.

A round drafts D tokens; position i (1-based) is reached when the first i - 1 drafts were
accepted, and `c_i = P(draft i accepted | drafts 1..i-1 accepted)`. Fitting uses rounds that
verified all D drafts (`A` = accepted count in 0..D): position i's labels are `1[A >= i]` over the
rounds with `A >= i - 1`.

Two stages:

1. Per position, an isotonic map of the top-1 confidence, `q_i = iso_i(conf_i)` (clipped to the
   fitted range, linear between thresholds). A position with fewer than `MIN_LABELS` labels or a
   single class uses the smoothed constant `(positives + 1) / (n + 2)`.
2. One logistic model pooled across positions over the features `FEATURES`:
   `logit(q_i)`, `i`, `logit(q_i) * i`, `log(1 + h_i)` and the entropy change `log((h_i + eps) / (hbar_{i-1} + eps))`
   with `hbar_i = (h_i + hbar_{i-1}) / 2`, `hbar_0 = h_1` (so position 1's change is 0). `h` is
   in nats; `eps = ENTROPY_EPS` keeps the ratio finite where the drafter is certain (h = 0, which
   bf16 softmax produces) and is far below the entropies that carry information.
   Features are standardised before the fit. If every pooled label has one class, c_i = q_i.
   Confidence enters through its logit (q clipped to [Q_EPS, 1 - Q_EPS]): a model linear in q
   itself cannot reproduce c = q, and on synthetic rounds the logit form had the lower held-out
   Brier score at every miscalibration slope tried.

`predict` is the pure-torch evaluation used at generation time: no scikit-learn, no host reads.
The effective confidence slope per position, `w_q + i * w_qi`, is clamped at zero so a higher
confidence never lowers c_i; on data where confidence is informative the fit already has it
non-negative and `predict` equals scikit-learn's pipeline (`fit_acceptance` warns otherwise).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MIN_LABELS = 30
ENTROPY_EPS = 1e-6
Q_EPS = 1e-4
FEATURES = ("logit_q", "position", "logit_q_x_position", "log1p_entropy", "entropy_change")
SKLEARN_HINT = 'fitting the calibration needs scikit-learn: pip install "hybridspec[calibrate]"'


def _import_sklearn():
    try:
        from sklearn.isotonic import IsotonicRegression
        from sklearn.linear_model import LogisticRegression
    except ImportError as e:
        raise ImportError(SKLEARN_HINT) from e
    return IsotonicRegression, LogisticRegression


def _previous_mean_weights(D: int) -> np.ndarray:
    """`[D, D]` matrix M with `(M @ h)[i - 1] = hbar_{i-1}` for i = 1..D (row 1 picks h_1)."""
    hbar = np.zeros((D + 1, D))
    hbar[0, 0] = 1.0
    for i in range(1, D + 1):
        hbar[i] = hbar[i - 1] / 2
        hbar[i, i - 1] += 0.5
    return hbar[:D]


def entropy_features(entropy: torch.Tensor, prev_weights: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`entropy` `[B, D]` nats -> (`log(1 + h)`, entropy change) `[B, D]` in the input's dtype.

    `prev_weights` is `_previous_mean_weights(D)` as a tensor. Entropies are clamped at 0 (a
    softmax entropy can come out a rounding error below it)."""
    h = entropy.clamp_min(0)
    # elementwise product and sum rather than a matmul, which runs in TF32 where the process allows it
    prev = (h.unsqueeze(-2) * prev_weights).sum(-1)
    return torch.log1p(h), torch.log((h + eps) / (prev + eps))


@dataclass(frozen=True)
class AcceptanceModel:
    """Fitted acceptance model for D = `len(iso_x)` draft positions (plain numbers, JSON-able).

    `iso_x[i-1]`, `iso_y[i-1]`: isotonic thresholds of position i (strictly increasing x); a
    constant position has `iso_x == ()` and `iso_y == (constant,)`. `n_labels[i-1]`: labels the
    position was fitted on. `coef` (over `FEATURES`), `intercept`, `mean`, `scale`: the logistic
    model on standardised features `(x - mean) / scale`; `coef is None` means c_i = q_i.
    """

    iso_x: tuple[tuple[float, ...], ...]
    iso_y: tuple[tuple[float, ...], ...]
    n_labels: tuple[int, ...]
    coef: tuple[float, ...] | None
    intercept: float | None
    mean: tuple[float, ...] | None
    scale: tuple[float, ...] | None
    entropy_eps: float = ENTROPY_EPS
    _device_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        D = len(self.iso_x)
        if D == 0 or len(self.iso_y) != D or len(self.n_labels) != D:
            raise ValueError(
                f"acceptance model: iso_x, iso_y and n_labels need one entry per position, got "
                f"{len(self.iso_x)}, {len(self.iso_y)}, {len(self.n_labels)}"
            )
        for i, (x, y) in enumerate(zip(self.iso_x, self.iso_y), start=1):
            if (len(x) == 0 and len(y) != 1) or (len(x) > 0 and len(x) != len(y)):
                raise ValueError(f"acceptance model: position {i} has {len(x)} thresholds and {len(y)} values")
            if any(b <= a for a, b in zip(x, x[1:])):
                raise ValueError(f"acceptance model: position {i} thresholds are not strictly increasing")
        logistic = (self.coef, self.intercept, self.mean, self.scale)
        if any(v is None for v in logistic) and any(v is not None for v in logistic):
            raise ValueError("acceptance model: coef, intercept, mean and scale are all set or all None")
        if self.coef is not None and not len(self.coef) == len(self.mean) == len(self.scale) == len(FEATURES):
            raise ValueError(f"acceptance model: coef, mean and scale need {len(FEATURES)} entries ({FEATURES})")

    @property
    def num_positions(self) -> int:
        return len(self.iso_x)

    def to_dict(self) -> dict[str, Any]:
        return {
            "features": list(FEATURES),
            "entropy_eps": self.entropy_eps,
            "positions": [
                {"n_labels": n, "constant": y[0]} if not x else {"n_labels": n, "x": list(x), "y": list(y)}
                for x, y, n in zip(self.iso_x, self.iso_y, self.n_labels)
            ],
            "logistic": None if self.coef is None else {
                "coef": list(self.coef), "intercept": self.intercept,
                "mean": list(self.mean), "scale": list(self.scale),
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AcceptanceModel:
        missing = [k for k in ("features", "entropy_eps", "positions", "logistic") if k not in d]
        if missing:
            raise ValueError(f"acceptance model: missing keys {missing}")
        if list(d["features"]) != list(FEATURES):
            raise ValueError(f"acceptance model: features {d['features']} differ from this version's {list(FEATURES)}")
        iso_x, iso_y, n_labels = [], [], []
        for i, p in enumerate(d["positions"], start=1):
            if "constant" in p:
                iso_x.append(())
                iso_y.append((float(p["constant"]),))
            elif "x" in p and "y" in p:
                iso_x.append(tuple(float(v) for v in p["x"]))
                iso_y.append(tuple(float(v) for v in p["y"]))
            else:
                raise ValueError(f"acceptance model: position {i} needs 'constant' or 'x' and 'y'")
            if "n_labels" not in p:
                raise ValueError(f"acceptance model: position {i} is missing key 'n_labels'")
            n_labels.append(int(p["n_labels"]))
        lg = d["logistic"]
        if lg is not None:
            missing = [k for k in ("coef", "intercept", "mean", "scale") if k not in lg]
            if missing:
                raise ValueError(f"acceptance model: logistic is missing keys {missing}")
        return cls(
            iso_x=tuple(iso_x), iso_y=tuple(iso_y), n_labels=tuple(n_labels),
            coef=None if lg is None else tuple(float(v) for v in lg["coef"]),
            intercept=None if lg is None else float(lg["intercept"]),
            mean=None if lg is None else tuple(float(v) for v in lg["mean"]),
            scale=None if lg is None else tuple(float(v) for v in lg["scale"]),
            entropy_eps=float(d["entropy_eps"]),
        )

    def prepare(self, device: torch.device | str) -> AcceptanceModel:
        """Build the device tensors `predict` uses now. Their first use on a device copies them from
        the host, which CUDA-graph capture forbids: call this before capturing. Returns self."""
        # an empty tensor names the device as tensors on it report it ("cuda" -> "cuda:0")
        self._tensors(torch.empty(0, device=device).device)
        return self

    def _tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Device tensors for `predict`, built once per device."""
        cached = self._device_cache.get(device)
        if cached is not None:
            return cached
        D = self.num_positions
        # a constant is a flat segment over [0, 1]: clipping then makes it constant everywhere
        xs = [x if x else (0.0, 1.0) for x in self.iso_x]
        ys = [y if x else (y[0], y[0]) for x, y in zip(self.iso_x, self.iso_y)]
        # scikit-learn predicts the single value when one threshold was fitted (all x equal)
        ys = [y if len(x) > 1 else (y[0], y[0]) for x, y in zip(xs, ys)]
        xs = [x if len(x) > 1 else (x[0], x[0] + 1.0) for x in xs]
        N = max(len(x) for x in xs)
        # padding repeats the last threshold: the rows stay sorted and the upper clamp of the
        # segment index keeps every lookup inside the real thresholds
        pad_x = np.array([list(x) + [x[-1]] * (N - len(x)) for x in xs])
        pad_y = np.array([list(y) + [y[-1]] * (N - len(y)) for y in ys])
        lengths = np.array([len(x) for x in xs])
        t = {
            "x": torch.tensor(pad_x, dtype=torch.float32, device=device),  # [D, N]
            "y": torch.tensor(pad_y, dtype=torch.float32, device=device),  # [D, N]
            "lo": torch.tensor(pad_x[:, 0:1], dtype=torch.float32, device=device),  # [D, 1]
            "hi": torch.tensor(pad_x[np.arange(D), lengths - 1][:, None], dtype=torch.float32, device=device),
            "last": torch.tensor((lengths - 1)[:, None], dtype=torch.long, device=device),  # [D, 1]
        }
        if self.coef is not None:
            w = np.array(self.coef) / np.array(self.scale)
            b = self.intercept - float(np.sum(w * np.array(self.mean)))
            pos = np.arange(1, D + 1, dtype=np.float64)
            # clamped so that c_i never decreases with confidence (module docstring)
            t["slope"] = torch.tensor(np.maximum(w[0] + w[2] * pos, 0.0), dtype=torch.float32, device=device)
            t["offset"] = torch.tensor(w[1] * pos + b, dtype=torch.float32, device=device)
            t["w_entropy"] = torch.tensor(w[3:5], dtype=torch.float32, device=device)
            t["prev"] = torch.tensor(_previous_mean_weights(D), dtype=torch.float32, device=device)
        self._device_cache[device] = t
        return t

    def calibrated_confidence(self, confidence: torch.Tensor) -> torch.Tensor:
        """`confidence` `[B, D]` -> isotonic `q` `[B, D]` float32 (scikit-learn's clip + interpolation)."""
        t = self._tensors(confidence.device)
        x = confidence.float().t().clamp(t["lo"], t["hi"]).contiguous()  # [D, B]
        right = torch.searchsorted(t["x"], x, right=True).clamp_min(1).minimum(t["last"])
        x0, x1 = t["x"].gather(1, right - 1), t["x"].gather(1, right)
        y0, y1 = t["y"].gather(1, right - 1), t["y"].gather(1, right)
        # thresholds closer than float32 resolution collapse to one point: take its right value
        frac = torch.where(x1 > x0, (x - x0) / (x1 - x0), 1.0)
        return (y0 + frac * (y1 - y0)).t()

    def predict(self, confidence: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """`confidence` (top-1 probability), `entropy` (nats) `[B, D]` -> c `[B, D]` float32 on their device.

        Runs on the device without reading anything back to the host (after the first call on a
        device, or `prepare`, it launches only device work)."""
        if confidence.dim() != 2 or confidence.shape != entropy.shape or confidence.shape[1] != self.num_positions:
            raise ValueError(
                f"predict: confidence {tuple(confidence.shape)} and entropy {tuple(entropy.shape)} must both be "
                f"[B, {self.num_positions}]"
            )
        q = self.calibrated_confidence(confidence)
        if self.coef is None:
            return q
        t = self._tensors(confidence.device)
        log_h, change = entropy_features(entropy.float(), t["prev"], self.entropy_eps)
        logit = t["slope"] * _logit(q) + t["offset"] + t["w_entropy"][0] * log_h + t["w_entropy"][1] * change
        return torch.sigmoid(logit)


def _logit(q: torch.Tensor) -> torch.Tensor:
    # the isotonic map reaches 0 and 1 exactly; the clip keeps the feature finite
    return torch.logit(q.clamp(Q_EPS, 1 - Q_EPS))


def acceptance_labels(accepted: np.ndarray, D: int) -> tuple[np.ndarray, np.ndarray]:
    """`accepted` `[R]` in 0..D -> (mask, label) `[R, D]`: column i-1 is labelled where `A >= i - 1`,
    with label `A >= i`."""
    pos = np.arange(1, D + 1)
    return accepted[:, None] >= pos - 1, accepted[:, None] >= pos


def _as_numpy(a, dtype) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.asarray(a, dtype=dtype)


def feature_matrix(q: np.ndarray, entropy: np.ndarray, eps: float) -> np.ndarray:
    """`q`, `entropy` `[R, D]` -> features `[R, D, len(FEATURES)]` float64 (order of `FEATURES`)."""
    R, D = q.shape
    log_h, change = entropy_features(
        torch.from_numpy(entropy), torch.from_numpy(_previous_mean_weights(D)), eps
    )
    pos = np.broadcast_to(np.arange(1, D + 1, dtype=np.float64), (R, D))
    lq = _logit(torch.from_numpy(q)).numpy()
    return np.stack([lq, pos, lq * pos, log_h.numpy(), change.numpy()], axis=-1)


def fit_acceptance(conf, entropy, accepted, valid=None) -> AcceptanceModel:
    """Fit the acceptance model from rounds that verified all D drafts.

    `conf`, `entropy` `[R, D]` (top-1 probability, nats); `accepted` `[R]` in 0..D; `valid` `[R]`
    bool (False for rounds cut by EOS or the output limit; they are left out), default all.
    numpy arrays or torch tensors."""
    IsotonicRegression, LogisticRegression = _import_sklearn()
    conf = _as_numpy(conf, np.float64)
    entropy = _as_numpy(entropy, np.float64)
    accepted = _as_numpy(accepted, np.int64)
    if conf.ndim != 2 or entropy.shape != conf.shape or accepted.shape != conf.shape[:1]:
        raise ValueError(
            f"fit_acceptance: conf {conf.shape} and entropy {entropy.shape} must be [R, D], "
            f"accepted {accepted.shape} [R]"
        )
    R, D = conf.shape
    if valid is not None:
        valid = _as_numpy(valid, bool)
        if valid.shape != (R,):
            raise ValueError(f"fit_acceptance: valid {valid.shape} must be [{R}]")
        conf, entropy, accepted = conf[valid], entropy[valid], accepted[valid]
    if accepted.size and (accepted.min() < 0 or accepted.max() > D):
        raise ValueError(f"fit_acceptance: accepted counts must lie in 0..{D}")
    labelled, label = acceptance_labels(accepted, D)

    iso_x, iso_y, n_labels = [], [], []
    q = np.zeros_like(conf)
    for i in range(D):
        x, y = conf[labelled[:, i], i], label[labelled[:, i], i]
        n, positives = len(y), int(y.sum())
        n_labels.append(n)
        if n < MIN_LABELS or positives in (0, n):
            constant = (positives + 1) / (n + 2)
            iso_x.append(())
            iso_y.append((constant,))
            q[:, i] = constant
            continue
        iso = IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1).fit(x, y.astype(np.float64))
        iso_x.append(tuple(float(v) for v in iso.X_thresholds_))
        iso_y.append(tuple(float(v) for v in iso.y_thresholds_))
        q[:, i] = iso.predict(conf[:, i])

    y = label[labelled]
    coef = intercept = mean = scale = None
    if y.size and 0 < y.sum() < y.size:
        X = feature_matrix(q, entropy, ENTROPY_EPS)[labelled]  # [N, F]
        mean = X.mean(0)
        std = X.std(0)
        # a constant feature (e.g. a single position) is left unscaled, as StandardScaler does
        scale = np.where(std > 0, std, 1.0)
        lr = LogisticRegression(tol=1e-10, max_iter=10_000).fit((X - mean) / scale, y)
        coef, intercept = tuple(float(v) for v in lr.coef_[0]), float(lr.intercept_[0])
        mean, scale = tuple(float(v) for v in mean), tuple(float(v) for v in scale)
        slopes = [coef[0] / scale[0] + coef[2] / scale[2] * i for i in range(1, D + 1)]
        if min(slopes) < 0:
            warnings.warn(
                f"fit_acceptance: the fitted confidence slope is negative at positions "
                f"{[i for i, s in enumerate(slopes, 1) if s < 0]}; predict clamps it to zero there",
                stacklevel=2,
            )
    return AcceptanceModel(
        iso_x=tuple(iso_x), iso_y=tuple(iso_y), n_labels=tuple(n_labels),
        coef=coef, intercept=intercept, mean=mean, scale=scale,
    )
