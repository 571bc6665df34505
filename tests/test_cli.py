"""Discovery: `hybridspec --help` without torch or transformers, defaults shown, the lazy package,
docstrings that list the `generate` arguments, and the subcommand registry."""

from __future__ import annotations

import json
import pydoc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hybridspec
from hybridspec import cli

ROOT = Path(__file__).parents[1]
GENERATE_ARGUMENTS = ("hybridspec", "assistant_model", "verify_length", "policy", "calibration", "enforce_eager",
                      "reference_loop", "return_dict_in_generate", "hybridspec_stats")


def test_help_imports_neither_torch_nor_transformers():
    code = textwrap.dedent("""
        import contextlib, io, json, sys
        import hybridspec
        from hybridspec.cli import main
        helps = {}
        for argv in ([], ["bench"], ["calibrate"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                main(argv + ["--help"])
            helps[" ".join(argv)] = out.getvalue()
        print(json.dumps({"heavy": [m for m in ("torch", "transformers") if m in sys.modules], "helps": helps}))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["heavy"] == []
    # argparse wraps lines; compare with single spaces
    top, bench, calibrate = (" ".join(report["helps"][k].split()) for k in ("", "bench", "calibrate"))
    assert "calibrate" in top and "bench" in top
    # defaults are shown, and options whose default depends on the run say what it is
    assert "(default: 3)" in bench and "(default: bench_out)" in bench
    assert "3 with --tiny, else 4" in bench and "(default: 1)" in bench
    assert "2,4,8,16 on the CPU" in calibrate and "(default: 0)" in calibrate


def test_public_names_are_lazy_and_true_to_all():
    assert set(hybridspec.__all__) == {"DFlashDrafter", "disable", "enable", "tiny"}
    from hybridspec.api import disable, enable
    from hybridspec.drafter.dflash import DFlashDrafter

    assert hybridspec.enable is enable and hybridspec.disable is disable and hybridspec.DFlashDrafter is DFlashDrafter
    assert callable(hybridspec.tiny.tiny_target) and callable(hybridspec.tiny.tiny_drafter)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hybridspec.nope  # noqa: B018


def test_help_finds_the_generate_arguments():
    package = pydoc.render_doc(hybridspec, renderer=pydoc.plaintext)
    # the package's page is short (no inherited nn.Module methods) and lists every argument
    assert len(package.splitlines()) < 150
    for doc in (package, pydoc.render_doc(hybridspec.enable, renderer=pydoc.plaintext),
                hybridspec.DFlashDrafter.__doc__):
        missing = [a for a in GENERATE_ARGUMENTS if a not in doc]
        assert not missing, missing


def fake_run(args):
    return 7 if args.flag else 0


def test_subcommands_run_lazily_from_the_registry(monkeypatch):
    commands = dict(cli.COMMANDS)
    commands["fake"] = cli.Command(help="a test command", description="", run="tests.test_cli:fake_run",
                                   arguments=lambda p: p.add_argument("--flag", action="store_true"))
    monkeypatch.setattr(cli, "COMMANDS", commands)
    assert cli.main(["fake", "--flag"]) == 7
    assert cli.main(["fake"]) == 0


@pytest.mark.parametrize("argv", [["bench", "--tiny", "--repeats", "1"], ["bench", "--tiny", "--num-prompts", "0"],
                                  ["bench", "--tiny", "--out-split-k", "17"], ["bench", "--tiny", "--out-split-k", "0"],
                                  ["bench", "--tiny", "--router-split-k", "17"], ["bench", "--tiny", "--in-split-k", "0"],
                                  ["calibrate", "--target", "t", "--drafter", "d", "--prompts", "p", "--out", "o",
                                   "--lengths", "2,x"]])
def test_bad_arguments_stop_at_parsing(argv, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "error:" in capsys.readouterr().err
