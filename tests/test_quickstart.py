"""The README's first command: the quickstart runs the committed pair and shows real, exact text."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_prints_exact_real_text():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=True).stdout
    assert out.count("identical to target-only greedy decoding: True") == 2, out
    assert out.count("same seed, same tokens: True") == 2, out
    assert "target passes instead of 64" in out and "SIMULATED" not in out, out
