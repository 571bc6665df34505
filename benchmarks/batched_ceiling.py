"""How far any length policy can take a batched round past our batched AR, under the replay model.

Not a timing run: it reads two that were (a `hybridspec bench --batch-size B` output directory, and
`benchmarks/bench_runner.py --split-batch B --split-at ...`'s runner.json) and simulates decoding on
them with the replay drafter's acceptance model (`hybridspec.sim.replay`: per round and row
c ~ Beta(5, 2), draft i right with probability c). Acceptance in every figure here is simulated.

Three cost models, the AR step in the first two being the bench's own (its AR row):
- calibration: a round at w from the bench's batched calibration (`hybridspec calibrate
  --batch-sizes`; before 2026-12-05 it timed partial rounds too, which underprices long ones);
- split: a round at w the sum of the split's measured parts (GDN, attention, MoE, LM head + accept,
  drafter, Stage 0 as the round runs it; each part a graph of its own, so launch gaps between parts
  and the host's work are left out);
- bytes bound: every part of the split at its bytes bound (`component_bytes`: each weight once, each
  expert of the batch's union once), the AR step being the split at w = 1 without the drafter. Any
  common factor over the bound leaves the ratios unchanged, so this is also the ceiling for kernels
  that are all equally far from their bytes.

Policies, each over the length set of the batched policy:
- fixed w;
- knows c: each round picks w from every row's true c (more than a policy can know);
- knows c + confidences: from every row's c and each draft's confidence, as the replay drafter
  draws it (which depends on whether the draft is right): the Bayes-optimal choice from
  everything a policy could know before verifying, so the ceiling of any length policy;
- clairvoyant: each round picks w from how many drafts of every row are right (more than can be
  known before verifying; the length set and the one shared w remain).

Two regimes: the bench's (B rows of `max_new_tokens` each; a row that reaches its budget idles
while the others go on; a round costs C(w) whoever is live, which is the cost model's weak point
in the tail) and the steady state (every row always live: no round is ever partly idle, so no
policy's batch throughput can pass its steady-state figure). The regime-one vanilla figure is
printed beside the bench's measured one as a check of the simulator.

Where the split was timed at fewer lengths than the batched policy uses, `--interpolate` fills the
missing ones (split and bound) linearly between the nearest timed lengths. The MoE cost grows with
the union of experts over the batch, a concave function of w, so the chord lies below it:
interpolated rounds are priced cheaper than they are, which flatters speculation, never AR.

    python benchmarks/batched_ceiling.py --bench DIR --split runner.json [--interpolate] [--out ceiling.json]
    python benchmarks/batched_ceiling.py --bench bench.json --calibration calibration.json --split split.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridspec.sim.replay import BETA_A, BETA_B, CONFIDENCE_SHIFT  # noqa: E402

BOUND_PARTS = ("gdn", "attention", "moe", "lm_head_accept", "other")
POLICIES = ("knows c", "knows c + confidences", "clairvoyant")
ROUND_PARTS = ("gdn", "attention", "moe", "lm_head_accept", "drafter", "stage0")


def acceptance_label(beta: tuple[float, float]) -> str:
    if beta == (BETA_A, BETA_B):
        return f"simulated: the replay model (c ~ Beta({BETA_A}, {BETA_B}) per round and row), Monte Carlo"
    return (f"simulated, what-if: c ~ Beta({beta[0]:g}, {beta[1]:g}) per round and row (not the replay model's "
            f"Beta({BETA_A}, {BETA_B})), Monte Carlo")


def beta_arg(text: str) -> tuple[float, float]:
    """`--beta a,b`, both positive."""
    try:
        a, b = (float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'a,b', got {text!r}") from None
    if a <= 0 or b <= 0:
        raise argparse.ArgumentTypeError(f"both parameters must be positive, got {text!r}")
    return a, b


def interpolated(bound: dict[int, float], w: int) -> float:
    """`bound` at w, linearly between the nearest measured lengths (w inside their range)."""
    lo, hi = max(k for k in bound if k <= w), min(k for k in bound if k >= w)
    return bound[lo] if lo == hi else bound[lo] + (bound[hi] - bound[lo]) * (w - lo) / (hi - lo)


def costs(bench: dict, calibration: dict, split: dict,
          interpolate: bool = False) -> tuple[dict[str, tuple[float, dict[int, float]]], list[int]]:
    """{model: (AR ms per step, {w: round ms})} for the calibration, split and bytes-bound models,
    and the lengths the split lacked (interpolated)."""
    B = bench["batch_size"]
    ar = next(r for r in bench["rows"] if r["method"] == "AR (ours)")
    entry = next((e for e in calibration["batches"] if e["batch_size"] == B), None)
    if entry is None:
        raise SystemExit(f"the calibration has no batch of {B}: the bench's output directory holds the one it used")
    bound = split["bound_ms"]
    have = sorted(int(w) for w in bound)
    missing = [w for w in entry["lengths"] if w not in have]
    if 1 not in have or missing and not (interpolate and max(missing) <= have[-1]):
        raise SystemExit(f"the split has no bound at w = {sorted({1, *missing} - set(have))}: run bench_runner.py "
                         f"--split-batch {B} --split-at 1,{','.join(map(str, entry['lengths']))}"
                         + ("" if 1 not in have or max(missing) > have[-1] else ", or pass --interpolate"))
    at = {w: sum(bound[str(w)][k] for k in BOUND_PARTS) for w in have}
    drafter = {w: bound[str(w)]["drafter"] for w in have}
    timed = {w: sum(split["split"][str(w)][k] for k in ROUND_PARTS) for w in have}
    ar_ms = B / ar["tokens_per_s"] * 1e3
    return {"calibration": (ar_ms, dict(zip(entry["lengths"], entry["cost"]))),
            "split": (ar_ms, {w: interpolated(timed, w) for w in entry["lengths"]}),
            "bytes bound": (at[1], {w: interpolated(at, w) + interpolated(drafter, w) for w in entry["lengths"]})}, missing


def accepted_lengths(rng, B: int, D: int, beta: tuple[float, float] = (BETA_A, BETA_B)) -> tuple[np.ndarray, ...]:
    """One round of the replay model: every row's c `[B]`, its leading right drafts `[B]`, and each
    draft's probability of being right given c and its confidence `[B, D]`. The replay drafter's
    confidence is sigmoid(logit(c) + s (2 x - 1) + e), e ~ N(0, 1), s = `CONFIDENCE_SHIFT`, so
    u = logit(confidence) - logit(c) has likelihood ratio exp(2 s u) between right and wrong."""
    c = rng.beta(*beta, B)
    right = rng.random((B, D)) < c[:, None]
    u = CONFIDENCE_SHIFT * (2 * right - 1) + rng.standard_normal((B, D))
    logit = np.log(c / (1 - c))[:, None] + 2 * CONFIDENCE_SHIFT * u
    posterior = 0.5 * (1 + np.tanh(logit / 2))  # sigmoid, without overflow
    return c, np.where(right.all(1), D, right.argmin(1)), posterior


def simulate(rng, cost: dict[int, float], policy: str, rho: float, B: int, budget: int | None, rounds: int,
             D: int = 15, beta: tuple[float, float] = (BETA_A, BETA_B)) -> float:
    """Tokens per ms over the batch. `budget` None: the steady state, `rounds` rounds; else repeat
    the bench's batch (each row `budget` tokens) until `rounds` rounds have run."""
    ws = np.array(sorted(cost))
    cs = np.array([cost[w] for w in ws])
    tokens = ms = n = 0
    while n < rounds:
        left = np.full(B, budget if budget is not None else np.iinfo(np.int64).max // 2)
        while left.max() > 0 and n < rounds:
            c, a, posterior = accepted_lengths(rng, B, D, beta)
            live = left > 0
            if policy == "knows c":
                gain = np.array([np.minimum((1 - c ** w) / (1 - c), left)[live].sum() for w in ws])
                w = ws[np.argmax(gain - rho * cs)]
            elif policy == "knows c + confidences":
                # expected emitted at w: 1 + sum_{i < w - 1} P(drafts 1..i+1 all right)
                expected = np.concatenate([np.ones((B, 1)), 1 + np.cumsum(np.cumprod(posterior, 1), 1)], 1)
                gain = np.array([np.minimum(expected[:, w - 1], left)[live].sum() for w in ws])
                w = ws[np.argmax(gain - rho * cs)]
            elif policy == "clairvoyant":
                gain = np.array([np.minimum(np.minimum(a + 1, w), left)[live].sum() for w in ws])
                w = ws[np.argmax(gain - rho * cs)]
            else:
                w = int(policy)
            emit = np.where(live, np.minimum(np.minimum(a + 1, w), left), 0)
            left = left - emit
            tokens, ms, n = tokens + emit.sum(), ms + cost[w], n + 1
    return tokens / ms


def best(rng, cost, policy, B, budget, rounds, beta=(BETA_A, BETA_B)) -> float:
    """The policy's throughput at its best trade-off rho (a grid around the fixed lengths' best)."""
    top = max(simulate(rng, cost, str(w), 0.0, B, budget, rounds // 4, beta=beta) for w in cost)
    return max(simulate(rng, cost, policy, rho, B, budget, rounds, beta=beta) for rho in top * np.linspace(0.6, 1.6, 11))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", required=True,
                        help="a `hybridspec bench --batch-size B` output directory, or its bench.json")
    parser.add_argument("--calibration", default="",
                        help="the bench's calibration.json (default: the one in the --bench directory)")
    parser.add_argument("--split", required=True, help="runner.json of `bench_runner.py --split-batch B --split-at ...`")
    parser.add_argument("--interpolate", action="store_true",
                        help="fill lengths the split lacks linearly between measured ones (a cheaper round than "
                             "the bound: it flatters speculation)")
    parser.add_argument("--rounds", type=int, default=20000, help="simulated rounds per figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beta", type=beta_arg, default=(BETA_A, BETA_B),
                        help=f"the per-round c ~ Beta(a, b) as 'a,b' (default the replay model's {BETA_A},{BETA_B}; "
                             "another is a what-if, and the output says so)")
    parser.add_argument("--out", default="", help="write the table as JSON here")
    args = parser.parse_args()
    bench_path = Path(args.bench)
    if bench_path.is_dir():
        bench_path = bench_path / "bench.json"
    bench = json.loads(bench_path.read_text())
    calibration = json.loads(Path(args.calibration or bench_path.parent / "calibration.json").read_text())
    split = json.loads(Path(args.split).read_text())["batch_split"]
    B, budget = bench["batch_size"], bench["max_new_tokens"]
    if split["batch_size"] != B:
        raise SystemExit(f"the split is at a batch of {split['batch_size']}, the bench at {B}")
    rng = np.random.default_rng(args.seed)
    measured = {r["method"]: r["speedup_vs_ar"] for r in bench["rows"]}
    acceptance = acceptance_label(args.beta)
    print(f"acceptance: {acceptance}; batch {B}, {budget} new tokens per row; {args.rounds} rounds per figure")
    print(f"bench measured vs AR: " + ", ".join(f"{k} {v:.3f}" for k, v in measured.items() if k != "AR (ours)"))
    table = []
    models, interpolated_at = costs(bench, calibration, split, args.interpolate)
    if interpolated_at:
        print(f"split and bytes bound at w = {interpolated_at} interpolated between the split's lengths (priced low)")
    for model, (ar_ms, cost) in models.items():
        ar = B / ar_ms
        print(f"\n{model}: AR {ar_ms:.3f} ms a step; round ms " + " ".join(f"{w}:{c:.2f}" for w, c in cost.items()))
        print(f"{'policy':>12} | bench regime vs AR | steady state vs AR")
        for policy in [*(str(w) for w in cost), *POLICIES]:
            runs = [simulate(rng, cost, policy, 0.0, B, budget, args.rounds, beta=args.beta) if policy[0].isdigit()
                    else best(rng, cost, policy, B, budget, args.rounds, args.beta) for budget in (budget, None)]
            row = dict(cost_model=model, policy=policy if not policy[0].isdigit() else f"fixed w={policy}",
                       bench_regime=runs[0] / ar, steady_state=runs[1] / ar)
            table.append(row)
            print(f"{row['policy']:>12} | {row['bench_regime']:18.3f} | {row['steady_state']:18.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(acceptance=acceptance, simulated=True, beta=list(args.beta), batch_size=B,
                                                  max_new_tokens=budget, rounds=args.rounds, seed=args.seed,
                                                  bound_interpolated_at=interpolated_at,
                                                  costs={m: dict(ar_ms=a, round_ms=c) for m, (a, c) in models.items()},
                                                  bench_measured_vs_ar=measured, rows=table), indent=1))


if __name__ == "__main__":
    main()
