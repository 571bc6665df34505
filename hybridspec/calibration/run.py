"""`hybridspec calibrate`: measure a target + drafter pair on this machine and fit the policy.

1. Load the models and the prompts; split the prompts (seeded) and keep the calibration half.
2. Capture run, verifying all D drafts every round: confidences, entropies, accepted counts and the
   routing of every MoE layer -> the acceptance model and the routing tables.
3. Fixed-length runs (the lengths asked for and W) -> mean round time per w -> `C_tgt` (quadratic
   fit with non-negative slope terms, minus its constant). A fit whose RMS residual is large next
   to the round times is flagged `noisy` in the summary (`costs.cost_fit_noise`).
4. Microbenchmarks: Stage-0 latency per token (`s`) and routed-expert latency per distinct expert
   at 16 rows (`eta`), each a line fit, floored at 0.
5. `rho` by Dinkelbach iteration, the best static length.
6. For each batch size of `--batch-sizes` beyond 1: the batched entry (`calibration.batched`).
Write the JSON artifact.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from tqdm.auto import tqdm

from hybridspec.calibration.acceptance import fit_acceptance
from hybridspec.calibration.artifact import SCHEMA_VERSION, Calibration, current_device_name, runtime_versions
from hybridspec.calibration.batched import calibrate_batch
from hybridspec.calibration.capture import (
    RoundRecorder,
    capture_arrays,
    expert_latency,
    generate_rounds,
    stage0_latency,
    timed_round_ms,
)
from hybridspec.calibration.costs import (
    best_static_length,
    cost_fit_noise,
    dinkelbach_rho,
    fit_line,
    fit_round_cost,
    routing_tables,
)
from hybridspec.calibration.prompts import load_prompts, load_tokenizer, render, split_prompts
from hybridspec.fingerprint import drafter_fingerprint, target_fingerprint
from hybridspec.loading import load_target
from hybridspec.sim.spec import drafter_identity, is_replay, load_drafter_spec
from hybridspec.patches import family_of
from hybridspec.policy import BATCH_SIZES, LengthPolicy, expected_tokens, prefix_probabilities

MAX_VERIFY = 16


def defaults(device) -> dict:
    """The run's size where the caller gives none: a GPU calibration of real checkpoints times every
    prompt at six lengths; on the CPU (tiny models) fewer timed prompts, lengths and tokens keep it
    to about 30 s on 2 cores."""
    if torch.device(device).type == "cuda":
        return dict(max_new_tokens=64, lengths=(2, 4, 6, 8, 12, 16), timed_prompts=None)
    return dict(max_new_tokens=32, lengths=(2, 4, 8, 16), timed_prompts=3)


def calibrate(target, drafter, prompts, out: str, tokenizer: str | None = None,
              max_new_tokens: int | None = None, device: str = "cpu", lengths=None, seed: int = 0,
              timed_prompts: int | None = None, accept=None, batch_sizes=(1,)) -> Calibration:
    """Run the whole calibration (module docstring) and write `out`; returns the artifact.
    `target`: a model directory or a loaded model; `drafter`: `DIR`, `replay:DIR`, or a drafter
    object (a replay drafter when it has a `continuation`); `prompts`: a JSONL file (its seeded
    calibration half is used) or a list of token ids `[1, n]` (used as given). `max_new_tokens`,
    `lengths` (timed for the cost curve) and `timed_prompts` (timed per length after one warm-up
    prompt; None: all) default by device (`defaults`). `accept`: an `AcceptRule` for every
    calibration round (`generate(hybridspec_accept=)`): the forced acceptance of random-weight
    benchmarks, so the calibration sees the acceptance the evaluation will (recorded in the summary).
    `batch_sizes`: the batch sizes to measure (1, 2, 4; 1 is always fitted)."""
    import hybridspec

    if not set(batch_sizes) <= set(BATCH_SIZES):
        raise ValueError(f"batch sizes must be among {BATCH_SIZES} (a batch of 3 runs as 4), got {list(batch_sizes)}")
    sizes = defaults(device)
    max_new_tokens = sizes["max_new_tokens"] if max_new_tokens is None else max_new_tokens
    lengths = sizes["lengths"] if lengths is None else lengths
    timed_prompts = sizes["timed_prompts"] if timed_prompts is None else timed_prompts
    if len(set(lengths)) < 3 or not all(2 <= w <= MAX_VERIFY for w in lengths):
        raise ValueError(f"lengths must hold at least 3 distinct values in 2..{MAX_VERIFY}, got {lengths}")
    dev = torch.device(device)
    # the replay drafter draws from torch's global generator
    torch.manual_seed(seed)
    model = hybridspec.enable(load_target(target, device) if isinstance(target, str) else target)
    draft = load_drafter_spec(drafter, device) if isinstance(drafter, str) else drafter
    draft.bind(model)
    W = min(draft.block_size, MAX_VERIFY)
    lengths = tuple(sorted(w for w in set(lengths) if w <= W))
    config = family_of(model).text_config(model)
    if isinstance(prompts, (str, os.PathLike)):
        tok = load_tokenizer(tokenizer, target if isinstance(target, str) else None, config.vocab_size)
        calib, _ = split_prompts(load_prompts(prompts), seed=seed)
        inputs = [render(p, tok).to(dev) for p in calib]
    else:
        # token ids `[1, n]` chosen by the caller (e.g. `hybridspec bench`), used as they are
        calib = list(prompts)
        inputs = [p.to(dev) for p in calib]
    # a replay drafter replays the target's own greedy continuation of each prompt
    replay = is_replay(draft)
    continuations = [_greedy(model, ids, max_new_tokens) if replay else None
                     for ids in tqdm(inputs, desc="target continuations", disable=not replay)]
    runs = list(zip(inputs, continuations))

    capture = RoundRecorder(dev, config.num_experts)
    # the capture comes first: its rounds, cut short at the output limit, also compile every
    # verification shape, so that no timed round below pays a kernel compile
    generate_rounds(model, draft, runs, capture, max_new_tokens, W, desc=f"capture (w = {W})", accept=accept)
    data = capture_arrays(capture, W)
    acceptance = fit_acceptance(data["confidence"], data["entropy"], data["accepted"], data["valid"])

    # timed separately from the capture, whose routing records add host work to every round; the
    # first prompt only warms up
    timed = runs if timed_prompts is None else runs[: timed_prompts + 1]
    round_ms = {w: timed_round_ms(model, draft, timed, max_new_tokens, w, desc=f"timing (w = {w})", accept=accept)
                for w in sorted(set(lengths) | {W})}
    cost = fit_round_cost(list(round_ms), list(round_ms.values()), max_len=W)
    cost_noise = cost_fit_noise(cost.rms_residual_ms, list(round_ms.values()))

    stage0_ms = stage0_latency(model, inputs[0], range(1, W + 1))
    s_fit, _, s_r = fit_line(list(stage0_ms), list(stage0_ms.values()))
    k = config.num_experts_per_tok
    counts = sorted({min(config.num_experts, c) for c in np.linspace(k, min(config.num_experts, 16 * k), 8).astype(int)})
    expert_ms = expert_latency(model, counts)
    eta_fit, _, eta_r = fit_line(list(expert_ms), list(expert_ms.values()))
    # a slope below zero is timing noise on a flat (launch-bound) curve: no saving, no expert cost
    s, eta = max(s_fit, 0.0), max(eta_fit, 0.0)

    valid = data["full_valid"]
    nbar, nbar_given = routing_tables(data["distinct_all"][valid], data["new_layer0"][valid], top_k=k)

    conf = torch.as_tensor(data["confidence"][data["valid"]])
    ent = torch.as_tensor(data["entropy"][data["valid"]])
    accepted = torch.as_tensor(data["accepted"][data["valid"]])
    prefix = prefix_probabilities(acceptance.predict(conf, ent))  # [R, D]
    gains = expected_tokens(prefix)[:, :W]
    # tokens[r, w - 1] = min(A, w - 1) + 1: what round r emits at length w
    tokens = torch.minimum(accepted[:, None], torch.arange(W)[None]) + 1
    rho = dinkelbach_rho(gains.numpy(), cost.cost, cost.fixed_ms)
    static = best_static_length(tokens.numpy(), cost.cost, cost.fixed_ms)
    mean_w = float(LengthPolicy(cost=cost.cost, rho=rho).select(acceptance.predict(conf, ent), W).float().mean()) \
        if len(conf) else None

    batches = tuple(
        calibrate_batch(model, draft, runs, B, W, gains.numpy(), tokens.numpy(), data["layer0_ids"], eta,
                        config.num_experts, max_new_tokens, timed_prompts, accept)
        for B in sorted(set(batch_sizes) - {1}))

    result = Calibration(
        schema_version=SCHEMA_VERSION, target_fingerprint=target_fingerprint(model),
        drafter_fingerprint=drafter_fingerprint(draft), device_name=current_device_name(dev), versions=runtime_versions(),
        block_size=W, acceptance=acceptance, cost=cost.cost, fixed_ms=cost.fixed_ms, stage0_slope_ms=s,
        eta_ms=eta, top_k=k, nbar=nbar, nbar_given=nbar_given, rho=rho, static_length=static, batches=batches,
        summary=dict(
            prompts=len(calib), rounds=len(data["accepted"]), valid_rounds=int(data["valid"].sum()),
            mean_acceptance_length=float(np.mean(data["accepted"][data["valid"]]) + 1) if data["valid"].any() else None,
            round_ms=_keyed(round_ms), stage0_ms=_keyed(stage0_ms), stage0_slope_fit=s_fit, stage0_r=s_r, expert_ms=_keyed(expert_ms),
            eta_fit=eta_fit, eta_r=eta_r, **cost_noise,
            mean_predicted_w=mean_w, max_new_tokens=max_new_tokens, seed=seed, timed_prompts=max(1, len(timed) - 1),
            drafter=drafter if isinstance(drafter, str) else type(drafter).__name__,
            cpu_threads=torch.get_num_threads() if dev.type == "cpu" else None,
            accept_rule=None if accept is None else type(accept).__name__,
            # the acceptance model and rho were fitted on simulated rounds (replay drafter or forced rule)
            simulated=is_replay(draft) or accept is not None,
            **drafter_identity(draft),
        ),
    )
    result.save(out)
    _print_summary(result)
    return result


def _keyed(table: dict) -> dict[str, float]:
    # JSON object keys are strings; lengths and expert counts are stored as their decimal text
    return {str(int(k)): float(v) for k, v in table.items()}


@torch.inference_mode()
def _greedy(model, ids, max_new_tokens):
    """The target's greedy continuation, computed by the runner that verification uses (on CUDA
    the captured graph), so that its numerics are those of the rounds the replay drafter serves."""
    from hybridspec.runner import Runner

    runner = Runner(model, capacity=ids.shape[1] + max_new_tokens)
    out, _ = runner.generate(ids, max_new_tokens, eos_token_id=model.generation_config.eos_token_id)
    return out[0, ids.shape[1]:]


def _print_summary(c: Calibration) -> None:
    s = c.summary
    print(f"calibration: {s['prompts']} prompts, {s['valid_rounds']} of {s['rounds']} capture rounds used")
    print(f"rho = {c.rho:.4f} tokens/ms; fixed round cost {c.fixed_ms:.3f} ms; best static length {c.static_length}")
    print("C_tgt(w) ms: " + " ".join(f"{w}:{t:.3f}" for w, t in enumerate(c.cost, start=1)))
    print(f"s = {c.stage0_slope_ms:.4f} ms/token (r = {s['stage0_r']:.3f}); "
          f"eta = {c.eta_ms:.4f} ms/expert (r = {s['eta_r']:.3f})")
    if s["mean_predicted_w"] is not None:
        print(f"mean predicted w on the calibration rounds = {s['mean_predicted_w']:.2f}")
    measured = " ".join(f"{w}:{t:.3f}" for w, t in sorted(s["round_ms"].items(), key=lambda kv: int(kv[0])))
    print(f"measured round ms: {measured}; cost fit RMS residual {s['cost_rms_residual_ms']:.3f} ms "
          f"({s['cost_relative_residual']:.0%} of the mean round time)")
    for b in c.batches:
        print(f"B = {b.batch_size}: rho = {b.rho:.4f} tokens/ms; round ms " +
              " ".join(f"{w}:{t:.3f}" for w, t in zip(b.lengths, b.cost)) + f"; best static length {b.static_length}")
    if s["noisy"]:
        print(f"WARNING: the cost fit is noisy: {s['noisy_reason']}. The cost curve, rho and the lengths the "
              "policy picks rest on it; rerun on an idle machine (or with more --max-new-tokens / --timed-prompts).")


def main(args) -> None:
    """`hybridspec calibrate` (arguments: `hybridspec.cli`)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    calibrate(target=args.target, drafter=args.drafter, prompts=args.prompts, out=args.out, tokenizer=args.tokenizer,
              max_new_tokens=args.max_new_tokens, device=device, lengths=args.lengths, seed=args.seed,
              timed_prompts=args.timed_prompts, batch_sizes=tuple(args.batch_sizes))
