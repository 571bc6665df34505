"""`hybridspec bench`: the end-to-end table, every method side by side in one run.

Rows, on the same prompts and output lengths: autoregressive decoding on our runner; transformers'
`generate(cache_implementation="static")` (its compiled AR; CUDA only, compile warm-up excluded);
vanilla DFlash (w = 16); the calibrated static length; HybridSpec nominal-only; HybridSpec full;
D-Cut; EVICT. With a replay drafter (`--replay`, the default for `--shape` and `--tiny`) the
acceptance is simulated (DESIGN.md section 5) and every figure says so.

The calibration (`--calibration FILE`, or run here on prompts of their own and another seed) and
the evaluation use different draws. Throughput is decode tokens per second after the first token
(prefill excluded), summed over the prompts.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch

METHODS = (
    ("AR (ours)", None),
    ("transformers static AR", None),
    ("vanilla DFlash (w=16)", dict(verify_length=16)),
    ("static (calibrated)", dict(policy="static")),
    ("HybridSpec nominal", dict(policy="nominal")),
    ("HybridSpec", dict(policy="hybridspec")),
    ("D-Cut", dict(policy="dcut")),
    ("EVICT", dict(policy="evict")),
)
# a continuation whose distinct-token ratio is below this is reported as looping
LOOP_RATIO = 0.2


def _models(args, device):
    from hybridspec.sim.replay import DeviceReplayDrafter
    from hybridspec.loading import load_drafter, load_target
    from hybridspec.shapes import build_drafter, build_target
    from hybridspec.tiny import tiny_drafter, tiny_target

    if args.tiny:
        model, drafter = tiny_target().to(device), tiny_drafter().to(device)
        what = "tiny random Qwen3.5-MoE + DFlash"
    elif args.shape:
        model, drafter = build_target(args.shape, device), None
        what = f"{args.shape} shape, random bf16 weights"
    else:
        model, drafter = load_target(args.target, device), None
        what = args.target
    if args.drafter:
        drafter = load_drafter(args.drafter, device)
    elif drafter is None:
        if not args.shape:
            raise SystemExit("--target needs --drafter DIR")
        drafter = build_drafter(args.shape, device)
    replay = args.replay or args.tiny or bool(args.shape)
    if replay and not isinstance(drafter, DeviceReplayDrafter):
        # random bf16 weights do not reproduce their own greedy continuation under another block
        # split (near-tied routing and logits), so a full-size shape forces the replayed acceptance
        drafter = DeviceReplayDrafter(drafter, torch.zeros(0, dtype=torch.long))
    drafter.bind(model)
    forced = None
    if replay and args.shape and not args.unforced:
        from hybridspec.sim.forced import ForcedAcceptance

        forced = ForcedAcceptance(drafter)
    return model, drafter, replay, forced, what


def _prompts(args, model, device, n: int, seed: int):
    """`n` evaluation and `n` calibration prompts, token ids `[1, P]`."""
    vocab = model.config.get_text_config().vocab_size
    if args.prompts:
        from hybridspec.calibration.prompts import load_prompts, load_tokenizer, render, split_prompts

        tok = load_tokenizer(args.tokenizer, args.target, vocab)
        calib, held = split_prompts(load_prompts(args.prompts), seed=seed)
        if not held:
            raise SystemExit(f"{args.prompts} needs at least 2 prompts (a calibration and an evaluation half)")
        return [render(p, tok).to(device) for p in held[:n]], [render(p, tok).to(device) for p in calib[:n]]
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randint(0, vocab, (1, args.prompt_tokens), generator=g).to(device)  # noqa: E731
    return [make() for _ in range(n)], [make() for _ in range(n)]


def _ar(model, prompts, new, eos):
    """Our runner's AR: continuations and decode seconds per prompt."""
    from hybridspec.runner import Runner

    runner = Runner(model, capacity=max(p.shape[1] for p in prompts) + new)
    runner.generate(prompts[0], min(8, new), eos_token_id=eos)
    outs, seconds = [], []
    for p in prompts:
        out, stats = runner.generate(p, new, eos_token_id=eos)
        outs.append(out[0, p.shape[1]:])
        seconds.append(stats.decode_seconds)
    del runner
    return outs, seconds


