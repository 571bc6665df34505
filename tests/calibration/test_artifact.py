"""The JSON artifact: round trip, fingerprints, compatibility checks, malformed files, no scikit-learn."""

import ast
import inspect
import json
import sys
import warnings

import pytest
import torch

import hybridspec.calibration as calibration_package
from hybridspec.calibration import SCHEMA_VERSION, AcceptanceModel, Calibration, fingerprint, fit_acceptance
from hybridspec.calibration import acceptance as acceptance_module
from hybridspec.calibration import artifact as artifact_module
from hybridspec.calibration import costs as costs_module
from hybridspec.tiny import TARGET, Qwen3_5MoeTextConfig, drafter_config

W, K = 5, 2
VERSIONS = {"torch": "2.13.0", "transformers": "5.24.0", "triton": "3.9.0", "hybridspec": "0.1.0"}


def acceptance() -> AcceptanceModel:
    return AcceptanceModel(
        iso_x=((0.1, 0.5, 0.9), (0.2, 0.8), (), (0.3, 0.6, 0.7, 0.95)),
        iso_y=((0.2, 0.5, 0.9), (0.3, 0.7), (0.25,), (0.1, 0.2, 0.6, 0.8)),
        n_labels=(1000, 700, 12, 300),
        coef=(1.2, -0.3, 0.4, -0.2, 0.1), intercept=0.3,
        mean=(0.6, 2.5, 1.5, 0.4, 0.0), scale=(0.2, 1.1, 0.9, 0.3, 0.5),
    )


def calibration(**overrides) -> Calibration:
    fields = dict(
        target_fingerprint="a" * 64, drafter_fingerprint="b" * 64, device_name="NVIDIA H200",
        versions=dict(VERSIONS), block_size=W, acceptance=acceptance(),
        cost=(0.1, 0.25, 0.4, 0.6, 0.8), fixed_ms=5.0, stage0_slope_ms=0.02, eta_ms=0.004, top_k=K,
        nbar=(8.0, 14.0, 19.0, 23.0, 26.0), nbar_given=tuple((v - 1, v, v + 1) for v in (8.0, 14.0, 19.0, 23.0, 26.0)),
        rho=0.35, static_length=4, summary={"rounds": 1200, "round_ms": {"2": 5.3, "16": 6.1}, "mean_predicted_w": 6.4},
    )
    fields.update(overrides)
    return Calibration(**fields)


def test_round_trip(tmp_path):
    c = calibration()
    path = tmp_path / "calib.json"
    c.save(path)
    # strict JSON, indented
    text = path.read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-strict JSON constant {name}"))
    assert text.startswith('{\n  "')
    back = Calibration.load(path)
    assert back == c
    x, h = torch.rand(6, W - 1), torch.rand(6, W - 1)
    assert torch.equal(back.acceptance.predict(x, h), c.acceptance.predict(x, h))


def test_save_refuses_nan(tmp_path):
    with pytest.raises(ValueError):
        calibration(summary={"r": float("nan")}).save(tmp_path / "c.json")


def target_config(**changes):
    return Qwen3_5MoeTextConfig(**{**TARGET, **changes})


def test_fingerprint_ignores_volatile_keys():
    base = fingerprint(target_config())
    assert fingerprint(target_config().to_dict()) == base
    volatile = target_config(dtype="bfloat16", output_router_logits=True, use_cache=False)
    volatile._name_or_path = "/somewhere/else"
    volatile._attn_implementation = "sdpa"
    volatile._experts_implementation = "hybridspec"
    volatile._commit_hash = "0123abc"
    assert fingerprint(volatile) == base
    d = target_config().to_dict()
    d.update(transformers_version="9.9.9", architectures=["X"], torch_dtype="float16",
             _attn_implementation_autoset=True)
    assert fingerprint(d) == base


def test_fingerprint_changes_with_a_real_field():
    assert fingerprint(target_config(hidden_size=128)) != fingerprint(target_config())
    assert fingerprint(target_config(num_experts_per_tok=4)) != fingerprint(target_config())


