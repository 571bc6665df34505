"""The acceptance model: calibration quality, monotonicity, scikit-learn parity, fallbacks, no host reads."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from hybridspec.calibration import AcceptanceModel, fit_acceptance
from hybridspec.policy import prefix_probabilities
from hybridspec.calibration.acceptance import ENTROPY_EPS, MIN_LABELS, Q_EPS
from tests.calibration.synthetic import synthetic_rounds

D = 15


@pytest.fixture(scope="module")
def fitted():
    conf, entropy, accepted, _ = synthetic_rounds(4000, D, seed=0)
    return fit_acceptance(conf, entropy, accepted), (conf, entropy, accepted)


def labelled_pairs(conf, entropy, accepted, c_true):
    """(round, position) pairs with a label, as flat arrays: conf, entropy rows, label, true c."""
    pos = np.arange(1, conf.shape[1] + 1)
    mask = accepted[:, None] >= pos - 1
    return mask, (accepted[:, None] >= pos)[mask], c_true[mask]


def test_beats_raw_confidence_on_held_out_brier(fitted):
    model, _ = fitted
    conf, entropy, accepted, c_true = synthetic_rounds(3000, D, seed=1)
    mask, label, truth = labelled_pairs(conf, entropy, accepted, c_true)
    c = model.predict(torch.from_numpy(conf).float(), torch.from_numpy(entropy).float()).double().numpy()[mask]
    raw = conf[mask]
    brier_model, brier_raw, brier_truth = (np.mean((p - label) ** 2) for p in (c, raw, truth))
    assert brier_model < brier_raw - 0.005
    # close to the best achievable (the true probabilities)
    assert brier_model < brier_truth + 0.005
    assert np.abs(c - truth).mean() < np.abs(raw - truth).mean() / 1.5


def test_valid_mask_drops_rounds():
    conf, entropy, accepted, _ = synthetic_rounds(600, 4, seed=2)
    valid = np.arange(600) % 3 != 0
    kept = fit_acceptance(conf[valid], entropy[valid], accepted[valid])
    assert fit_acceptance(conf, entropy, accepted, valid) == kept
    assert fit_acceptance(torch.from_numpy(conf), torch.from_numpy(entropy), torch.from_numpy(accepted),
                          torch.from_numpy(valid)) == kept


def assert_monotone_in_confidence(model: AcceptanceModel, entropy_row: np.ndarray, conf_row: np.ndarray):
    grid = torch.linspace(0, 1, 201)
    for i in range(model.num_positions):
        conf = torch.from_numpy(conf_row).float().repeat(len(grid), 1)
        conf[:, i] = grid
        entropy = torch.from_numpy(entropy_row).float().repeat(len(grid), 1)
        c = model.predict(conf, entropy)
        # float32 interpolation may round across a threshold by an ulp
        assert (c[1:, i] - c[:-1, i]).min() >= -1e-6


def test_monotone_in_confidence(fitted):
    model, (conf, entropy, _) = fitted
    for r in range(3):
        assert_monotone_in_confidence(model, entropy[r], conf[r])


@settings(max_examples=10)
@given(seed=st.integers(0, 2**32 - 1), slope=st.floats(-3, 3))
def test_monotone_even_when_confidence_misleads(seed, slope):
    # slope < 0: acceptance falls with confidence; the isotonic maps flatten and any negative
    # fitted confidence slope is clamped
    conf, entropy, accepted, _ = synthetic_rounds(400, 5, seed=seed, slope=slope)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fit_acceptance(conf, entropy, accepted)
    assert_monotone_in_confidence(model, entropy[0], conf[0])


def reference_features(q, h):
    """The features recomputed independently: hbar by its recurrence."""
    R, Dn = q.shape
    h = np.maximum(h, 0)
    change = np.zeros_like(h)
    hbar = h[:, 0].copy()
    for i in range(Dn):
        change[:, i] = np.log((h[:, i] + ENTROPY_EPS) / (hbar + ENTROPY_EPS))
        hbar = (h[:, i] + hbar) / 2
    pos = np.broadcast_to(np.arange(1, Dn + 1, dtype=np.float64), (R, Dn))
    q = np.clip(q, Q_EPS, 1 - Q_EPS)
    lq = np.log(q / (1 - q))
    return np.stack([lq, pos, lq * pos, np.log1p(h), change], axis=-1)


def reference_model(conf, entropy, accepted):
    """scikit-learn's own pipeline for the same specification: returns predict(conf, entropy)."""
    Dn = conf.shape[1]
    calibrators = []
    for i in range(1, Dn + 1):
        m = accepted >= i - 1
        y = (accepted[m] >= i).astype(float)
        if len(y) < MIN_LABELS or y.min() == y.max():
            calibrators.append((y.sum() + 1) / (len(y) + 2))
        else:
            calibrators.append(IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1).fit(conf[m, i - 1], y))

    def q_of(cf):
        return np.stack([np.full(len(cf), cal) if isinstance(cal, float) else cal.predict(cf[:, i])
                         for i, cal in enumerate(calibrators)], axis=1)

    pos = np.arange(1, Dn + 1)
    mask = accepted[:, None] >= pos - 1
    X = reference_features(q_of(conf), entropy)[mask]
    pipe = make_pipeline(StandardScaler(), LogisticRegression(tol=1e-10, max_iter=10_000))
    pipe.fit(X, (accepted[:, None] >= pos)[mask])

    def predict(cf, h):
        X = reference_features(q_of(cf), h)
        return pipe.predict_proba(X.reshape(-1, X.shape[-1]))[:, 1].reshape(cf.shape)

    return predict


