"""The plots of `hybridspec bench`: speedup per row, and the calibration's cost curve.

Every title says what was run (models, device, simulated or real acceptance) and wraps instead of
being cut off; simulated bars are hatched and noisy rows marked, each with a legend entry; the cost
curve shows the measured round times beside the fitted curve.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

TITLE_WIDTH = 70
REAL, NOISY = "tab:blue", "tab:gray"


def _title(*parts: str) -> str:
    return "\n".join(textwrap.fill(p, TITLE_WIDTH) for p in parts if p)


def _what(result: dict) -> str:
    return f"{result['models']} on {result['device']}"


def speedup_figure(result: dict):
    """Horizontal bars of each row's median speedup over AR (ours), with the min-max over the
    repeats as error bars; hatched where acceptance is simulated, gray where the row is noisy."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.45 * len(rows)))
    y = np.arange(len(rows))
    mid = np.array([r["speedup_vs_ar"] for r in rows])
    lo = np.array([r["speedup_vs_ar_range"][0] for r in rows])
    hi = np.array([r["speedup_vs_ar_range"][1] for r in rows])
    bars = ax.barh(y, mid, xerr=[mid - lo, hi - mid], capsize=3,
                   color=[NOISY if r["noisy"] else REAL for r in rows], edgecolor="black", linewidth=0.5)
    for bar, r in zip(bars, rows):
        if r["simulated"]:
            bar.set_hatch("//")
        if r["noisy"]:
            ax.text(r["speedup_vs_ar_range"][1], bar.get_y() + bar.get_height() / 2, "  noisy", va="center", fontsize=8)
    ax.set_yticks(y, [r["method"] for r in rows])
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", lw=1)
    ax.set_xlabel(f"speedup vs our AR (tokens/s ratio; median and range over {result['repeats']} repeats)")
    handles = [Patch(facecolor=REAL, edgecolor="black", label="measured")]
    if any(r["simulated"] for r in rows):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="simulated acceptance"))
    if any(r["noisy"] for r in rows):
        handles.append(Patch(facecolor=NOISY, edgecolor="black", label="noisy: ratio not meaningful"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(rows)), ncol=len(handles),
              fontsize=8, frameon=False)
    ax.set_title(_title(f"hybridspec bench: {_what(result)}",
                        f"{result['acceptance']['label']}; {result['prompts']} prompts x "
                        f"{result['max_new_tokens']} new tokens", result.get("note", "")), fontsize=9)
    return fig


def cost_figure(calibration, result: dict):
    """Measured mean round time per verified length (points) and the fitted `fixed_ms + C_tgt(w)`
    (line), with distinct (layer, expert) pairs per round on a second axis."""
    import matplotlib.pyplot as plt

    s = calibration.summary
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ws = np.arange(1, len(calibration.cost) + 1)
    lines = ax.plot(ws, calibration.fixed_ms + np.asarray(calibration.cost), "-", color="tab:blue",
                    label="fitted round time fixed + C(w)")
    measured = sorted((int(w), t) for w, t in (s.get("round_ms") or {}).items())
    if measured:
        lines += ax.plot(*zip(*measured), "o", color="tab:blue", markersize=7, label="measured mean round time")
    ax.set_xlabel("verified tokens w")
    ax.set_ylabel("ms per round")
    twin = ax.twinx()
    lines += twin.plot(ws, calibration.nbar[: len(ws)], "s--", color="tab:orange", markersize=4,
                       label="distinct (layer, expert) pairs")
    twin.set_ylabel("distinct (layer, expert) pairs")
    ax.legend(lines, [line.get_label() for line in lines], loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
              fontsize=8, frameon=False)
    residual = s.get("cost_rms_residual_ms")
    fit = "" if residual is None else f"fit RMS residual {residual:.3g} ms"
    if s.get("noisy"):
        fit = f"NOISY FIT: {s.get('noisy_reason')}"
    ax.set_title(_title(f"cost curve C(w) and distinct experts: {_what(result)}",
                        f"calibration drafter: {s.get('drafter', '?')}; {result['acceptance']['label']}", fit),
                 fontsize=9)
    return fig


def write_plots(out: Path, result: dict, calibration) -> list[str]:
    """speedup.png, and cost_curve.png where the run has a calibration (none when `--methods` keeps
    only fixed-length rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    figures = {"speedup.png": speedup_figure(result)}
    if calibration is not None:
        figures["cost_curve.png"] = cost_figure(calibration, result)
    for name, fig in figures.items():
        # bbox "tight" keeps the wrapped title and the legend below the axes inside the image
        fig.savefig(out / name, dpi=120, bbox_inches="tight")
        plt.close(fig)
        files.append(str(out / name))
    return files
