"""How far any length policy can take a batched round past our batched AR, under the replay model.

Not a timing run: it reads two that were (a `hybridspec bench --batch-size B` output directory, and
`benchmarks/bench_runner.py --split-batch B --split-at ...`'s runner.json) and simulates decoding on
them with the replay drafter's acceptance model (`hybridspec.sim.replay`: per round and row
c ~ Beta(5, 2), draft i right with probability c). Acceptance in every figure here is simulated.

Four cost models, the AR step in the first three being the bench's own (its AR row):
- calibration: a round at w from the bench's batched calibration (`hybridspec calibrate
  --batch-sizes`; before 2026-12-05 it timed partial rounds too, which underprices long ones);
- split: a round at w the sum of the split's measured parts (GDN, attention, MoE, LM head + accept,
  drafter, Stage 0 as the round runs it; each part a graph of its own, so launch gaps between parts
  and the host's work are left out; the GDN and MoE parts time Layer 0 in full, which the round's
  second stage skips after Stage 0, so a round is overpriced by up to Stage 0's time, 0.07 ms at
  B = 4, against speculation);
- split + overhead: the split plus one per-round overhead (the gaps between parts and the host's
  work), fitted so that fixed w = 16 simulates at the bench's measured vanilla DFlash ratio under
  the replay model (`fit_overhead`), whatever `--beta` says;
- bytes bound: every part of the split at its bytes bound (`component_bytes`: each weight once, each
  expert of the batch's union once), the AR step being the split at w = 1 without the drafter. Any
  common factor over the bound leaves the ratios unchanged, so this is also the ceiling for kernels
  that are all equally far from their bytes.

Policies, each over the length set of the batched policy:
- fixed w;
- calibrated: the batched HybridSpec policy's choice (`policy.BatchPolicy`, without the routing
  correction and at its best rho): the acceptance model `hybridspec calibrate` fits
  (`fit_acceptance`, on 4,000 replay rounds) predicts each draft from its confidence and entropy;
- knows c: each round picks w from every row's true c (which no policy sees);
- knows c + confidences: from every row's c and each draft's confidence, as the replay drafter
  draws it (which depends on whether the draft is right), scored at the price the round will pay:
  per round the Bayes-optimal choice from everything a policy could know before verifying. In the
  steady state (rounds i.i.d.) that bounds any length policy over the length set; over the bench's
  finite batch a policy that also weighs the rows' remaining budgets can do slightly better;
- clairvoyant: each round picks w from how many drafts of every row are right (more than can be
  known before verifying; the length set and the one shared w remain).

Two regimes: the bench's (B rows of `max_new_tokens` - 1 decoded tokens each, the first coming
from the prefill; a row that reaches its budget idles while the others go on; under the split and
bytes-bound models such a round pays its MoE blocks at the rows it counts, the other parts in full,
under the calibration model everything in full) and the steady state (every row always live; the
parts other than the MoE blocks run for every row whoever is live, so a partly idle round is never
cheaper per token, and the steady state bounds the bench's regime). The bench regime's fixed
w = 16 row is printed beside the bench's measured vanilla DFlash as a check of the simulator.

Where the split was timed at fewer lengths than the batched policy uses, `--interpolate` fills the
missing ones (split and bound) linearly between the nearest timed lengths. The MoE cost grows with
the union of experts over the batch, a concave function of w, so the chord lies below it:
interpolated rounds are priced cheaper than they are, which flatters speculation, never AR.

    python benchmarks/batched_ceiling.py --bench DIR --split runner.json [--interpolate] [--out ceiling.json]
    python benchmarks/batched_ceiling.py --bench bench.json --calibration calibration.json --split split.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridspec.policy import expected_tokens  # noqa: E402
from hybridspec.sim.replay import BETA_A, BETA_B, CONFIDENCE_SHIFT, confidence_entropy  # noqa: E402

BOUND_PARTS = ("gdn", "attention", "moe", "lm_head_accept", "other")
POLICIES = ("calibrated", "knows c", "knows c + confidences", "clairvoyant")
MODEL_SEED = 12345  # the "calibrated" policy's fit draws its own rounds, the same for every figure
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


def on_curve(curve: dict[int, float], w: float) -> float:
    """`curve` {w: ms} at w, linearly between its nearest lengths (clamped outside them)."""
    ws = sorted(curve)
    return float(np.interp(w, ws, [curve[k] for k in ws]))


@dataclass(frozen=True)
class Cost:
    """A round's price. `full` {w: ms}: every row verifies w. With `moe_rows`, a round in which fewer
    rows count (a finished row counts one, a row near its limit its budget, as the MoE op masks them)
    pays `base` {w: ms} (every part but the MoE blocks) plus the MoE blocks at its counted rows,
    linear between the `moe_rows` (rows, ms) points; otherwise it pays `full` whoever counts."""

    full: dict[int, float]
    base: dict[int, float] | None = None
    moe_rows: tuple[tuple[int, float], ...] | None = None
    # added to every round (and to `full`'s use by a policy): what the parts leave out
    overhead_ms: float = 0.0

    def at(self, w: int, counted: int) -> float:
        if self.moe_rows is None:
            return self.overhead_ms + on_curve(self.full, w)
        return self.overhead_ms + on_curve(self.base, w) + on_curve(dict(self.moe_rows), counted)


def costs(bench: dict, calibration: dict, split: dict,
          interpolate: bool = False) -> tuple[dict[str, tuple[float, Cost]], list[int]]:
    """{model: (AR ms per step, its `Cost`)} for the calibration, split and bytes-bound models, and
    the lengths the split lacked (interpolated)."""
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

    def priced(total: dict[int, float], moe: dict[int, float]) -> Cost:
        base = {w: on_curve(total, w) - on_curve(moe, w) for w in entry["lengths"]}
        return Cost({w: on_curve(total, w) for w in entry["lengths"]}, base,
                    tuple((B * w, moe[w]) for w in have))

    rounds_bound = {w: at[w] + drafter[w] for w in have}
    return {"calibration": (ar_ms, Cost(dict(zip(entry["lengths"], entry["cost"])))),
            "split": (ar_ms, priced(timed, {w: split["split"][str(w)]["moe"] for w in have})),
            "bytes bound": (at[1], priced(rounds_bound, {w: bound[str(w)]["moe"] for w in have}))}, missing


class Draws(NamedTuple):
    """One round of the replay model for B rows of D drafts."""

    c: np.ndarray  # [B] each row's acceptance rate
    leading: np.ndarray  # [B] leading right drafts
    posterior: np.ndarray  # [B, D] P(draft right | c, its confidence)
    confidence: np.ndarray  # [B, D] the replay drafter's top-1 probability
    entropy: np.ndarray  # [B, D] nats, as the replay drafter spreads the rest over OTHER_TOKENS


def accepted_lengths(rng, B: int, D: int, beta: tuple[float, float] = (BETA_A, BETA_B)) -> Draws:
    """One round of the replay model (`hybridspec.sim.replay.replay_round`'s draws, in numpy). The
    replay drafter's confidence is sigmoid(logit(c) + s (2 x - 1) + e), e ~ N(0, 1), s =
    `CONFIDENCE_SHIFT`, so u = logit(confidence) - logit(c) has likelihood ratio exp(2 s u) between
    right and wrong: `posterior` is exact given c and the confidence."""
    c = rng.beta(*beta, B)
    right = rng.random((B, D)) < c[:, None]
    u = CONFIDENCE_SHIFT * (2 * right - 1) + rng.standard_normal((B, D))
    prior = np.log(c / (1 - c))[:, None]
    sigmoid = lambda z: 0.5 * (1 + np.tanh(z / 2))  # without overflow
    confidence = sigmoid(prior + u)
    entropy = confidence_entropy(torch.from_numpy(confidence)).numpy()
    return Draws(c, np.where(right.all(1), D, right.argmin(1)), sigmoid(prior + 2 * CONFIDENCE_SHIFT * u),
                 confidence, entropy)


@functools.lru_cache(maxsize=None)
def fit_policy_model(D: int, beta: tuple[float, float], rows: int = 4000):
    """The acceptance model `hybridspec calibrate` would fit on `rows` rounds of the replay drafter
    at w = D + 1 (`hybridspec.calibration.acceptance.fit_acceptance`), for the "calibrated" policy;
    its own draws (`MODEL_SEED`), fitted once per process."""
    from hybridspec.calibration.acceptance import fit_acceptance

    draws = accepted_lengths(np.random.default_rng(MODEL_SEED), rows, D, beta)
    return fit_acceptance(draws.confidence, draws.entropy, draws.leading)


def expected_emitted(prefix: np.ndarray) -> np.ndarray:
    """`[rows, D]` P(drafts 1..i all right) -> `[rows, D + 1]`: column w - 1 the expected tokens at
    w (`hybridspec.policy.expected_tokens`, as the policy computes them)."""
    return expected_tokens(torch.from_numpy(prefix)).numpy()


def simulate(rng, cost: Cost | dict[int, float], policy: str, rho: float, B: int, budget: int | None, rounds: int,
             D: int = 15, beta: tuple[float, float] = (BETA_A, BETA_B)) -> float:
    """Tokens per ms over the batch. `budget` None: the steady state, `rounds` rounds; else repeat
    the bench's batch (each row `budget` tokens) until `rounds` rounds have run. Every round's draws
    are taken up front (they do not depend on the choices), so the models run once per call.

    A length past every live row's budget verifies the largest budget instead (as the batched
    policies do), priced on the curve between the lengths around it. Each candidate w scores the
    expected tokens sum_b E[min(a_b + 1, w, left_b)] less rho x its price: for "calibrated" the
    full-batch C(w), as `BatchPolicy` prices it; for the others the price the round would pay."""
    cost = cost if isinstance(cost, Cost) else Cost(cost)
    ws = np.array(sorted(cost.full))
    cs = np.array([cost.full[w] for w in ws]) + cost.overhead_ms
    flat = accepted_lengths(rng, rounds * B, D, beta)
    leading = flat.leading.reshape(rounds, B)
    if policy == "knows c":
        c = flat.c[:, None]
        expected = (1 - c ** np.arange(1, D + 2)) / (1 - c)  # [rows, D + 1]: column w - 1 at w
    elif policy == "knows c + confidences":
        expected = expected_emitted(np.cumprod(flat.posterior, 1))
    elif policy == "calibrated":
        model = fit_policy_model(D, tuple(beta))
        conditional = model.predict(torch.from_numpy(flat.confidence), torch.from_numpy(flat.entropy))
        expected = expected_emitted(np.cumprod(conditional.double().numpy(), 1))
    elif policy == "clairvoyant":
        expected = np.minimum(flat.leading[:, None] + 1, np.arange(1, D + 2)).astype(np.float64)
    else:
        expected = None
    if expected is not None:
        expected = expected.reshape(rounds, B, D + 1)
    rows = np.arange(B)[:, None]
    tokens = ms = n = 0
    while n < rounds:
        left = np.full(B, budget if budget is not None else np.iinfo(np.int64).max // 2)
        while left.max() > 0 and n < rounds:
            live = left > 0
            top = int(left[live].max())
            if expected is None:
                w = min(int(policy), top)
            else:
                eff = np.minimum(ws, top)  # [lengths]
                take = np.minimum(eff[None, :], left[:, None])  # [B, lengths]
                gain = (expected[n][rows, np.maximum(take, 1) - 1] * live[:, None]).sum(0)
                if policy == "calibrated":
                    price = cs
                else:
                    counted = np.where(live[:, None], take, 1).sum(0)
                    price = np.array([cost.at(int(e), int(k)) for e, k in zip(eff, counted)])
                w = int(eff[np.argmax(gain - rho * price)])
            counted = int(np.where(live, np.minimum(w, left), 1).sum())
            emit = np.where(live, np.minimum(np.minimum(leading[n] + 1, w), left), 0)
            left = left - emit
            tokens, ms, n = tokens + emit.sum(), ms + cost.at(w, counted), n + 1
    return tokens / ms


def fit_overhead(cost: Cost, ratio: float, ar_ms: float, B: int, budget: int, rounds: int, seed: int) -> float:
    """The per-round overhead (ms) at which fixed w = max length simulates at `ratio` x AR in the
    bench's regime (bisection on common draws; the simulated throughput falls as it grows)."""
    w = str(max(cost.full))
    at = lambda extra: simulate(np.random.default_rng(seed), replace(cost, overhead_ms=extra), w, 0.0, B, budget,
                                rounds) * ar_ms / B
    lo, hi = 0.0, 1.0
    while at(hi) > ratio and hi < 100:
        hi *= 2
    if at(lo) <= ratio:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) > ratio else (lo, mid)
    return (lo + hi) / 2