class _Stamps:
    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def transformers_static(model, prompts, new):
    """transformers' compiled static AR: decode seconds per prompt (streamer spacing after the
    first token) and the compile warm-up in seconds."""
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                  eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    model.generate(prompts[0], **kwargs)
    warmup = time.perf_counter() - t0
    seconds, outs = [], []
    for p in prompts:
        stamps = _Stamps()
        out = model.generate(p, streamer=stamps, **kwargs)
        outs.append(out[0, p.shape[1]:])
        # stamps: [prompt, token 1, ..., token n]
        seconds.append(stamps.times[-1] - stamps.times[1])
    return outs, seconds, warmup


def _row(name, outs, seconds, ar_outs, ar_seconds, stats=None, forced=False):
    tokens = sum(len(o) - 1 for o in outs)
    tps = tokens / sum(seconds)
    ar_tps = sum(len(o) - 1 for o in ar_outs) / sum(ar_seconds)
    same = [torch.equal(o.cpu(), a.cpu()) for o, a in zip(outs, ar_outs)]
    agree = [float((o.cpu()[: len(a)] == a.cpu()[: len(o)]).float().mean()) for o, a in zip(outs, ar_outs)]
    ratio = [len(set(o.tolist())) / max(1, len(o)) for o in outs]
    row = dict(method=name, tokens_per_s=tps, speedup_vs_ar=tps / ar_tps,
               exact_match_rate=None if forced else float(np.mean(same)),
               token_agreement=float(np.mean(agree)), distinct_token_ratio=float(np.mean(ratio)))
    if stats:
        rounds = sum(s.rounds for s in stats)
        row.update(
            mean_acceptance_length=sum(sum(a + 1 for a in s.accepted) for s in stats) / rounds,
            ms_per_round=sum(s.decode_seconds for s in stats) * 1e3 / rounds,
            mean_w=float(np.mean([w for s in stats for w in s.verify_lengths])),
            layer0_experts_per_round=float(np.mean([e for s in stats for e in s.layer0_experts if e >= 0] or [float("nan")])),
        )
    return row


def _memory(model, drafter) -> dict:
    """Bytes the verification state needs beyond the committed state, vs the stock verifier's
    per-token states (16 rows x GDN layers x HV x K x V x 4 B per request slot)."""
    from hybridspec.patches import family_of
    from hybridspec.patches.forward import empty_state

    family = family_of(model)
    cfg = family.text_config(model)
    state = empty_state(family, model, 1, 1, "meta")
    ours = sum(t.numel() * t.element_size() for t in (*state.factors, state.conv_inputs))
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    stock = drafter.block_size * gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return dict(ours_bytes=ours, stock_per_token_state_bytes=stock, ratio=stock / ours)


