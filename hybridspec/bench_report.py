"""The report of `hybridspec bench`: columns and their footnotes, the noise flags, the table."""

from __future__ import annotations

import statistics

# a continuation whose distinct-token ratio is below this is reported as looping
LOOP_RATIO = 0.2
# (max - min) / median of a row's per-repeat tokens/s above which its ratio to AR is not meaningful
NOISY_SPREAD = 0.25
# table columns: (row key, header, footnote)
COLUMNS = (
    ("method", "method", "the decoding method; rows absent from a run are listed under the table with the reason"),
    ("simulated", "sim", "yes: acceptance simulated (replay drafter or forced acceptance), not a drafter's own"),
    ("tokens_per_s", "tok/s", "decode tokens per second after the first token (prefill excluded), summed over the "
                              "prompts; median over the repeats"),
    ("ttft_ms", "TTFT ms", "time to the first token, median over the calls: the prefill and the first token's read "
                           "(device synchronised); transformers' row from its `generate` call on"),
    ("spread", "spread", "(max - min) / median of the per-repeat tokens/s"),
    ("speedup_vs_ar", "vs AR", "median over the repeats of this row's tokens/s over AR (ours) in the same repeat"),
    ("mean_acceptance_length", "accept len", "mean tokens emitted per round (and per row in a batch): accepted drafts + 1"),
    ("ms_per_round", "ms/round", "decode time per verification round (median repeat)"),
    ("mean_w", "mean w", "mean tokens verified per round, the anchor included"),
    ("exact_match_rate", "exact vs AR", "fraction of prompts whose continuation equals AR (ours) token for token; "
                                        "n/a under forced acceptance, which emits the AR continuation by construction"),
    ("layer0_experts_per_round", "L0 experts", "mean distinct Layer-0 experts per round (what the routing "
                                               "correction reads); '-' where Layer 0 has no router boundary"),
    ("distinct_token_ratio", "distinct tok", f"mean fraction of distinct tokens in a continuation; below {LOOP_RATIO} "
                                             "it loops (random weights do, and a small trained target's greedy code often does)"),
    ("noisy", "flag", f"NOISY: the ratio is not meaningful: tokens/s spread (this row's or AR's) over "
                      f"{NOISY_SPREAD:.0%}, or the calibration's cost fit is noisy; bench.json says which"),
)

def spread(values) -> float:
    """(max - min) / median of positive timings or rates; 0 for one value."""
    v = [float(x) for x in values]
    if not v or min(v) <= 0:
        raise ValueError(f"spread: expected positive values, got {v}")
    return (max(v) - min(v)) / statistics.median(v)


def noise_reasons(tokens_per_s, ar_tokens_per_s=None, calibration_noise: str | None = None,
                  max_spread: float = NOISY_SPREAD) -> list[str]:
    """Why a row's ratio to AR is not meaningful (empty: it is). `tokens_per_s`: the row's
    per-repeat rates, at least 2; `ar_tokens_per_s`: AR's in the same repeats (None for the AR row
    itself); `calibration_noise`: why the calibration the row's policy uses is noisy, or None."""
    if len(tokens_per_s) < 2 or (ar_tokens_per_s is not None and len(ar_tokens_per_s) < 2):
        raise ValueError("noise_reasons needs at least 2 repeats: one timing has no spread")
    reasons = []
    own = spread(tokens_per_s)
    if own > max_spread:
        reasons.append(f"tokens/s spread {own:.0%} over {len(tokens_per_s)} repeats (> {max_spread:.0%})")
    base = None if ar_tokens_per_s is None else spread(ar_tokens_per_s)
    if base is not None and base > max_spread:
        reasons.append(f"the AR baseline's tokens/s spread {base:.0%} (> {max_spread:.0%})")
    if calibration_noise:
        reasons.append(f"calibration cost fit noisy: {calibration_noise}")
    return reasons


def calibration_noise(calibration) -> str | None:
    """The calibration's noisy-fit reason, from its summary (recomputed for artifacts made before
    the summary stored it); None when the fit is not noisy or nothing tells."""
    from hybridspec.calibration.costs import cost_fit_noise

    s = calibration.summary
    if "noisy" in s:
        return s.get("noisy_reason") if s["noisy"] else None
    if "cost_rms_residual_ms" in s and s.get("round_ms"):
        return cost_fit_noise(s["cost_rms_residual_ms"], list(s["round_ms"].values()))["noisy_reason"]
    return None


def print_table(result: dict) -> None:
    cells = [[h for _, h, _ in COLUMNS]] + [[_cell(key, r.get(key), r) for key, _, _ in COLUMNS] for r in result["rows"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    batch = result.get("batch_size", 1)
    rows = f"batch size {batch} (tokens/s: total over the batch), " if batch > 1 else ""
    print(f"\nhybridspec bench, {result['label']}: {result['models']} on {result['device']}, {rows}"
          f"{result['prompts']} prompts x {result['max_new_tokens']} new tokens, median of {result['repeats']} repeats")
    for i, row in enumerate(cells):
        print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    for key, header, note in COLUMNS:
        print(f"  {header}: {note}")
    for name, why in result["absent_rows"].items():
        print(f"absent: {name}: {why}")
    for r in result["rows"]:
        if r["noisy"]:
            print(f"NOISY {r['method']}: {'; '.join(r['noise_reasons'])}")
    if result["simulated"]:
        print(f"acceptance: {result['acceptance']['description']}")
    m = result["memory"]
    print(f"verification state: {m['ours_bytes'] / 1e6:.3g} MB vs the stock per-token states "
          f"{m['stock_per_token_state_bytes'] / 1e6:.4g} MB per request slot ({m['ratio']:.0f}x)"
          + (f"; for the batch of {m['batch_size']}: {m['batch_ours_bytes'] / 1e6:.3g} MB vs "
             f"{m['batch_stock_per_token_state_bytes'] / 1e6:.4g} MB" if m.get("batch_size", 1) > 1 else ""))
    if result["looping"]:
        print(f"note: the continuations loop (distinct-token ratio < {LOOP_RATIO}; repetitive text is easy to draft) for: "
              + ", ".join(result["looping"]))
    if "note" in result:
        print(f"note: {result['note']}")


def _cell(key: str, v, row: dict) -> str:
    if key == "simulated":
        return "yes" if v else "no"
    if key == "noisy":
        return "NOISY" if v else ""
    if key in ("exact_match_rate", "token_agreement") and v is None and "exactness" in row:
        return "n/a"
    if v is None:
        return "-"
    if isinstance(v, float):
        if key == "spread":
            return f"{v:.0%}"
        return "nan" if v != v else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)