@pytest.fixture(scope="module")
def parity():
    # low acceptance: position 6 has fewer than 30 labels and uses the constant
    conf, entropy, accepted, _ = synthetic_rounds(1500, 6, seed=3, slope=0.7)
    model = fit_acceptance(conf, entropy, accepted)
    assert model.iso_x[5] == () and model.n_labels[5] < MIN_LABELS
    return model, reference_model(conf, entropy, accepted)


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), B=st.integers(1, 40))
def test_predict_matches_sklearn_pipeline(parity, seed, B):
    model, reference = parity
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0, 1, size=(B, 6)).astype(np.float32)
    entropy = rng.exponential(0.5, size=(B, 6)).astype(np.float32)
    # edges: clipping at 0 and 1, a certain drafter (h = 0)
    conf[0, :2] = [0.0, 1.0]
    entropy[0, 2] = 0.0
    got = model.predict(torch.from_numpy(conf), torch.from_numpy(entropy))
    assert got.dtype == torch.float32 and got.shape == (B, 6)
    want = reference(conf.astype(np.float64), entropy.astype(np.float64))
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5, rtol=0)


def rounds_with(accepted: list[int], D: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    R = len(accepted)
    return rng.uniform(0.3, 1, (R, D)), rng.exponential(0.5, (R, D)), np.array(accepted)


def test_sparse_or_single_class_positions_use_the_smoothed_constant():
    D = 4
    # position 1: 100 labels, 80 positive; position 2: 80 labels, all positive (single class);
    # position 3: 80 labels, 20 positive; position 4: 20 labels (< 30), 5 positive
    accepted = [0] * 20 + [2] * 60 + [3] * 15 + [4] * 5
    model = fit_acceptance(*rounds_with(accepted, D))
    assert model.n_labels == (100, 80, 80, 20)
    assert model.iso_x[0] != () and model.iso_x[2] != ()
    assert model.iso_x[1] == () and model.iso_y[1] == pytest.approx((81 / 82,))
    assert model.iso_x[3] == () and model.iso_y[3] == pytest.approx((6 / 22,))
    q = model.calibrated_confidence(torch.rand(7, D))
    torch.testing.assert_close(q[:, 1], torch.full((7,), 81 / 82))
    torch.testing.assert_close(q[:, 3], torch.full((7,), 6 / 22))


@pytest.mark.parametrize("accepted, expected", [
    # every draft accepted: every position is single-class positive
    ([3] * 50, (51 / 52, 51 / 52, 51 / 52)),
    # nothing accepted: position 1 all negative, positions 2 and 3 have no labels (n = 0)
    ([0] * 50, (1 / 52, 1 / 2, 1 / 2)),
])
def test_single_pooled_class_falls_back_to_constants(accepted, expected):
    model = fit_acceptance(*rounds_with(accepted, 3))
    assert model.coef is None
    c = model.predict(torch.rand(5, 3), torch.rand(5, 3))
    torch.testing.assert_close(c, torch.tensor(expected).expand(5, 3))


def test_no_rounds_gives_constants():
    model = fit_acceptance(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros(0, dtype=int))
    assert model.coef is None and model.iso_y == ((0.5,), (0.5,), (0.5,))


def test_predict_never_reads_the_device(fitted):
    model, (conf, entropy, _) = fitted
    # meta tensors hold no data: .item(), .tolist(), bool() or a copy to the host would raise
    out = model.predict(torch.empty(8, D, device="meta"), torch.empty(8, D, device="meta"))
    assert out.shape == (8, D) and out.dtype == torch.float32
    # and it traces into one graph: no graph break from data-dependent Python control flow
    cf, h = torch.from_numpy(conf[:8]).float(), torch.from_numpy(entropy[:8]).float()
    eager = model.predict(cf, h)
    compiled = torch.compile(model.predict, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(cf, h), eager)


def test_device_tensors_are_cached(fitted):
    model, _ = fitted
    assert model.prepare("cpu") is model
    cached = model._device_cache[torch.device("cpu")]
    model.predict(torch.rand(3, D), torch.rand(3, D))
    assert model._device_cache[torch.device("cpu")] is cached


def test_dict_round_trip_and_shape_errors(fitted):
    model, _ = fitted
    back = AcceptanceModel.from_dict(model.to_dict())
    assert back == model
    x, h = torch.rand(4, D), torch.rand(4, D)
    assert torch.equal(back.predict(x, h), model.predict(x, h))
    with pytest.raises(ValueError, match=r"\[B, 15\]"):
        model.predict(torch.rand(4, D - 1), torch.rand(4, D - 1))
    bad = model.to_dict()
    del bad["logistic"]["mean"]
    with pytest.raises(ValueError, match="mean"):
        AcceptanceModel.from_dict(bad)


def test_prefix_probabilities():
    c = torch.tensor([[0.5, 0.5, 1.0], [1.0, 0.2, 0.5]])
    torch.testing.assert_close(prefix_probabilities(c), torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.2, 0.1]]))


def test_negative_confidence_slope_is_clamped_with_a_warning():
    conf, entropy, accepted, _ = synthetic_rounds(400, 5, seed=0, slope=-3.0)
    with pytest.warns(UserWarning, match="clamps it to zero"):
        model = fit_acceptance(conf, entropy, accepted)
    assert_monotone_in_confidence(model, entropy[0], conf[0])