def _plots(out: Path, rows, calibration, label: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["method"] for r in rows]
    ax.barh(names, [r["speedup_vs_ar"] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="gray", lw=1)
    ax.set_xlabel("speedup vs our AR (tokens/s ratio)")
    ax.set_title(f"hybridspec bench: {label}", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    files.append(str(out / "speedup.png"))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    ws = np.arange(1, len(calibration.cost) + 1)
    ax.plot(ws, calibration.fixed_ms + np.asarray(calibration.cost), "o-", label="round time (calibrated) ms")
    ax.set_xlabel("verified tokens w")
    ax.set_ylabel("ms")
    twin = ax.twinx()
    twin.plot(ws, calibration.nbar[: len(ws)], "s--", color="tab:orange", label="distinct (layer, expert) pairs")
    twin.set_ylabel("distinct (layer, expert) pairs")
    fig.legend(loc="upper left", fontsize=8)
    ax.set_title("cost curve C(w) and distinct experts", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "cost_curve.png", dpi=120)
    files.append(str(out / "cost_curve.png"))
    plt.close(fig)
    return files


def run(args) -> dict:
    import hybridspec
    from hybridspec.calibration import Calibration
    from hybridspec.calibration.artifact import runtime_versions
    from hybridspec.calibration.run import calibrate

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, drafter, replay, forced, what = _models(args, device)
    hybridspec.enable(model)
    print(f"models: {what} ({time.perf_counter() - t0:.0f} s)")
    eval_prompts, calib_prompts = _prompts(args, model, device, args.num_prompts, args.seed)
    new = args.max_new_tokens
    eos = None if replay else model.generation_config.eos_token_id
    ar_outs, ar_seconds = _ar(model, eval_prompts, new, eos)
    label = "simulated acceptance (replay drafter)" if replay else "real drafter"
    if forced is not None:
        label += ", forced: accept lengths from the replay draws, tokens from the AR continuation"

    if args.calibration:
        calibration = Calibration.load(args.calibration)
    else:
        print("calibrating (on prompts of their own, seed", args.seed + 1, ")")
        calibration = calibrate(model, drafter, calib_prompts, str(out / "calibration.json"),
                                max_new_tokens=args.calibration_tokens, device=str(device), seed=args.seed + 1)

    rows = [_row("AR (ours)", ar_outs, ar_seconds, ar_outs, ar_seconds)]
    if device.type == "cuda" and not args.skip_transformers:
        hf_outs, hf_seconds, warmup = transformers_static(model, eval_prompts, new)
        rows.append(_row("transformers static AR", hf_outs, hf_seconds, ar_outs, ar_seconds))
        rows[-1]["compile_warmup_s"] = warmup
    methods = list(METHODS[2:])
    if forced is not None:
        # the same policy with the target's own acceptance: what exactness looks like on these weights
        methods.append(("HybridSpec, target acceptance", dict(policy="hybridspec", forced=False)))
    for name, kwargs in methods:
        rule = forced if kwargs.pop("forced", True) else None
        if rule is not None:
            kwargs = dict(kwargs, hybridspec_accept=rule)
        if "policy" in kwargs:
            kwargs = dict(kwargs, calibration=calibration)
        outs, seconds, stats = [], [], []
        for i, (p, cont) in enumerate(zip(eval_prompts, ar_outs)):
            if replay:
                drafter.continuation = cont
            # the evaluation's draws: one seed per prompt, the same for every method
            torch.manual_seed(args.seed * 1000 + i)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = model.generate(p, assistant_model=drafter, hybridspec=True, max_new_tokens=new, do_sample=False,
                                     eos_token_id=eos, return_dict_in_generate=True, **kwargs)
            outs.append(res.sequences[0, p.shape[1]:])
            seconds.append(res.hybridspec_stats.decode_seconds)
            stats.append(res.hybridspec_stats)
        rows.append(_row(name, outs, seconds, ar_outs, ar_seconds, stats, rule is not None))
        print(f"  {name}: {rows[-1]['tokens_per_s']:.1f} tokens/s")

    result = dict(
        forced_acceptance=forced is not None,
        label=label, models=what, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        versions=runtime_versions(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        prompts=len(eval_prompts), prompt_tokens=[p.shape[1] for p in eval_prompts], max_new_tokens=new,
        rows=rows, memory=_memory(model, drafter), calibration_summary=calibration.summary,
        looping=[r["method"] for r in rows if r["distinct_token_ratio"] < LOOP_RATIO],
    )
    _print(result)
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=float))
    result["plots"] = _plots(out, rows, calibration, label)
    print(f"wrote {out / 'bench.json'} and {', '.join(result['plots'])}")
    return result


def _print(result: dict) -> None:
    cols = ("method", "tokens_per_s", "speedup_vs_ar", "mean_acceptance_length", "ms_per_round", "mean_w",
            "exact_match_rate", "layer0_experts_per_round", "distinct_token_ratio")
    heads = ("method", "tok/s", "vs AR", "accept len", "ms/round", "mean w", "exact vs AR", "L0 experts", "distinct tok")
    cells = [heads] + [[_fmt(r.get(c)) for c in cols] for r in result["rows"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    print(f"\nhybridspec bench, {result['label']}: {result['models']} on {result['device']}, "
          f"{result['prompts']} prompts x {result['max_new_tokens']} new tokens")
    for i, row in enumerate(cells):
        print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    m = result["memory"]
    print(f"verification state: {m['ours_bytes'] / 1e6:.3g} MB vs the stock per-token states "
          f"{m['stock_per_token_state_bytes'] / 1e6:.4g} MB per request slot ({m['ratio']:.0f}x)")
    if result["looping"]:
        print(f"note: random-weight continuations loop (distinct-token ratio < {LOOP_RATIO}) for: "
              + ", ".join(result["looping"]))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)

