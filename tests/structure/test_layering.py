"""The package's dependencies point one way (CONTRIBUTING.md, "Layering"), and simulation stays
out of the decoding path. Walks every import of every module, lazy ones inside functions too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hybridspec

ROOT = Path(hybridspec.__file__).parent
# lower ranks may not import higher ones; one rank may import itself
RANK = {
    "cache": 0, "_hints": 0, "inputs": 0, "parallel": 0,
    "ops": 1,
    "state": 2, "experts": 2, "fused": 2,
    "split_projection": 2.5,
    "patches": 3, "drafter": 3,
    "policy": 4, "fingerprint": 4,
    "round": 5,
    "runner": 6, "sim": 6,
    "loading": 5,
    "generation": 7,
    "calibration": 8, "sharding": 8,
    "api": 9, "shapes": 9, "tiny": 9, "bench_report": 9, "bench_plots": 9,
    "bench": 10, "training": 10,
    "cli": 11,
    "__main__": 12, "__init__": 12,
}
DECODING_PATH = ["generation", "runner", "round", "patches", "state.py", "policy.py"]


def _unit(path: Path) -> str:
    """The layering unit of a module: its subpackage, or the module itself at the top level."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    """Every `hybridspec.X` unit the module imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "hybridspec" and len(parts) > 1:
                found.add(parts[1])
    return found & set(RANK) | {p for p in found if p not in RANK and (ROOT / p).exists()}


def test_every_unit_has_a_rank():
    units = {_unit(p) for p in ROOT.rglob("*.py")}
    assert units <= set(RANK), f"give these a rank in RANK and in CONTRIBUTING.md: {sorted(units - set(RANK))}"


def test_imports_point_down_the_layers():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        unit = _unit(path)
        for dep in _imports(path):
            if dep != unit and RANK.get(dep, 99) >= RANK[unit]:
                wrong.append(f"{path.relative_to(ROOT)} ({unit}, rank {RANK[unit]}) imports {dep} (rank {RANK.get(dep)})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_units():
    graph = {}
    for path in ROOT.rglob("*.py"):
        graph.setdefault(_unit(path), set()).update(d for d in _imports(path) if d != _unit(path))

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph.get(a, ()))

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert not cycles, cycles


def test_decoding_path_knows_nothing_of_simulation():
    pattern = re.compile(r"hybridspec\.sim|forced|replaydrafter|replay drafter|replay acceptance|simulat", re.I)
    hits = []
    for name in DECODING_PATH:
        for path in [ROOT / name] if name.endswith(".py") else sorted((ROOT / name).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
