"""The calibration artifact: one JSON file per (target, drafter, GPU), never pickle.

It is tied to the models by config fingerprints (a mismatch is an error: the acceptance model and
the cost curve describe other models) and records the device and library versions it was measured
under (a mismatch only warns: the numbers are probably still close).
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from hybridspec.calibration.acceptance import AcceptanceModel
from hybridspec.fingerprint import fingerprint

SCHEMA_VERSION = 1
RERUN = "rerun `hybridspec calibrate` for this target, drafter and GPU"

def runtime_versions() -> dict[str, str | None]:
    """Versions the artifact records: torch, transformers, triton (None without it), hybridspec."""
    import torch
    import transformers

    import hybridspec

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_version,
            "hybridspec": hybridspec.__version__}


def current_device_name(device=None) -> str:
    """`torch.cuda.get_device_name` for a CUDA device (default: the current one if any), else "cpu"."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


BATCH_COMMAND = "hybridspec calibrate --batch-sizes 1 2 4"


@dataclass(frozen=True)
class BatchCalibration:
    """What a batch of `batch_size` rows adds (`hybridspec calibrate --batch-sizes`): `lengths` the
    batched lengths, `cost[i]` the measured round time (ms) of the fixed-shape batched round at
    `lengths[i]`, `rho` tokens/ms (pooled over batches of recorded rounds), `eta_ms` ms per distinct
    Layer-0 expert, `nbar[i]` the mean Layer-0 experts that positions `lengths[i]..lengths[i+1]-1`
    add to the union over a batch (0 for the last length), `static_length` the best fixed length of
    the set."""

    batch_size: int
    lengths: tuple[int, ...]
    cost: tuple[float, ...]
    rho: float
    eta_ms: float
    nbar: tuple[float, ...]
    static_length: int

    def __post_init__(self):
        n = len(self.lengths)
        if self.batch_size < 2 or n == 0 or len(self.cost) != n or len(self.nbar) != n:
            raise ValueError(f"calibration: batch entry needs batch_size >= 2 and cost/nbar per length; got batch "
                             f"{self.batch_size}, lengths {self.lengths}, cost {self.cost}, nbar {self.nbar}")
        if self.static_length not in self.lengths or not self.rho > 0:
            raise ValueError(f"calibration: batch {self.batch_size}: static_length {self.static_length} must be one of "
                             f"{self.lengths} and rho positive (got {self.rho})")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v, tuple) else v for f in fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchCalibration:
        return cls(batch_size=int(d["batch_size"]), lengths=tuple(int(v) for v in d["lengths"]),
                   cost=tuple(float(v) for v in d["cost"]), rho=float(d["rho"]), eta_ms=float(d["eta_ms"]),
                   nbar=tuple(float(v) for v in d["nbar"]), static_length=int(d["static_length"]))


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """A fitted calibration. Times in ms, `rho` in tokens/ms, lengths in input tokens.

    `block_size` W = D + 1; `cost[w - 1]` = C_tgt(w) for w = 1..W; `fixed_ms` the w-independent
    round time; `stage0_slope_ms` s (ms per Stage-0 token); `eta_ms` (ms per distinct expert per MoE
    layer); `top_k` Layer-0 experts per token; `nbar` `[W]`, `nbar_given` `[W][top_k + 1]` (see
    `costs.routing_tables`); `static_length` the best single length; `summary` free-form numbers.
    `batches`: one `BatchCalibration` per batch size measured beyond 1 (artifacts without it, as
    older ones, serve batch size 1 only).
    """

    target_fingerprint: str
    drafter_fingerprint: str
    device_name: str
    versions: dict[str, str | None]
    block_size: int
    acceptance: AcceptanceModel
    cost: tuple[float, ...]
    fixed_ms: float
    stage0_slope_ms: float
    eta_ms: float
    top_k: int
    nbar: tuple[float, ...]
    nbar_given: tuple[tuple[float, ...], ...]
    rho: float
    static_length: int
    summary: dict = field(default_factory=dict)
    batches: tuple[BatchCalibration, ...] = ()
    schema_version: int = SCHEMA_VERSION

    def batch_entry(self, batch_size: int) -> BatchCalibration:
        """The entry for `batch_size` rows; a clear error naming the command when it lacks one."""
        for entry in self.batches:
            if entry.batch_size == batch_size:
                return entry
        held = [1] + [e.batch_size for e in self.batches]
        raise ValueError(f"the calibration holds batch sizes {held}, not {batch_size}: a batched call needs costs "
                         f"measured for its batch size; run `{BATCH_COMMAND}` (a batch of 3 uses the entry for 4)")

    def __post_init__(self):
        W = self.block_size
        problems = []
        if self.acceptance.num_positions != W - 1:
            problems.append(f"acceptance has {self.acceptance.num_positions} positions, block_size {W} needs {W - 1}")
        if len(self.cost) != W:
            problems.append(f"cost has {len(self.cost)} entries, block_size {W} needs {W}")
        if len(self.nbar) != W:
            problems.append(f"nbar has {len(self.nbar)} entries, block_size {W} needs {W}")
        if len(self.nbar_given) != W or any(len(row) != self.top_k + 1 for row in self.nbar_given):
            problems.append(f"nbar_given must be [{W}][{self.top_k + 1}] (block_size x top_k + 1)")
        if not 2 <= self.static_length <= W:
            problems.append(f"static_length {self.static_length} is outside 2..{W}")
        if not self.rho > 0:
            problems.append(f"rho must be positive, got {self.rho}")
        if problems:
            raise ValueError("calibration: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["acceptance"] = self.acceptance.to_dict()
        out["cost"] = list(self.cost)
        out["nbar"] = list(self.nbar)
        out["nbar_given"] = [list(row) for row in self.nbar_given]
        out["versions"] = dict(self.versions)
        out["summary"] = copy.deepcopy(self.summary)
        out["batches"] = [b.to_dict() for b in self.batches]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "calibration") -> Calibration:
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if "schema_version" not in d:
            raise ValueError(f"{source}: missing key 'schema_version'")
        if d["schema_version"] != SCHEMA_VERSION:
            raise ValueError(
                f"{source}: schema_version is {d['schema_version']!r}, this hybridspec reads {SCHEMA_VERSION}; {RERUN}"
            )
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.name not in ("summary", "schema_version", "batches")}
        missing, unknown = sorted(required - d.keys()), sorted(d.keys() - names)
        if missing or unknown:
            raise ValueError(f"{source}: missing keys {missing}, unknown keys {unknown}")
        try:
            return cls(
                schema_version=int(d["schema_version"]),
                target_fingerprint=str(d["target_fingerprint"]),
                drafter_fingerprint=str(d["drafter_fingerprint"]),
                device_name=str(d["device_name"]),
                versions=dict(d["versions"]),
                block_size=int(d["block_size"]),
                acceptance=AcceptanceModel.from_dict(d["acceptance"]),
                cost=tuple(float(v) for v in d["cost"]),
                fixed_ms=float(d["fixed_ms"]),
                stage0_slope_ms=float(d["stage0_slope_ms"]),
                eta_ms=float(d["eta_ms"]),
                top_k=int(d["top_k"]),
                nbar=tuple(float(v) for v in d["nbar"]),
                nbar_given=tuple(tuple(float(v) for v in row) for row in d["nbar_given"]),
                rho=float(d["rho"]),
                static_length=int(d["static_length"]),
                summary=dict(d.get("summary", {})),
                batches=tuple(BatchCalibration.from_dict(b) for b in d.get("batches", [])),
            )
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            raise ValueError(f"{source}: malformed calibration: {e}") from e

    def save(self, path: str | os.PathLike) -> None:
        """Write the artifact as JSON (indent 2). NaN or infinity anywhere is an error: strict JSON."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        # a reader never sees a half-written artifact
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        with open(path) as f:
            text = f.read()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)}: not a JSON calibration file ({e})") from e
        return cls.from_dict(d, source=os.fspath(path))

    def _drafter_mismatch(self, running: str) -> str:
        """Why the drafter differs, as far as the summary tells (`hybridspec.sim.identity.drafter_identity`):
        the replay drafter (simulated acceptance) and the same drafter used plainly have different
        fingerprints, because their acceptance differs."""
        kind = self.summary.get("drafter_kind")
        prints = self.summary.get("drafter_fingerprints") or {}
        made = self.summary.get("drafter")
        if kind == "replay" and running == prints.get("plain"):
            return ("it was made with the replay drafter (simulated acceptance, hybridspec.sim.replay) around this "
                    "drafter, and this call passes the plain drafter, whose acceptance is its own. Calibrate the "
                    "plain drafter (`hybridspec calibrate --drafter DIR`, not replay:DIR) or pass the replay drafter")
        if kind == "plain" and running == prints.get("replay"):
            return ("it was made with this drafter used plainly, and this call passes it inside the replay drafter "
                    "(simulated acceptance, hybridspec.sim.replay), whose acceptance is simulated. Calibrate with "
                    "`hybridspec calibrate --drafter replay:DIR` or pass the plain drafter")
        if kind is None and isinstance(made, str) and (made.startswith("replay:") or "Replay" in made):
            return (f"it was made with the replay drafter ({made}: simulated acceptance); if this is the same "
                    f"drafter used plainly, calibrate it plainly. Otherwise it was measured for another drafter; {RERUN}")
        return f"it was measured for another drafter; {RERUN}"

    def check(self, target_fingerprint: str, drafter_fingerprint: str, device_name: str,
              versions: dict[str, str | None]) -> None:
        """Raise ValueError if the schema or a model fingerprint differs from the running setup; one
        warning listing every difference if only the device name or library versions differ."""
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"calibration schema_version {self.schema_version} != {SCHEMA_VERSION}; {RERUN}")
        if self.target_fingerprint != target_fingerprint:
            raise ValueError(
                f"calibration target_fingerprint {self.target_fingerprint[:16]}... does not match the loaded model "
                f"({target_fingerprint[:16]}...): it was measured for another model; {RERUN}"
            )
        if self.drafter_fingerprint != drafter_fingerprint:
            raise ValueError(
                f"calibration drafter_fingerprint {self.drafter_fingerprint[:16]}... does not match the drafter "
                f"({drafter_fingerprint[:16]}...): {self._drafter_mismatch(drafter_fingerprint)}"
            )
        diffs = []
        if device_name != self.device_name:
            diffs.append(f"device_name {self.device_name!r} -> {device_name!r}")
        for key in sorted(self.versions.keys() | versions.keys()):
            if self.versions.get(key) != versions.get(key):
                diffs.append(f"{key} {self.versions.get(key)!r} -> {versions.get(key)!r}")
        if diffs:
            warnings.warn(
                f"hybridspec: the calibration was measured under a different setup ({', '.join(diffs)}); its costs "
                f"and rho may be off, {RERUN} to refresh them",
                stacklevel=2,
            )
