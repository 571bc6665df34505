"""Errors that say what to do: a model never enabled, empty or out-of-vocabulary prompts, a drafter
for another target depth, a calibration made with the replay drafter used with a plain one (and
the reverse); and transformers' GPU-only install advice kept off CPU machines."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import GenerationMixin

import hybridspec
from hybridspec import _hints
from hybridspec.drafter import DFlashConfig, DFlashDrafter
from hybridspec.fingerprint import drafter_fingerprint
from hybridspec.sim.spec import drafter_identity
from hybridspec.sim.replay import DeviceReplayDrafter
from tests.calibration.test_artifact import VERSIONS, calibration
from tests.models import VOCAB, config, qwen35_causal_lm, random_drafter

ROOT = Path(__file__).parents[1]
PROMPT = torch.tensor([[1, 17, 33, 64]])


@pytest.fixture(scope="module")
def target():
    return qwen35_causal_lm(3)


def test_not_enabled_names_enable(target):
    hybridspec.disable(target)
    with pytest.raises(ValueError, match=r"call `hybridspec\.enable\(model\)` once"):
        target.generate(PROMPT, assistant_model=random_drafter(), hybridspec=True, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"Qwen3_5MoeForCausalLM that hybridspec has not patched"):
        target.generate(PROMPT, hybridspec=True, max_new_tokens=4)


def test_plain_generate_untouched_by_the_hint(target, monkeypatch):
    hybridspec.disable(target)
    hooked = GenerationMixin._validate_model_kwargs
    assert getattr(hooked, "_hybridspec_hint", False)
    # any other unknown kwarg still gets transformers' own message, with no word of hybridspec
    with pytest.raises(ValueError, match=r"model_kwargs` are not used by the model: \['hybrid_spec'\]") as info:
        target.generate(PROMPT, hybrid_spec=True, max_new_tokens=4)
    assert "enable" not in str(info.value)
    out = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    monkeypatch.setattr(GenerationMixin, "_validate_model_kwargs", hooked.__wrapped__)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=12, do_sample=False), out)


def test_hint_attaches_when_transformers_loads_after_hybridspec():
    """`import hybridspec` first (transformers not loaded yet), then a model: the hint is there,
    and generating on the CPU prints no advice to install GPU-only packages."""
    code = textwrap.dedent("""
        import sys
        import hybridspec
        assert "transformers" not in sys.modules and "torch" not in sys.modules
        import torch
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        from hybridspec.tiny import TARGET
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TARGET)).eval()
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
        try:
            model.generate(torch.tensor([[1, 2, 3]]), hybridspec=True, max_new_tokens=3)
        except ValueError as e:
            print("HINT:", e)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "HINT:" in result.stdout and "hybridspec.enable(model)" in result.stdout
    if not torch.cuda.is_available():
        assert "flash-linear-attention" not in result.stderr and "causal_conv1d" not in result.stderr, result.stderr


def test_gpu_only_advice_filtered_only_without_cuda(monkeypatch):
    for name in _hints.ADVICE_LOGGERS:
        assert any(isinstance(f, _hints.GpuOnlyAdviceFilter) for f in logging.getLogger(name).filters)
    record = lambda msg: logging.LogRecord("transformers.integrations.hub_kernels", logging.WARNING, "", 0, msg,  # noqa: E731
                                           None, None)
    advice = record("`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because "
                    "`flash-linear-attention` is not installed.")
    other = record("something else entirely")
    f = _hints.GpuOnlyAdviceFilter()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not f.filter(advice) and f.filter(other)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert f.filter(advice) and f.filter(other)


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.zeros(1, 0, dtype=torch.long), r"input_ids is empty \(shape \(1, 0\)\)"),
        (torch.tensor([[1, VOCAB]]), rf"token id {VOCAB}, outside the target's vocabulary 0\.\.{VOCAB - 1}"),
        (torch.tensor([[-1, 4]]), r"token id -1, outside the target's vocabulary"),
        (torch.tensor([[1.0, 2.0]]), "input_ids must hold integer token ids"),
    ],
)
def test_bad_prompts_name_the_input(target, ids, message):
    hybridspec.enable(target)
    try:
        with pytest.raises(ValueError, match=message):
            target.generate(ids, assistant_model=random_drafter(), hybridspec=True, max_new_tokens=4)
    finally:
        hybridspec.disable(target)


def test_drafter_for_another_target_depth(target):
    drafter = DFlashDrafter(DFlashConfig.from_dict(config(num_target_layers=48)))
    with pytest.raises(ValueError, match=r"num_target_layers=48, this target has 4 layers"):
        drafter.bind(target)
    # the depth it names is the target's: binds
    DFlashDrafter(DFlashConfig.from_dict(config(num_target_layers=4))).bind(target)


def made_with(drafter) -> object:
    return calibration(drafter_fingerprint=drafter_fingerprint(drafter),
                       summary={"drafter": type(drafter).__name__, **drafter_identity(drafter)})


def test_replay_calibration_with_a_plain_drafter(target):
    plain = random_drafter().bind(target)
    replay = DeviceReplayDrafter(plain, torch.zeros(0, dtype=torch.long))
    args = ("a" * 64, drafter_fingerprint(plain), "NVIDIA H200", VERSIONS)
    with pytest.raises(ValueError, match=r"made with the replay drafter \(simulated acceptance.*passes the plain drafter"):
        made_with(replay).check(*args)
    back = ("a" * 64, drafter_fingerprint(replay), "NVIDIA H200", VERSIONS)
    with pytest.raises(ValueError, match=r"made with this drafter used plainly.*inside the replay drafter"):
        made_with(plain).check(*back)
    # each used with the drafter it was made with passes
    made_with(replay).check(*back)
    made_with(plain).check(*args)
    # another drafter altogether is still "another drafter"
    other = DFlashDrafter(DFlashConfig.from_dict(config(num_hidden_layers=1)))
    with pytest.raises(ValueError, match="measured for another drafter"):
        made_with(replay).check("a" * 64, drafter_fingerprint(other), "NVIDIA H200", VERSIONS)