def test_fingerprint_cleans_nested_configs():
    inner = target_config().to_dict()
    outer = {"model_type": "qwen3_5_moe", "text_config": inner, "dtype": "bfloat16"}
    noisy = {"model_type": "qwen3_5_moe", "dtype": "float32", "_name_or_path": "x",
             "text_config": {**inner, "transformers_version": "0", "_attn_implementation_internal": "eager"}}
    assert fingerprint(noisy) == fingerprint(outer)
    assert fingerprint({**outer, "text_config": {**inner, "hidden_size": 128}}) != fingerprint(outer)
    drafter = drafter_config()
    other_mask = {**drafter, "dflash_config": {**drafter["dflash_config"], "mask_token_id": 1}}
    assert fingerprint(drafter) != fingerprint(other_mask)


def test_check_passes_silently_on_the_same_setup():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibration().check("a" * 64, "b" * 64, "NVIDIA H200", dict(VERSIONS))


@pytest.mark.parametrize("field, args", [
    ("target_fingerprint", ("c" * 64, "b" * 64)),
    ("drafter_fingerprint", ("a" * 64, "c" * 64)),
])
def test_check_raises_on_another_model(field, args):
    with pytest.raises(ValueError, match=f"{field}.*hybridspec calibrate"):
        calibration().check(*args, "NVIDIA H200", dict(VERSIONS))


def test_check_raises_on_another_schema(tmp_path):
    with pytest.raises(ValueError, match="schema_version.*hybridspec calibrate"):
        calibration(schema_version=SCHEMA_VERSION + 1).check("a" * 64, "b" * 64, "NVIDIA H200", dict(VERSIONS))
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**calibration().to_dict(), "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(ValueError, match="schema_version.*hybridspec calibrate"):
        Calibration.load(path)


def test_check_warns_once_on_another_device_or_versions():
    with pytest.warns(UserWarning) as record:
        calibration().check("a" * 64, "b" * 64, "NVIDIA H100", {**VERSIONS, "torch": "2.14.0", "triton": None})
    assert len(record) == 1
    message = str(record[0].message)
    for part in ("NVIDIA H100", "2.14.0", "triton", "hybridspec calibrate"):
        assert part in message


def test_malformed_files(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON calibration file"):
        Calibration.load(path)
    d = calibration().to_dict()
    del d["rho"], d["nbar_given"]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"missing keys \['nbar_given', 'rho'\]"):
        Calibration.load(path)
    d = calibration().to_dict()
    del d["acceptance"]["positions"][0]["n_labels"]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="n_labels"):
        Calibration.load(path)
    d = calibration().to_dict()
    d["cost"] = d["cost"][:-1]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="cost has 4 entries"):
        Calibration.load(path)
    path.write_text(json.dumps({**calibration().to_dict(), "rho": "fast"}))
    with pytest.raises(ValueError, match="malformed"):
        Calibration.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        Calibration.load(path)


def test_no_module_level_scikit_learn_import():
    # generation imports these modules on machines without scikit-learn
    for module in (acceptance_module, artifact_module, costs_module, calibration_package):
        tree = ast.parse(inspect.getsource(module))
        imported = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
        imported += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] == "sklearn"], module.__name__


def test_loading_and_predicting_need_no_scikit_learn(tmp_path, monkeypatch):
    path = tmp_path / "calib.json"
    calibration().save(path)
    for name in ("sklearn", "sklearn.isotonic", "sklearn.linear_model"):
        monkeypatch.setitem(sys.modules, name, None)
    c = Calibration.load(path)
    assert c.acceptance.predict(torch.rand(3, W - 1), torch.rand(3, W - 1)).shape == (3, W - 1)
    with pytest.raises(ImportError, match=r'pip install "hybridspec\[calibrate\]"'):
        fit_acceptance([[0.5]], [[0.1]], [0])