def best(rng, cost, policy, B, budget, rounds, beta=(BETA_A, BETA_B)) -> tuple[float, float, bool]:
    """The policy's throughput at its best trade-off rho, the rho, and whether it lay on the edge of
    the grid (then the figure may be low). The grid spans the best fixed length's throughput x
    0.5..2.5; each rho is tried on the same draws (a quarter of `rounds`), so the choice compares
    policies, not noise, and the chosen one is then run on fresh draws."""
    lengths = cost.full if isinstance(cost, Cost) else cost
    top = max(simulate(rng, cost, str(w), 0.0, B, budget, max(rounds // 4, 1), beta=beta) for w in lengths)
    grid = top * np.linspace(0.5, 2.5, 21)
    seed = int(rng.integers(2**63))
    tried = [simulate(np.random.default_rng(seed), cost, policy, rho, B, budget, max(rounds // 4, 1), beta=beta)
             for rho in grid]
    pick = int(np.argmax(tried))
    rho = float(grid[pick])
    return simulate(rng, cost, policy, rho, B, budget, rounds, beta=beta), rho, pick in (0, len(grid) - 1)


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
    # the prefill emits each row's first token; the bench's tokens/s counts the decode tokens after it
    B, budget = bench["batch_size"], bench["max_new_tokens"] - 1
    if split["batch_size"] != B:
        raise SystemExit(f"the split is at a batch of {split['batch_size']}, the bench at {B}")
    rng = np.random.default_rng(args.seed)
    measured = {r["method"]: r["speedup_vs_ar"] for r in bench["rows"]}
    acceptance = acceptance_label(args.beta)
    print(f"acceptance: {acceptance}; batch {B}, {budget} decoded tokens per row; {args.rounds} rounds per figure")
    print(f"bench measured vs AR: " + ", ".join(f"{k} {v:.3f}" for k, v in measured.items() if k != "AR (ours)"))
    table = []
    models, interpolated_at = costs(bench, calibration, split, args.interpolate)
    if interpolated_at:
        print(f"split and bytes bound at w = {interpolated_at} interpolated between the split's lengths (priced low)")
    vanilla = next((r["speedup_vs_ar"] for r in bench["rows"] if r["method"].startswith("vanilla DFlash")), None)
    if vanilla is not None:
        ar_ms, split_cost = models["split"]
        extra = fit_overhead(split_cost, vanilla, ar_ms, B, budget, args.rounds, args.seed)
        models = {**models, "split + overhead": (ar_ms, replace(split_cost, overhead_ms=extra))}
        models = {k: models[k] for k in ("calibration", "split", "split + overhead", "bytes bound")}
        print(f"split + overhead: {extra:.3f} ms added to every round, so that fixed w = {max(split_cost.full)} "
              f"simulates at the bench's measured vanilla DFlash ({vanilla:.3f}x AR)")
    for model, (ar_ms, cost) in models.items():
        ar = B / ar_ms
        print(f"\n{model}: AR {ar_ms:.3f} ms a step; round ms "
              + " ".join(f"{w}:{c + cost.overhead_ms:.2f}" for w, c in cost.full.items())
              + ("; a round with fewer rows counted pays its MoE blocks at those rows" if cost.moe_rows else
                 "; every round at full price"))
        print(f"{'policy':>12} | bench regime vs AR | steady state vs AR")
        for policy in [*(str(w) for w in cost.full), *POLICIES]:
            runs, edges = [], []
            for left in (budget, None):
                if policy[0].isdigit():
                    runs.append(simulate(rng, cost, policy, 0.0, B, left, args.rounds, beta=args.beta))
                else:
                    figure, _, edge = best(rng, cost, policy, B, left, args.rounds, args.beta)
                    runs.append(figure)
                    edges.append(edge)
            if any(edges):
                print(f"  ({model}, {policy}: the best rho lay on the grid's edge; the figure may be low)")
            row = dict(cost_model=model, policy=policy if not policy[0].isdigit() else f"fixed w={policy}",
                       bench_regime=runs[0] / ar, steady_state=runs[1] / ar)
            table.append(row)
            print(f"{row['policy']:>12} | {row['bench_regime']:18.3f} | {row['steady_state']:18.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(acceptance=acceptance, simulated=True, beta=list(args.beta), batch_size=B,
                                                  max_new_tokens=budget + 1, decoded_tokens_per_row=budget, rounds=args.rounds, seed=args.seed,
                                                  bound_interpolated_at=interpolated_at,
                                                  costs={m: dict(ar_ms=a, round_ms=c.full, base_ms=c.base,
                                                                 moe_ms_at_rows=c.moe_rows, overhead_ms=c.overhead_ms)
                                                         for m, (a, c) in models.items()},
                                                  bench_measured_vs_ar=measured, rows=table), indent=1))


if __name__ == "__main__":
    main()
