"""`hybridspec bench`: the end-to-end table, every method side by side in one run.

Rows, on the same prompts and output lengths: autoregressive decoding on our runner (batched with
`--batch-size 2|4`: left-padded batches, tokens/s the total over the batch, and only the methods
batched rounds support: vanilla DFlash, static, HybridSpec); transformers'
`generate(cache_implementation="static")` (its compiled AR; CUDA only, compile warm-up excluded);
vanilla DFlash (w = 16); the calibrated static length; HybridSpec nominal-only; HybridSpec full;
D-Cut; EVICT. With a replay drafter (`--replay`, the default for `--shape` and `--tiny`) the
acceptance is simulated (DESIGN.md section 5): every such row, the JSON and the plots say so.
`--methods` keeps only the speculative rows it names (`METHOD_KEYS`; AR always runs), and the others
are listed as left out; without a length-policy row the run skips the calibration.

The calibration (`--calibration FILE`, or run here on prompts of their own and another seed) and
the evaluation use different draws. Throughput is decode tokens per second after the first token
(prefill excluded), summed over the prompts. Every row, the baselines included, is timed
`--repeats` times, the repeats interleaved across rows so that a burst of load on the machine
falls on every row alike; the table reports the median and the spread, and flags a row whose
spread, or whose calibration's cost fit, makes its ratio to AR meaningless (`noise_reasons`).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hybridspec.bench_report import COLUMNS, LOOP_RATIO, NOISY_SPREAD, calibration_noise, noise_reasons, print_table, spread
from hybridspec.calibration.batched import left_padded
from hybridspec.generation.options import BATCH_POLICIES
from hybridspec.ops import linear as linear_ops
from hybridspec.round.stats import device_time

METHODS = (
    ("vanilla DFlash (w=16)", dict(verify_length=16)),
    ("static (calibrated)", dict(policy="static")),
    ("HybridSpec nominal", dict(policy="nominal")),
    ("HybridSpec", dict(policy="hybridspec")),
    ("D-Cut", dict(policy="dcut")),
    ("EVICT", dict(policy="evict")),
)
AR, HF = "AR (ours)", "transformers static AR"
TARGET_ACCEPTANCE = "HybridSpec, target acceptance"
# `--methods` names the speculative rows to run by these keys (AR always runs: every row is a ratio to it)
METHOD_KEYS = {"vanilla": METHODS[0][0], "static": METHODS[1][0], "nominal": METHODS[2][0],
               "hybridspec": METHODS[3][0], "dcut": METHODS[4][0], "evict": METHODS[5][0],
               "target-acceptance": TARGET_ACCEPTANCE}


def selected_methods(text: str | None) -> set[str]:
    """`--methods vanilla,hybridspec` -> the row names to run (every speculative row where `text` is
    None); an unknown or empty key stops the run before anything is built, naming the keys."""
    if text is None:
        return set(METHOD_KEYS.values())
    keys = [k.strip() for k in text.split(",")]
    unknown = [k for k in keys if k not in METHOD_KEYS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {', '.join(METHOD_KEYS)} "
                         "(comma-separated; AR (ours) always runs)")
    return {METHOD_KEYS[k] for k in keys}


# run sizes where the command line gives none: --tiny must finish in about a minute on 2 CPU cores
SIZES = {
    "tiny": dict(num_prompts=3, prompt_tokens=32, max_new_tokens=64, calibration_tokens=32),
    "full": dict(num_prompts=4, prompt_tokens=512, max_new_tokens=256, calibration_tokens=64),
}
def _models(args, device):
    from hybridspec.loading import load_target
    from hybridspec.sim.spec import load_drafter_spec
    from hybridspec.shapes import build_drafter, build_target
    from hybridspec.sim.replay import DeviceReplayDrafter
    from hybridspec.tiny import tiny_drafter, tiny_target

    if args.tiny:
        model, drafter = tiny_target().to(device), tiny_drafter().to(device)
        what = "tiny random Qwen3.5-MoE + DFlash (4 layers, hidden 64)"
    elif args.shape:
        model, drafter = build_target(args.shape, device), None
        what = f"{args.shape} shape, random bf16 weights"
    else:
        model, drafter = load_target(args.target, device), None
        what = args.target
    if args.drafter:
        drafter = load_drafter_spec(args.drafter, device)
    elif drafter is None:
        if not args.shape:
            raise SystemExit("--target needs --drafter DIR")
        drafter = build_drafter(args.shape, device)
    replay = args.replay or args.tiny or bool(args.shape) or bool(args.traces)
    if replay and not isinstance(drafter, DeviceReplayDrafter):
        # random bf16 weights do not reproduce their own greedy continuation under another block
        # split (near-tied routing and logits), so a full-size shape forces the replayed acceptance
        drafter = DeviceReplayDrafter(drafter, torch.zeros(0, dtype=torch.long))
    if args.traces:
        from hybridspec.sim.traces import Trace, TraceAcceptance

        # a real pair's recorded rounds instead of the synthetic Beta model
        drafter.acceptance = TraceAcceptance(Trace.load(args.traces))
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


class _Stamps:
    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


class StaticAR:
    """transformers' compiled static AR (`generate(cache_implementation="static")`). Constructing it
    compiles (the warm-up, `warmup_s`); each `timed_pass` decodes every prompt and returns the decode
    seconds per prompt (streamer spacing after the first token); `outs` holds the last continuations."""

    def __init__(self, model, prompts, new):
        self.model, self.prompts = model, prompts
        self.kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                           eos_token_id=None, pad_token_id=0)
        self.outs = []
        t0 = time.perf_counter()
        model.generate(prompts[0], **self.kwargs)
        self.warmup_s = time.perf_counter() - t0

    def timed_pass(self) -> list[float]:
        seconds, self.outs, self.ttft = [], [], []
        for p in self.prompts:
            stamps = _Stamps()
            called = device_time(p.device)
            out = self.model.generate(p, streamer=stamps, **self.kwargs)
            self.outs.append(out[0, p.shape[1]:])
            # stamps: [prompt, token 1, ..., token n]
            seconds.append(stamps.times[-1] - stamps.times[1])
            self.ttft.append(stamps.times[1] - called)
        return seconds

    def __call__(self):
        """A row's pass: (continuations, seconds per prompt, no statistics, seconds to the first token
        per prompt: from the `generate` call, its preparation included)."""
        seconds = self.timed_pass()
        return self.outs, seconds, None, self.ttft


def transformers_static(model, prompts, new):
    """One timed pass of transformers' compiled static AR: continuations, decode seconds per prompt,
    and the compile warm-up in seconds."""
    static = StaticAR(model, prompts, new)
    seconds = static.timed_pass()
    return static.outs, seconds, static.warmup_s


class _Passes:
    """One timed pass over the prompts per call, for each kind of row. With `batch_size` B > 1 the
    prompts go in left-padded batches of B (`batches`), each decoded as one batched call; the
    continuations are per row (B per batch) and the seconds per batch."""

    def __init__(self, model, drafter, prompts, new, eos, seed, replay, batch_size: int = 1):
        self.model, self.drafter, self.prompts, self.new, self.eos = model, drafter, prompts, new, eos
        self.seed, self.replay, self.batch_size = seed, replay, batch_size
        self.batches = batched(prompts, batch_size)
        self.ar_outs = None
        self.runner = None

    def ar(self):
        """Our runner's AR (batched at B > 1): continuations per row, decode seconds per batch, no
        statistics, and seconds to the first token per batch (prefill and the first token's read)."""
        from hybridspec.round.stopping import HostStopping
        from hybridspec.runner import Runner

        if self.runner is None:
            self.runner = Runner(self.model, capacity=max(ids.shape[1] for ids, _ in self.batches) + self.new,
                                 batch_size=self.batch_size)
        eos = set(torch.as_tensor(self.eos).flatten().tolist()) if self.eos is not None else set()
        outs, seconds, ttft = [], [], []
        for n, (ids, mask) in enumerate([self.batches[0]] + self.batches):
            P = ids.shape[1]
            new = min(8, self.new) if n == 0 else self.new
            first_tokens, prefill = self.runner.start_timed(ids, None, mask, None if mask is None else _positions(mask))
            rows, stats = self.runner.decode_batch(P, first_tokens, HostStopping(P + new, eos, []))
            if n > 0:
                outs.extend(torch.tensor(r, device=ids.device) for r in rows)
                seconds.append(stats.decode_seconds)
                ttft.append(prefill)
        return outs, seconds, None, ttft

    def speculative(self, kwargs):
        """One method's continuations (per row), decode seconds, statistics and seconds to the first
        token (`HybridSpecStats.prefill_seconds`) per batch, after a short warm-up call (the method's runner is captured, on CUDA, outside the timed calls)."""
        outs, seconds, stats = [], [], []
        self._generate(0, dict(kwargs, max_new_tokens=min(8, self.new)))
        for i, (ids, _) in enumerate(self.batches):
            res = self._generate(i, dict(kwargs, max_new_tokens=self.new))
            # a finished row's tail is padding: its own tokens end at its EOS, where AR's rows end
            outs.extend(_until_eos(row, self.eos) for row in res.sequences[:, ids.shape[1]:].unbind(0))
            seconds.append(res.hybridspec_stats.decode_seconds)
            stats.append(res.hybridspec_stats)
        return outs, seconds, stats, [s.prefill_seconds for s in stats]

    def _generate(self, i, kwargs):
        ids, mask = self.batches[i]
        B = self.batch_size
        if self.replay:
            rows = self.ar_outs[i * B: (i + 1) * B]
            self.drafter.continuation = rows[0] if B == 1 else torch.stack(rows)
        # the evaluation's draws: one seed per batch, the same for every method and repeat
        torch.manual_seed(self.seed * 1000 + i)
        # warnings (runner fallbacks, calibration mismatches) are left to show: none is expected here
        extra = {} if mask is None else dict(attention_mask=mask, pad_token_id=0)
        return self.model.generate(ids, assistant_model=self.drafter, hybridspec=True, do_sample=False,
                                   eos_token_id=self.eos, return_dict_in_generate=True, **extra, **kwargs)


def batched(prompts, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """`[1, P_i]` prompts -> batches `([B, P], attention_mask or None)`, left-padded with 0 where the
    lengths differ (a last partial batch is dropped)."""
    out = []
    for i in range(0, len(prompts) - batch_size + 1, batch_size):
        group = prompts[i: i + batch_size]
        if all(p.shape[1] == group[0].shape[1] for p in group):
            out.append((torch.cat(group), None))
        else:
            out.append(left_padded(group, 0))
    return out


def _until_eos(row: torch.Tensor, eos) -> torch.Tensor:
    """A continuation up to and with its first EOS token (the whole row without one)."""
    if eos is None:
        return row
    hits = torch.isin(row, torch.as_tensor(eos, device=row.device).flatten()).nonzero()
    return row if len(hits) == 0 else row[: int(hits[0, 0]) + 1]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """transformers' `position_ids` for a left-padded text batch (`cumsum(mask) - 1`, 0 on padding)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _row(name, outs, seconds, ar, stats=None, forced=False, simulated=False, calibration_noise=None, batch_size=1,
         ttft=None):
    """`seconds`: per repeat, decode seconds per prompt (per batch at B > 1: tokens/s is then the
    total over the batch's rows); `ar`: the AR row (None for AR itself); `ttft`: seconds to the
    first token of every call (prompt or batch) over the repeats."""
    tokens = sum(len(o) - 1 for o in outs)
    rates = [tokens / sum(s) for s in seconds]
    ar_rates = rates if ar is None else ar["tokens_per_s_repeats"]
    ar_outs = outs if ar is None else ar["outs"]
    ratios = [r / a for r, a in zip(rates, ar_rates)]
    same = [torch.equal(o.cpu(), a.cpu()) for o, a in zip(outs, ar_outs)]
    agree = [float((o.cpu()[: len(a)] == a.cpu()[: len(o)]).float().mean()) for o, a in zip(outs, ar_outs)]
    distinct = [len(set(o.tolist())) / max(1, len(o)) for o in outs]
    reasons = noise_reasons(rates, None if ar is None else ar_rates, calibration_noise)
    row = dict(
        method=name, batch_size=batch_size, simulated=simulated, tokens_per_s=statistics.median(rates), tokens_per_s_repeats=rates,
        spread=spread(rates), speedup_vs_ar=statistics.median(ratios), speedup_vs_ar_range=[min(ratios), max(ratios)],
        # forced acceptance emits the AR continuation: agreement would be 1 by construction
        exact_match_rate=None if forced else float(np.mean(same)),
        token_agreement=None if forced else float(np.mean(agree)),
        distinct_token_ratio=float(np.mean(distinct)), noisy=bool(reasons), noise_reasons=reasons,
        ttft_ms=statistics.median(ttft) * 1e3 if ttft else None,
    )
    if forced:
        row["exactness"] = "not applicable: forced acceptance emits the AR continuation by construction"
    if stats:
        rounds = sum(s.rounds for s in stats)
        median_repeat = sorted(range(len(seconds)), key=lambda r: sum(seconds[r]))[len(seconds) // 2]
        row.update(
            # per row and round: at B > 1 `accepted` holds one entry per running row per round
            mean_acceptance_length=sum(sum(a + 1 for a in s.accepted) for s in stats) / sum(len(s.accepted) for s in stats),
            ms_per_round=sum(seconds[median_repeat]) * 1e3 / rounds,
            mean_w=float(np.mean([w for s in stats for w in s.verify_lengths])),
            layer0_experts_per_round=float(np.mean([e for s in stats for e in s.layer0_experts if e >= 0] or [float("nan")])),
        )
    return row


def _memory(model, drafter, batch_size: int = 1) -> dict:
    """Bytes the verification state needs beyond the committed state, vs the stock verifier's
    per-token states (16 rows x GDN layers x HV x K x V x 4 B per request slot): per request, and
    for the batch (B request slots)."""
    from hybridspec.patches import family_of
    from hybridspec.patches.forward import empty_state

    family = family_of(model)
    cfg = family.text_config(model)
    state = empty_state(family, model, batch_size, 1, "meta")
    ours = sum(t.numel() * t.element_size() for t in (*state.factors, state.conv_inputs)) // batch_size
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    stock = drafter.block_size * gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return dict(ours_bytes=ours, stock_per_token_state_bytes=stock, ratio=stock / ours, batch_size=batch_size,
                batch_ours_bytes=ours * batch_size, batch_stock_per_token_state_bytes=stock * batch_size)


def _acceptance(replay: bool, forced, traces: str | None = None) -> dict:
    draws = (f"the recorded rounds of a real pair ({traces}: its drafter's confidence and acceptance, replayed in "
             "order)" if traces else "the synthetic Beta(5, 2) acceptance model")
    source = dict(draws="traces" if traces else "synthetic", traces=traces)
    if forced is not None:
        return dict(model="forced", simulated=True, **source,
                    label=f"simulated acceptance (forced, {'traces' if traces else 'synthetic'})",
                    description="simulated: forced acceptance (hybridspec.sim.forced): each round keeps as many drafts "
                                f"as the replay drafter's draws made correct, draws from {draws}, and emits the AR "
                                "continuation; the target verifies every drafted token, but no exactness holds")
    if replay:
        return dict(model="replay", simulated=True, **source,
                    label=f"simulated acceptance (replay drafter, {'traces' if traces else 'synthetic'})",
                    description="simulated: replay drafter (hybridspec.sim.replay): the target's own greedy "
                                f"continuation with mistakes from {draws}, at the real drafter's cost; the target's "
                                "own argmax accepts")
    return dict(model="real", simulated=False, label="real acceptance (the drafter's own drafts)",
                description="real: the drafter's own drafts, accepted by the target")


def resolve_sizes(args) -> None:
    """Fill the run sizes the command line left open (`SIZES`)."""
    for name, value in SIZES["tiny" if args.tiny else "full"].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


# `hybridspec bench` options that set a `LinearKernelConfig` field for the run
SPLIT_OPTIONS = ("out_split_k", "router_split_k", "in_split_k")


def run(args) -> dict:
    """The bench (arguments: `hybridspec.cli`); with `--out-split-k` / `--router-split-k` /
    `--in-split-k`, under that many splits of the output projections / the MoE router GEMMs / the
    mixers' input projections (`LinearKernelConfig`), set before anything compiles and restored
    after."""
    changes = {name: getattr(args, name) for name in SPLIT_OPTIONS if getattr(args, name, None) is not None}
    if not changes:
        return _run(args)
    saved = linear_ops.KERNEL_CONFIG
    linear_ops.KERNEL_CONFIG = replace(saved, **changes)
    try:
        return _run(args)
    finally:
        linear_ops.KERNEL_CONFIG = saved


def _run(args) -> dict:
    import hybridspec
    from hybridspec.calibration import Calibration
    from hybridspec.calibration.artifact import runtime_versions
    from hybridspec.calibration.run import calibrate
    from hybridspec.bench_plots import write_plots

    resolve_sizes(args)
    chosen = selected_methods(getattr(args, "methods", None))
    repeats = getattr(args, "repeats", 3)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # tiny models on a few cores: threads cost more than they save, and they contend with
        # scikit-learn's OpenMP runtime once calibration has fitted (timings then swing 10-100x)
        torch.set_num_threads(getattr(args, "cpu_threads", 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, drafter, replay, forced, what = _models(args, device)
    hybridspec.enable(model)
    print(f"models: {what} ({time.perf_counter() - t0:.0f} s)")
    B = getattr(args, "batch_size", 1) or 1
    # --num-prompts counts batches: B prompts each
    eval_prompts, calib_prompts = _prompts(args, model, device, args.num_prompts * B, args.seed)
    new = args.max_new_tokens
    eos = None if replay else model.generation_config.eos_token_id
    passes = _Passes(model, drafter, eval_prompts, new, eos, args.seed, replay, B)
    # the first AR pass gives the continuations the replay drafter replays and every row is compared to
    ar_first = passes.ar()
    passes.ar_outs = ar_first[0]
    acceptance = _acceptance(replay, forced, args.traces)

    methods = [(name, kw) for name, kw in METHODS if name in chosen]
    absent = {name: "left out by --methods" for name, _ in METHODS if name not in chosen}
    if B > 1:
        # batched rounds share one length: a fixed length, "static" or "hybridspec"
        absent.update({name: f"not supported at batch size {B} (batched rounds: fixed length, static, HybridSpec)"
                       for name, kw in methods if kw.get("policy") not in (None, *BATCH_POLICIES)})
        methods = [(name, kw) for name, kw in methods if name not in absent]
    if forced is not None and TARGET_ACCEPTANCE in chosen:
        # the same policy with the target's own acceptance: what exactness looks like on these weights
        methods.append((TARGET_ACCEPTANCE, dict(policy="hybridspec", forced=False)))
    elif forced is not None:
        absent[TARGET_ACCEPTANCE] = "left out by --methods"

    # only the length policies read a calibration: a run of fixed-length rows alone needs none
    if not any(kw.get("policy") for _, kw in methods):
        calibration = None
        if args.calibration:
            print(f"--calibration {args.calibration} is not read: no length-policy row runs (--methods)")
    elif args.calibration:
        calibration = Calibration.load(args.calibration)
    else:
        print("calibrating (on prompts of their own, seed", args.seed + 1, ")")
        calibration = calibrate(model, drafter, calib_prompts, str(out / "calibration.json"),
                                max_new_tokens=args.calibration_tokens, device=str(device), seed=args.seed + 1,
                                accept=forced, batch_sizes=(1,) if B == 1 else (1, B))
    calib_noise = calibration_noise(calibration) if calibration is not None else None

    runs = {AR: passes.ar}
    if B > 1:
        absent[HF] = f"batched run (B = {B}): the transformers static AR row is measured at batch size 1"
    elif device.type != "cuda":
        absent[HF] = f"transformers' compiled static-cache AR runs on CUDA only; this run is on {device.type}"
    elif args.skip_transformers:
        absent[HF] = "left out by --skip-transformers"
    else:
        static = StaticAR(model, eval_prompts, new)
        runs[HF] = static
    meta = {}
    for name, kwargs in methods:
        kwargs = dict(kwargs)
        rule = forced if kwargs.pop("forced", True) else None
        if rule is not None:
            kwargs["hybridspec_accept"] = rule
        if "policy" in kwargs:
            kwargs["calibration"] = calibration
        runs[name] = lambda kwargs=kwargs: passes.speculative(kwargs)
        meta[name] = dict(forced=rule is not None, simulated=acceptance["simulated"],
                          calibration_noise=calib_noise if "policy" in kwargs else None)

    # repeats interleaved across rows: load on the machine lands on every row alike
    seconds = {name: [] for name in runs}
    ttft = {name: [] for name in runs}
    results = {}
    for r in range(repeats):
        for name, fn in runs.items():
            outs, secs, stats, first = fn()
            seconds[name].append(secs)
            ttft[name].extend(first)
            results[name] = (outs, stats)
        print(f"  repeat {r + 1}/{repeats} done ({time.perf_counter() - t0:.0f} s)")
    ar_row = _row(AR, results[AR][0], seconds[AR], None, batch_size=B, ttft=ttft[AR])
    ar_row["outs"] = results[AR][0]
    rows = [ar_row]
    if HF in runs:
        rows.append(_row(HF, results[HF][0], seconds[HF], ar_row, ttft=ttft[HF]))
        # with fla importable, transformers runs fla's GDN kernels in its AR; without it, its torch path
        rows[-1].update(compile_warmup_s=static.warmup_s, fla_importable=importlib.util.find_spec("fla") is not None)
    for name in meta:
        outs, stats = results[name]
        rows.append(_row(name, outs, seconds[name], ar_row, stats, batch_size=B, ttft=ttft[name], **meta[name]))
    del ar_row["outs"]

    result = dict(
        simulated=acceptance["simulated"], acceptance=acceptance, forced_acceptance=forced is not None,
        label=acceptance["label"],
        models=what, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        cpu_threads=torch.get_num_threads() if device.type == "cpu" else None,
        versions=runtime_versions(), fla_importable=importlib.util.find_spec("fla") is not None,
        out_split_k=linear_ops.KERNEL_CONFIG.out_split_k, router_split_k=linear_ops.KERNEL_CONFIG.router_split_k,
        in_split_k=linear_ops.KERNEL_CONFIG.in_split_k,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), repeats=repeats, noisy_spread=NOISY_SPREAD,
        batch_size=B, tokens_per_s_over="the batch (every row's tokens)" if B > 1 else "the request",
        prompts=len(eval_prompts), prompt_tokens=[p.shape[1] for p in eval_prompts], max_new_tokens=new,
        rows=rows, absent_rows=absent, columns={key: note for key, _, note in COLUMNS},
        noisy_rows=[r["method"] for r in rows if r["noisy"]], memory=_memory(model, drafter, B),
        calibration_summary=calibration.summary if calibration is not None else None, calibration_noisy=calib_noise,
        looping=[r["method"] for r in rows if r["distinct_token_ratio"] < LOOP_RATIO],
        seconds=time.perf_counter() - t0,
    )
    if device.type == "cpu":
        result["note"] = ("CPU run: tiny models are overhead-bound here, so these ratios say nothing about speedups "
                          "on a GPU; the accept lengths and exactness columns hold on any device")
    print_table(result)
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=float))
    result["plots"] = write_plots(out, result, calibration)
    print(f"wrote {out / 'bench.json'} and {', '.join(result['plots'])} ({time.perf_counter() - t0:.0f} s in all)")
    return result


def main(args) -> None:
    """`hybridspec bench` (arguments: `hybridspec.cli`)."""
    run(args)
