"""Capabilities are `typing.Protocol`s the objects satisfy, not attributes probed with getattr."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import hybridspec
from hybridspec.drafter.protocol import CompilableDrafter, DeviceDrafter, Drafter
from hybridspec.fingerprint import Fingerprinted
from hybridspec.policy import AcceptanceModel, AdaptivePolicy, FixedPolicy, LengthPolicy, Policy, RatioPolicy
from hybridspec.round.accept import greedy_accept, sample_accept
from hybridspec.round.protocols import AcceptRule, Process, RoundRecorder, Top1AcceptRule
from hybridspec.round.round import Sampler
from hybridspec.sim.forced import ForcedAcceptance
from hybridspec.sim.replay import DeviceReplayDrafter, ReplayDrafter
from hybridspec.sim.scripted import ScriptedReplayDrafter
from hybridspec.tiny import tiny_drafter

CAPABILITIES = {"device_resident", "static_buffers", "forced", "correction", "acceptance", "two_stage", "reset",
                "prepare", "observe", "propose", "start", "select", "compile_layers"}


def test_drafters_satisfy_their_protocols():
    real = tiny_drafter()
    device = DeviceReplayDrafter(real, torch.zeros(3, dtype=torch.long))
    host = [ReplayDrafter(real, torch.zeros(3, dtype=torch.long)), ScriptedReplayDrafter(1, torch.zeros(3), [0])]
    for d in (real, device):
        assert isinstance(d, DeviceDrafter), type(d).__name__
        assert isinstance(d, CompilableDrafter), type(d).__name__
    for d in host:
        assert isinstance(d, Drafter) and not isinstance(d, DeviceDrafter), type(d).__name__
    # calibration artifacts identify a drafter by its fingerprint config; the replay drafters' differ
    assert all(isinstance(d, Fingerprinted) for d in (real, device, host[0]))
    assert device.fingerprint_config() != real.fingerprint_config() == real.config.to_dict()


def test_policies_rules_and_hooks_satisfy_their_protocols():
    policies = [AdaptivePolicy("hybridspec", LengthPolicy.builtin_default()), FixedPolicy("fixed", 4),
                RatioPolicy("dcut", (4, 8), tuple(float(w) for w in range(16)), 1.0)]
    assert all(isinstance(p, Policy) for p in policies)
    replay = DeviceReplayDrafter(tiny_drafter(), torch.zeros(3, dtype=torch.long))
    assert all(isinstance(r, AcceptRule) for r in (greedy_accept, sample_accept, ForcedAcceptance(replay)))
    # only a rule that reads nothing but the argmax takes the fused head's top-1
    assert isinstance(ForcedAcceptance(replay), Top1AcceptRule)
    assert not any(isinstance(r, Top1AcceptRule) for r in (greedy_accept, sample_accept))
    assert isinstance(Sampler(False).process, Process)
    from hybridspec.calibration.acceptance import AcceptanceModel as Fitted
    from hybridspec.calibration.capture import RoundRecorder as Recorder

    assert issubclass(Fitted, AcceptanceModel)
    assert isinstance(Recorder(torch.device("cpu"), 8), RoundRecorder)


def test_no_getattr_capability_probes_in_the_library():
    probes = []
    for path in Path(hybridspec.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in CAPABILITIES):
                probes.append(f"{path.name}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    assert not probes, probes
