"""The CUDA-graph runner on the Qwen3.6-35B-A3B shape (random bf16 weights built on the GPU).

Side by side in one run:
1. Autoregressive decoding, ms/token over `--new` tokens after a `--prompt`-token prompt: our
   runner (w = 1, one captured graph per token) vs transformers' `generate(cache_implementation=
   "static")` (its compiled AR; the compile warm-up is excluded and reported). Per-token times are
   the spacing of a streamer's callbacks after the first token. Beside ours, the same steps as
   graph replays launched back to back (`replays_only_ms_per_token`, CUDA events): the host loop's
   per-token copy into the pinned ring, event and read between replays left out, so the difference
   is what that boundary costs.
2. Target verification latency C(w), w = 1..16, inside the runner's fixed 16-row graph (lengths on
   the device, decoder layers compiled as the runner compiles them) for 4 random blocks; the
   distinct (layer, expert) pairs the w tokens route to and the correlation of C(w) with them;
   the bytes bound of C(16).
3. Per-component split at w = 1, 4, 8, 16: the GDN mixers (30 layers), the attention mixers (10),
   the MoE blocks (40: router, routed experts, shared expert), each compiled and captured alone on
   real hidden states of the block, and the LM head + greedy accept over the 16 rows; "other" =
   C(w) minus the target's parts (norms, residuals, embedding); each part's time over its bytes
   bound (`component_bytes`: its weights once, each distinct expert once, the GDN states and the
   prompt's KV, at the measured copy bandwidth). Beside them, the drafter's round
   alone (its `propose` over the prompt's context: 16-position block, layers, fused LM-head top-1),
   which every speculative round adds to C(w), and Stage 0 (embedding, Layer-0 GDN and router over
   the 16 rows), as the round runs it (Layer 0 on the compiled `Blocks.layer0`, the embedding eager)
   and compiled whole, as the compiled front runs it. Per component, the kernels per
   layer at w = 1 and the costliest kernels (torch.profiler over one eager call of the compiled
   functions). Then the whole round at w = 1, 4, 8, 16 (the runner's captured round, replay
   drafter, fixed length) beside C(w) and the drafter: the rest is what a round adds to a compiled
   verification from the embedding (C(w), Layer 0 included) and the drafter: Stage 0, the length
   choice, correction, accept, commit and host time; and
   the same round with its front (length choice, Stage 0, correction) compiled as one region
   (`Runner(compile_front=True)`, off by default).
4. Host time per round of speculative decoding on the runner (CPU time between replays, not
   waiting), with the replay drafter (simulated acceptance) at w = 16.

    python benchmarks/bench_runner.py [--out bench_out/runner] [--prompt 512] [--new 256] [--skip-hf]
    python benchmarks/bench_runner.py --skip-hf --only-ar --inductor coordinate_descent_tuning=0   # an inductor setting's effect
    HYBRIDSPEC_PDL=0 python benchmarks/bench_runner.py ...   # without programmatic dependent launch
    python benchmarks/bench_runner.py --skip-hf --only-ar --linear block_n=32   # small_linear's tiles
    python benchmarks/bench_runner.py --skip-hf --only-ar --linear out_split_k=4   # split-K output projections
    python benchmarks/bench_runner.py --skip-hf --only-ar --ar-linear 'out_split_k=4;router_split_k=4'   # each in one process
    python benchmarks/bench_runner.py --skip-hf --only-ar --ar-moe 'gate_up_block_i=32;down_block_h=32'   # MoE tiles, likewise
    python benchmarks/bench_runner.py --skip-hf --only-ar --ar-gdn 'BV=64;num_warps=8'   # the GDN verify kernel's, likewise
    python benchmarks/bench_runner.py --skip-hf --only-ar --ar-attention 'fused=0'   # the attention prologue unfused
    python benchmarks/bench_runner.py --skip-hf --only-ar --no-fused-head   # the greedy argmax from the logits
    python benchmarks/bench_runner.py --skip-hf --only-round-kernels   # every kernel of one whole round, w = 1 and 16
    python benchmarks/bench_runner.py --split-batch 4   # the per-part split of a batched round (B = 4)
    python benchmarks/bench_runner.py --skip-hf --split-batch 4 --split-variants 'gdn:BV=64;moe:down_block_h=32'   # A/B, one process
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import capture, copy_bandwidth_gbs, env_info, GpuSampler, kernel_events, print_table, time_ms, write_json  # noqa: E402
from hybridspec.bench import transformers_static  # noqa: E402
from hybridspec.round import stages  # noqa: E402
from hybridspec.round.accept import greedy_accept_tokens  # noqa: E402
from hybridspec.round.prefill import prefill  # noqa: E402
from hybridspec.sim.replay import DeviceReplayDrafter  # noqa: E402
from hybridspec.round.stats import HybridSpecStats  # noqa: E402
from hybridspec.patches import family_of  # noqa: E402
from hybridspec.policy import FixedPolicy, default_policy  # noqa: E402
from hybridspec.round.stopping import HostStopping  # noqa: E402
from hybridspec.tiny import tiny_drafter, tiny_target  # noqa: E402
from hybridspec.ops.routing import distinct_prefix_counts  # noqa: E402
from hybridspec.patches.common import attention_verify, moe_verify  # noqa: E402
from hybridspec.cache import compiled_once  # noqa: E402
from hybridspec.ops.dispatch import layer_options  # noqa: E402
from hybridspec.patches.forward import EAGER, Blocks, load_prefill, stage0, verify_forward  # noqa: E402
from hybridspec.runner import Runner  # noqa: E402
from hybridspec.shapes import build_drafter, build_target  # noqa: E402

W = 16
# what this script's figures rest on (every result says whether its acceptance is simulated or real)
# every AR variant row carries its own label, so a row read alone says it
AR_ROW_ACCEPTANCE = "not applicable (AR step, no drafts)"
ACCEPTANCE = ("AR, C(w) and the split: not applicable (no drafts are accepted); spec_host and rounds: simulated "
              "(replay drafter on random weights, at w = 16, at each fixed length and under the built-in policy; "
              "the target's own acceptance of random drafts, about one token a round)")
SPLIT_AT = (1, 4, 8, 16)
# torch.compile the decoder layers (the runner's default on CUDA); --no-compile clears it
COMPILE = True
# the runner's greedy argmax from the fused LM-head top-1 (its default); --no-fused-head: from the logits
FUSED_HEAD = True


def widths_arg(text: str) -> tuple[int, ...]:
    """`--split-at`: comma-separated verification lengths, each 1..16."""
    try:
        widths = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not widths or any(not 1 <= w <= 16 for w in widths):
        raise argparse.ArgumentTypeError(f"each length must be in 1..16, got {text!r}")
    return widths


def head_top1(target, hidden):
    """The greedy argmax of the verified rows as the runner takes it: from the logits, or with
    `FUSED_HEAD` from `lm_head_top1`."""
    if FUSED_HEAD:
        return stages.top1(target, hidden)
    return target.lm_head(hidden).float().argmax(-1)


def hf_static_ar(model, prompt, new):
    """transformers' compiled static-cache AR: (ms/token, warm-up seconds)."""
    _, seconds, warmup = transformers_static(model, [prompt], new)
    return seconds[0] * 1e3 / (new - 1), warmup


def our_ar(model, prompt, new, compile=None):
    runner = Runner(model, capacity=prompt.shape[1] + new + 16, compile=COMPILE if compile is None else compile,
                    fused_head=FUSED_HEAD)
    runner.generate(prompt, 8)
    runs = []
    with GpuSampler() as gpu:
        for _ in range(3):
            first, _ = runner.start(prompt)
            torch.cuda.synchronize()
            stop = HostStopping(prompt.shape[1] + new, set(), [])
            tokens, stats = runner.decode(prompt.shape[1], int(first), stop)
            runs.append((stats.decode_seconds * 1e3 / (len(tokens) - 1), stats))
    ms, stats = min(runs, key=lambda r: r[0])
    host_us = statistics.median(stats.host_seconds) * 1e6
    print(f"  AR host us per token: median {host_us:.1f}, of which the replay call {statistics.median(stats.replay_seconds) * 1e6:.1f}")
    parts = host_parts(runner, prompt)
    print(f"  host parts (us per call, alone): {parts}")
    # a device figure, kept apart from the host parts by the callers
    parts["replays_only_ms_per_token"] = replays_only(runner, prompt, new - 1) if runner.captured else None
    if runner.captured:
        print(f"  the same steps as back-to-back replays (no ring copy, event or read between them): "
              f"{parts['replays_only_ms_per_token']:.3f} ms/token")
    out = torch.cat([prompt, torch.tensor([tokens], device=prompt.device)], -1)
    del runner
    # the GPU's clocks, heat and power while the timed runs ran, kept apart from the host parts by the callers
    parts["gpu_state"] = gpu.summary
    print(f"  GPU during the timed runs: {gpu.summary}")
    return ms, host_us, out, parts


def replays_only(runner, prompt, steps: int) -> float:
    """Device time per step of `steps` graph replays launched back to back after `start` (the same
    decode as the host loop's, whose per-token copy into the pinned ring, event and read are left
    out), from CUDA events around them: what the loop's boundary between replays costs is the
    difference to its ms/token. The best of three runs, as `our_ar` takes."""
    best = float("inf")
    for _ in range(3):
        runner.start(prompt)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            runner.step()
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / steps)
    return best


def host_parts(runner, prompt, calls: int = 100) -> dict:
    """CPU time of each host operation of a round, each timed alone over `calls` calls (us): the
    graph replay call, queueing the output row's copy into the pinned ring with its event, reading
    the row back as a list, and the per-token bookkeeping of `Runner._read`."""
    runner.start(prompt)
    torch.cuda.synchronize()
    row, out_row, event = runner._ring_rows[0], runner._out_row, runner.events[0]

    def per_call(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6

    parts = dict(replay=per_call(runner.step))
    torch.cuda.synchronize()
    parts["ring_copy_and_event"] = per_call(lambda: (row.copy_(out_row, non_blocking=True), event.record()))
    torch.cuda.synchronize()
    parts["tolist"] = per_call(row.tolist)
    values, stats, out, done = row.tolist(), HybridSpecStats(), [[]], [False]
    stop = HostStopping(1 << 30, set(), [])
    parts["read"] = per_call(lambda: runner._read(values, prompt.shape[1], out, done, stats, stop, None, 0.0, 1))
    return parts


def _target_bytes(model) -> tuple[dict[str, int], int, int]:
    """The target's bytes as a verification reads them: its parameters by part (`_part_of`; no
    embedding table, whose w rows are negligible; no experts), one expert's weights (gate_up_proj
    `[E, 2I, H]` and down_proj `[E, H, I]` of layer 0) and the GDN layers' fp32 states."""
    parts = dict.fromkeys((*BOUND_PARTS, "other"), 0)
    per_expert = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            if ".layers.0." in name:
                per_expert += p[0].numel() * p.element_size()
        elif "embed_tokens" not in name:
            parts[_part_of(name)] += p.numel() * p.element_size()
    cfg = model.config
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    states = gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return parts, per_expert, states


def bytes_bound(model, distinct_pairs: int, rows: int, bandwidth_gbs: float) -> tuple[float, float]:
    """(bytes, ms): weights a w-row verification must read (every non-expert weight except the
    embedding table, whose w rows are negligible; each distinct expert once) plus the GDN states."""
    parts, per_expert, states = _target_bytes(model)
    total = sum(parts.values()) + distinct_pairs * per_expert + states
    return total, total / (bandwidth_gbs * 1e9) * 1e3


# the split's timed parts that read weights; `other` (the layer norms) is not timed on its own
BOUND_PARTS = ("gdn", "attention", "moe", "lm_head_accept", "drafter")


def _part_of(name: str) -> str:
    """Which timed part reads target parameter `name` (the layer norms are `other`)."""
    if ".linear_attn." in name:
        return "gdn"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "moe"
    if "lm_head" in name or name.endswith("model.norm.weight") or name.endswith("language_model.norm.weight"):
        return "lm_head_accept"
    return "other"


def component_bytes(model, drafter, distinct_pairs: int, context: int, batch: int = 1) -> dict[str, int]:
    """Bytes each part of the split must read at least, as `bytes_bound` counts them (each weight
    once, each distinct (layer, expert) once, no embedding table): `gdn` its mixers' weights and
    fp32 states; `attention` its mixers' weights and the `context` cached keys and values each layer
    holds; `moe` every block's router, shared expert and gate, and `distinct_pairs` experts;
    `lm_head_accept` the head and the final norm; `drafter` its own weights and the target's head,
    which its top-1 reads (its context cache left out); `other` the layer norms. Without `drafter`
    and at context 0 the parts add up to `bytes_bound`'s total. `batch` sequences: the states and
    the cached keys and values per sequence, the weights once (`distinct_pairs` the batch's union)."""
    parts, per_expert, states = _target_bytes(model)
    cfg = model.config
    parts["moe"] += distinct_pairs * per_expert
    parts["gdn"] += batch * states
    parts["drafter"] = parts["lm_head_accept"] + sum(p.numel() * p.element_size() for p in drafter.parameters())
    attn = sum(t == "full_attention" for t in cfg.layer_types)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = model.lm_head.weight.element_size()
    parts["attention"] += batch * attn * context * cfg.num_key_value_heads * head_dim * 2 * itemsize
    return parts


def split_bounds(model, drafter, split: dict, distinct: dict, context: int, bandwidth_gbs: float,
                 batch: int = 1) -> tuple[dict, list]:
    """The split's bytes bounds: (per w as a string, each part's bound in ms and the distinct pairs;
    table rows [w, distinct pairs, time / bound per part of `BOUND_PARTS`]), `split` and `distinct`
    keyed by int w; `batch` sequences of `context` cached positions each (`component_bytes`)."""
    bounds, rows = {}, []
    for w, times in split.items():
        parts = component_bytes(model, drafter, distinct[w], context, batch)
        ms = {k: b / (bandwidth_gbs * 1e9) * 1e3 for k, b in parts.items()}
        bounds[str(w)] = dict(ms, distinct_pairs=distinct[w])
        rows.append([w, distinct[w], *(times[k] / ms[k] for k in BOUND_PARTS)])
    return bounds, rows


def verification_curve(model, drafter, prompt, bandwidth):
    """C(w) in the runner's 16-row graph and in exact-w graphs, distinct pairs, bytes bound."""
    family = family_of(model)
    runner = Runner(model, drafter, FixedPolicy("fixed", W), capacity=prompt.shape[1] + 64, fused_head=FUSED_HEAD)
    state = runner.state
    taps = tuple(drafter.target_layer_ids)
    _, cache, _ = prefill(model, prompt, taps)
    load_prefill(state, cache)
    del cache
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randint(0, model.config.vocab_size, (1, W), generator=g).cuda() for _ in range(4)]
    tokens = blocks[0].clone()
    num = torch.full((1,), W, dtype=torch.long, device="cuda")
    target = runner.target

    compiled = compiled_once(Blocks, layer_options()) if COMPILE else EAGER

    def fixed():
        state.num_tokens = num
        hidden, _ = verify_forward(family, model, tokens, state, taps, blocks=compiled)
        head_top1(target, hidden)

    fixed_graph = capture(fixed)
    rows = []
    for b, block in enumerate(blocks):
        tokens.copy_(block)
        routing = []
        with torch.no_grad():
            state.num_tokens = None
            verify_forward(family, model, tokens, state, taps, routing)
        ids = torch.stack([r[0] for r in routing])  # [layers, W, k]
        distinct = distinct_prefix_counts(ids, model.config.num_experts).sum(0).tolist()  # [W]
        for w in range(1, W + 1):
            num.fill_(w)
            c_fixed = time_ms(fixed_graph.replay, replays=5, samples=15)
            rows.append(dict(block=b, w=w, distinct_pairs=distinct[w - 1], fixed_ms=c_fixed))
    fixed_ms = np.array([r["fixed_ms"] for r in rows])
    pairs = np.array([r["distinct_pairs"] for r in rows])
    r_pairs = float(np.corrcoef(fixed_ms, pairs)[0, 1])
    slope, intercept = np.polyfit(pairs, fixed_ms, 1)
    c16 = [r for r in rows if r["w"] == W]
    bound_bytes, bound_ms = bytes_bound(model, int(np.mean([r["distinct_pairs"] for r in c16])), W, bandwidth)
    c16_ms = float(np.mean([r["fixed_ms"] for r in c16]))
    del runner, fixed_graph
    return dict(rows=rows, r_distinct=r_pairs, ms_per_distinct_pair=float(slope), intercept_ms=float(intercept),
                c16_ms=c16_ms, c16_bound_ms=bound_ms, c16_bound_bytes=bound_bytes, c16_over_bound=c16_ms / bound_ms)


def split_parts(model, drafter, prompt, compile_layers: bool):
    """What `component_split` times, as functions over real inputs of each part, for `prompt`
    `[B, P]` (random tokens, no padding) on its device: `(runner, parts, tokens, per_layer, num,
    distinct)`; `parts` maps gdn, attention, moe, lm_head_accept, drafter and stage0 to functions of
    no arguments, `tokens` is the verified block `[B, W]`, `num` is the `[B]` count of verified
    rows the parts read (set it before a call), `distinct[w - 1]` the distinct (layer, expert) pairs
    of the block's first w rows over the batch. Device-generic, so the CPU tests run every part."""
    family = family_of(model)
    B, P = prompt.shape
    device = prompt.device
    runner = Runner(model, capacity=P + 64, batch_size=B, compile=compile_layers)
    state = runner.state
    taps = tuple(drafter.target_layer_ids)
    _, cache, feats = prefill(model, prompt, taps)
    load_prefill(state, cache)
    del cache
    # the drafter's context holds the prompt; `propose` writes its block past it and advances nothing
    drafter.reset(B, runner.rows)
    drafter.observe(feats, P)
    # the drafter's layers as the runner runs them (compiled per layer kind), and the target's blocks
    drafter.compile_layers(compile_layers)
    blocks = compiled_once(Blocks, layer_options()) if compile_layers else EAGER
    anchor = prompt[:, -1:].clone()
    text = family.text_model(model)
    layers = text.layers
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, family.text_config(model).vocab_size, (B, W), generator=g).to(device)
    # real inputs of every layer's mixer and MoE block for this block
    mixer_in, moe_in = {}, {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.input_layernorm.register_forward_hook(lambda m, a, o, i=i: mixer_in.__setitem__(i, o)))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(lambda m, a, o, i=i: moe_in.__setitem__(i, o)))
    routing = []
    with torch.no_grad():
        verify_forward(family, model, tokens, state, (), routing)
    for h in hooks:
        h.remove()
    # the MoE graphs' distinct (layer, expert) pairs at each w, over the batch's union: token j of
    # every row counts as one token choosing all their experts
    ids = torch.stack(routing)  # [L, B, W, k]
    union = ids.permute(0, 2, 1, 3).reshape(ids.shape[0], W, -1)
    distinct = distinct_prefix_counts(union, family.text_config(model).num_experts).sum(0).tolist()
    num = torch.full((B,), W, dtype=torch.long, device=device)
    positions = state.length[:, None] + torch.arange(W, device=device)[None]
    cos_sin = family.rope(model, mixer_in[0], positions)

    compiled = (lambda fn: torch.compile(fn, dynamic=False, options=layer_options())) if compile_layers else (lambda fn: fn)
    gdn_mixer, attention_mixer, moe_block = (compiled(fn) for fn in (family.gdn_verify_layer, attention_verify, moe_verify))

    def gdn():
        for i in state.gdn_layers:
            gdn_mixer(layers[i].linear_attn, mixer_in[i], state.gdn(i, W), num)

    def attention():
        for i in state.attn_layers:
            ai = state.attn_slot[i]
            attention_mixer(layers[i].self_attn, mixer_in[i], cos_sin, state.keys[ai], state.values[ai], state.length,
                            state.pad, family.apply_rope)

    def moe():
        for i, layer in enumerate(layers):
            moe_block(family, layer.mlp, moe_in[i], None, num)

    target = runner.target
    final = text.norm(mixer_in[len(layers) - 1])  # a [B, 16, H] hidden state of the right scale
    drafts = tokens[:, 1:]

    def head_accept():
        greedy_accept_tokens(head_top1(target, final), drafts, num)

    def draft():
        drafter.propose(anchor)

    def stage0_as_run():
        # what `stages.route_layer0` runs in a two-stage round: all W rows, Layer 0 on the blocks
        state.num_tokens = None
        stage0(family, model, tokens, state, blocks)

    parts = dict(gdn=gdn, attention=attention, moe=moe, lm_head_accept=head_accept, drafter=draft,
                 stage0=stage0_as_run)
    per_layer = dict(gdn=len(state.gdn_layers), attention=len(state.attn_layers), moe=len(layers),
                     lm_head_accept=1, drafter=len(drafter.layers), stage0=1)
    return runner, parts, tokens, per_layer, num, distinct


def component_split(model, drafter, prompt, widths=SPLIT_AT):
    """Graphs of the GDN mixers, the attention mixers, the MoE blocks, the LM head + greedy accept,
    the drafter's round alone and Stage 0 (eager as the round runs it, and compiled), at each of
    `widths` w rows (the
    drafter always drafts its whole block, Stage 0 always runs all W rows). `prompt` `[B, P]`: with
    B > 1 every part runs the batch of B rows (the batched round's shapes: B x W verified rows, the
    drafter drafting for every row), and the distinct (layer, expert) pairs are the union over the
    batch."""
    runner, parts, tokens, per_layer, num, distinct = split_parts(model, drafter, prompt, COMPILE)
    family = family_of(model)
    state = runner.state
    # fullgraph, as Runner(compile_front=True) compiles it: a graph break fails instead of timing a half-eager Stage 0
    stage0_compiled = torch.compile(stage0, dynamic=False, fullgraph=True, options=layer_options())

    def stage0_compiled_run():
        state.num_tokens = None
        stage0_compiled(family, model, tokens, state)

    parts = list(parts.items())
    compile_error = None
    try:
        stage0_compiled_run()
        parts.append(("stage0_compiled", stage0_compiled_run))
        per_layer["stage0_compiled"] = 1
    except Exception as error:  # a measurement of an alternative: reported in the output, never hidden
        compile_error = error_text(error)
        print(f"Stage 0 compiled: not measured ({compile_error})")
    num.fill_(1)
    kernels = {name: kernel_profile(fn, per_layer[name]) for name, fn in parts}
    pool = torch.cuda.graph_pool_handle()
    graphs = {name: capture(fn, pool=pool) for name, fn in parts}
    out = {}
    for w in widths:
        num.fill_(w)
        out[w] = {name: time_ms(graph.replay, replays=5, samples=15) for name, graph in graphs.items()}
    if compile_error is not None:
        kernels["stage0_compiled"] = dict(error=compile_error)
    del runner, graphs
    return out, kernels, {w: distinct[w - 1] for w in widths}


def print_kernels(kernels: dict) -> None:
    """`component_split`'s kernel lists, per part (a part that was not measured has none)."""
    for name, k in kernels.items():
        if "error" in k:
            continue
        print(f"{name}: {k['kernels_per_layer']:.1f} kernels per layer (w = 1, eager launch of the compiled function)")
        for t in k["top"]:
            print(f"    {t['us_per_layer']:7.1f} us  x{t['launches_per_layer']:.1f}  {t['name']}")


def print_split(split: dict, kernels: dict) -> None:
    """The kernel lists and the per-part times of `component_split`."""
    print_kernels(kernels)
    names = list(next(iter(split.values())))
    print_table(["w", *(f"{n} ms" for n in names)], [[w, *(v[n] for n in names)] for w, v in split.items()])


def batch_split(model, drafter, args, variants: list[tuple[str, dict]], result: dict) -> None:
    """`--split-batch B`: `component_split` for B prompts of `--prompt` random tokens (w rows per
    sequence, B x w verified rows), then again under each of `variants` (`split_variants`), written
    to runner.json under "batch_split"."""
    B = args.split_batch
    prompt = torch.randint(0, model.config.vocab_size, (B, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    split, kernels, distinct = component_split(model, drafter, prompt, args.split_at)
    result["batch_split"] = dict(batch_size=B, split={str(w): v for w, v in split.items()}, kernels_at_w1=kernels,
                                 distinct_pairs={str(w): d for w, d in distinct.items()})
    print(f"the split at a batch of {B} (w rows per sequence, {B} x w verified; distinct pairs over the batch: "
          f"{distinct})")
    print_split(split, kernels)
    bandwidth = result["copy_bandwidth_gbs"]
    result["batch_split"]["bound_ms"], bound_rows = split_bounds(model, drafter, split, distinct, args.prompt,
                                                                 bandwidth, batch=B)
    print(f"each part's time over its bytes bound (component_bytes: weights once, each distinct expert of the "
          f"batch's union once, {B} sequences' states and KV; at the copy bandwidth, {bandwidth:.0f} GB/s)")
    print_table(["w", "distinct (layer, expert)", *BOUND_PARTS], bound_rows)
    # each --split-variants config in this process, on the same weights and prompts, after the
    # run's own: the A/B of a tile at the batched shapes within one call; written after each, so a
    # variant that fails keeps what was measured before it
    rows = result["batch_split"]["variants"] = []
    write_json(Path(args.out) / "runner.json", result)
    for kind, changes in variants:
        with config_variant(kind, changes):
            split, kernels, _ = component_split(model, drafter, prompt, args.split_at)
        label = kind + ": " + ",".join(f"{k}={v}" for k, v in changes.items())
        rows.append(dict(kind=kind, variant=changes, split={str(w): v for w, v in split.items()}, kernels_at_w1=kernels))
        print(f"the split at a batch of {B} under {label}")
        print_split(split, kernels)
        write_json(Path(args.out) / "runner.json", result)


def round_costs(model, drafter, prompt, continuation, compile_front: bool, new: int = 64) -> dict:
    """ms per speculative round, with the replay drafter (simulated acceptance): at each fixed
    verification length of `SPLIT_AT` (keys "1", "4", ...), and under the built-in HybridSpec length
    policy (key "hybridspec": its select runs the length arithmetic; uncalibrated, so no routing
    correction). The runner's whole captured round (drafter, Stage 0, verification, head + accept,
    commit, and the host between replays where it is slower than the device), its front (length
    choice, Stage 0, correction) eager or compiled (`Runner(compile_front=)`): decode seconds over
    rounds launched, median of 3 calls of `new` tokens after a warm-up call, and the mean verified w."""
    capacity = prompt.shape[1] + new + 16
    policies = {str(w): FixedPolicy("fixed", w) for w in SPLIT_AT}
    with warnings.catch_warnings():
        # the built-in policy warns that it is uncalibrated: here that is the point
        warnings.simplefilter("ignore")
        policies["hybridspec"] = default_policy("hybridspec", capacity)
    out = {}
    for name, policy in policies.items():
        runner = replay_runner(model, drafter, continuation, policy, capacity, compile_front=compile_front)
        runner.generate(prompt, new)
        per_round, mean_w = [], []
        for seed in range(3):
            # the replay drafter draws from the global generator: both fronts see the same rounds
            torch.manual_seed(seed)
            _, stats = runner.generate(prompt, new)
            per_round.append(stats.decode_seconds * 1e3 / stats.launched)
            mean_w.append(float(np.mean(stats.verify_lengths)))
        out[name] = dict(ms=statistics.median(per_round), mean_w=statistics.median(mean_w))
        del runner
    return out


def kernel_profile(fn, layers: int, top: int = 8) -> dict:
    """Kernels one call of `fn` launches (run eagerly after a warm-up, under torch.profiler), per
    layer, and the `top` kernels by GPU time: where a component's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = kernel_events(prof)
    by_name: dict = {}
    for e in events:
        total, count = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (total + e.time_range.elapsed_us(), count + 1)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(kernels_per_layer=len(events) / layers, layers=layers,
                top=[dict(name=n[:90], us_per_layer=t / layers, launches_per_layer=c / layers) for n, (t, c) in ranked])


def replay_runner(model, drafter, continuation, policy, capacity: int, compile_front: bool = False,
                  enforce_eager: bool = False) -> Runner:
    """The runner of this script's speculative rows: the replay drafter over `continuation`
    (simulated acceptance), the script's compile and fused-head settings."""
    replay = DeviceReplayDrafter(drafter, continuation)
    replay.bind(model)
    return Runner(model, replay, policy, capacity=capacity, compile=COMPILE, fused_head=FUSED_HEAD,
                  compile_front=compile_front, enforce_eager=enforce_eager)


def round_kernels(model, drafter, prompt, continuation, w: int, compile_front: bool, top: int = 30) -> dict:
    """Every kernel of one whole speculative round at verification length `w` (replay drafter,
    simulated acceptance; layers compiled with `COMPILE`, front compiled with `compile_front`,
    launched eagerly so torch.profiler sees each kernel): the count and the `top` kernels by GPU
    time. The split times the components in graphs; this says what the rest of a round (commit, the
    drafter's context, accept, emit) launches."""
    runner = replay_runner(model, drafter, continuation, FixedPolicy("fixed", w), prompt.shape[1] + 64,
                           compile_front=compile_front, enforce_eager=True)
    runner.start(prompt)
    # budget for every round here (a round without budget verifies one row); with the replay
    # drafter's ~1 token a round, the rounds stay within the buffers
    runner.io.budget.fill_(64)
    for _ in range(2):
        runner.step()
    profile = kernel_profile(runner.step, 1, top=top)
    del runner
    return profile


def error_text(error: Exception) -> str:
    """What an alternative's failed measurement records in the output (it is reported, never hidden)."""
    return f"{type(error).__name__}: {error}"[:500]


def spec_host_time(model, drafter, prompt, continuation, new):
    runner = replay_runner(model, drafter, continuation, FixedPolicy("fixed", W), prompt.shape[1] + new + 16)
    torch.manual_seed(0)
    out, stats = runner.generate(prompt, new)
    torch.manual_seed(0)
    out, stats = runner.generate(prompt, new)
    del runner
    return dict(host_us_median=statistics.median(stats.host_seconds) * 1e6,
                host_us_mean=statistics.fmean(stats.host_seconds) * 1e6,
                round_ms=stats.decode_seconds * 1e3 / stats.launched, rounds=len(stats.accepted),
                mean_accept_length=float(np.mean(stats.accepted)) + 1, exact=bool(torch.equal(out[0, prompt.shape[1]:], continuation[: new])))


def round_table(rounds: dict, compiled_front: dict, fixed_at: dict, split: dict) -> dict:
    """`round_costs`' two runs beside C(w) (`fixed_at`, by int w) and the split's drafter and Stage 0
    (`split`, by int w): per key, the round's ms and mean w, the compiled front's ms (None where it
    was not measured) and, at a fixed length, `rest_ms` = round - C(w) - drafter (what the round adds
    to a compiled verification from the embedding: Stage 0, the length choice, correction, accept,
    commit, host)."""
    table = {}
    for name, r in rounds.items():
        row = dict(round_ms=r["ms"], mean_w=r["mean_w"], round_compiled_front_ms=compiled_front[name]["ms"])
        if name.isdigit():
            w = int(name)
            row.update(c_ms=fixed_at[w], drafter_ms=split[w]["drafter"], rest_ms=r["ms"] - fixed_at[w] - split[w]["drafter"],
                       stage0_ms=split[w]["stage0"], stage0_compiled_ms=split[w].get("stage0_compiled"))
        table[name] = row
    return table


def _assignments(text: str) -> list[tuple[str, str]]:
    """`name=value,...` -> `[(name, value), ...]` (empty items skipped)."""
    return [tuple(item.partition("=")[::2]) for item in text.split(",") if item]


# the kinds of kernel config a variant may change (`_config_module`)
CONFIG_KINDS = ("linear", "moe", "gdn", "attention")
# kinds whose config is a module-level dict rather than a `KERNEL_CONFIG` dataclass: its name
_DICT_CONFIGS = {"gdn": "VERIFY_CONFIG", "attention": "PROLOGUE_CONFIG"}


def _config_module(kind: str):
    """The module whose `KERNEL_CONFIG` a variant of this kind changes ("gdn": the verify kernel's
    `VERIFY_CONFIG` dict of hybridspec/ops/gdn.py; "attention": `PROLOGUE_CONFIG` of
    hybridspec/ops/prologue.py; both through `_DICT_CONFIGS`)."""
    from hybridspec.ops import gdn, linear, moe, prologue

    return dict(zip(CONFIG_KINDS, (linear, moe, gdn, prologue)))[kind]


def _kernel_config(kind: str) -> dict:
    """The current fields of the `kind` config as a dict."""
    from dataclasses import asdict

    module = _config_module(kind)
    if kind in _DICT_CONFIGS:
        return dict(getattr(module, _DICT_CONFIGS[kind]))
    return asdict(module.KERNEL_CONFIG)


def config_variant(kind: str, changes: dict):
    """A context manager: the `kind` config with `changes` applied inside the block, restored after
    (kernels read it at launch, so graphs captured inside run the variant)."""
    from dataclasses import replace
    from unittest import mock

    module = _config_module(kind)
    if kind in _DICT_CONFIGS:
        return mock.patch.dict(getattr(module, _DICT_CONFIGS[kind]), changes)
    return mock.patch.object(module, "KERNEL_CONFIG", replace(module.KERNEL_CONFIG, **changes))


def _config_fields(text: str, kind: str, option: str) -> dict:
    """`name=value,...` -> those fields of the `kind` config (`_config_module`) as ints; an unknown
    field, a non-integer value or a split count outside 1..16 stops the run, naming `option`."""
    from hybridspec.ops import linear

    fields = _kernel_config(kind)
    changes = {}
    for name, value in _assignments(text):
        if name not in fields:
            config = _DICT_CONFIGS.get(kind) or type(_config_module(kind).KERNEL_CONFIG).__name__
            raise SystemExit(f"{option}: {config} has no field {name!r}")
        try:
            changes[name] = int(value)
        except ValueError:
            raise SystemExit(f"{option}: {name} must be an integer, got {value!r}") from None
        if name.endswith("_split_k") and not 1 <= changes[name] <= linear.MAX_SPLITS:
            raise SystemExit(f"{option}: {name} must be in 1..{linear.MAX_SPLITS}, got {changes[name]}")
    return changes


def config_variants(text: str, kind: str = "linear") -> list[tuple[str, dict]]:
    """`--ar-linear "out_split_k=4;router_split_k=4;out_split_k=4,router_split_k=4"` (kind "linear":
    `LinearKernelConfig`) or `--ar-moe "gate_up_block_i=32;down_block_h=32"` (kind "moe":
    `MoEKernelConfig`) -> one `(kind, fields)` per `;`-separated variant (`_config_fields`), checked
    before anything is built."""
    return [(kind, _config_fields(part, kind, f"--ar-{kind}")) for part in text.split(";") if part]


def split_variants(text: str, option: str = "--split-variants") -> list[tuple[str, dict]]:
    """`--split-variants "moe:down_block_h=32;linear:wide_block_n=32;gdn:BV=64"` -> one `(kind,
    fields)` per `;`-separated variant, the kind before the colon ("linear", "moe" or "gdn"), checked
    before anything is built; errors name `option` (another script's flag of this form)."""
    out = []
    for part in text.split(";"):
        if not part:
            continue
        kind, sep, fields = part.partition(":")
        if not sep or kind not in CONFIG_KINDS:
            raise SystemExit(f"{option}: {part!r} must be kind:name=value,... with kind linear, moe, gdn or attention")
        out.append((kind, _config_fields(fields, kind, option)))
    return out


def ar_variants(model, prompt, new, variants: list[tuple[str, dict]], reference: torch.Tensor) -> list[dict]:
    """The AR step under each variant of a kernel config (`LinearKernelConfig` fields over this run's
    config: split-K output projections, router GEMMs and input projections; or `MoEKernelConfig`
    tiles), in this process one after another, the library's configs restored after; whether each
    decodes the tokens `reference` holds (bf16 random weights are near-tied, so a differing token is
    rounding, and the fp32 GPU tests decide exactness)."""
    rows = []
    for kind, changes in variants:
        with config_variant(kind, changes):
            ms, _, out, parts = our_ar(model, prompt, new)
        rows.append(dict(kind=kind, variant=changes, acceptance=AR_ROW_ACCEPTANCE, ms_per_token=ms,
                         same_tokens=bool(torch.equal(out, reference)),
                         replays_only_ms_per_token=parts["replays_only_ms_per_token"], gpu_state=parts["gpu_state"]))
    return rows


def linear_config(text: str) -> dict:
    """`name=value,...` -> those fields of `hybridspec.ops.linear.KERNEL_CONFIG` (ints), e.g.
    `block_n=32`, set for the run (`_config_fields` checks them before anything runs). Returns the
    config."""
    from dataclasses import asdict, replace

    from hybridspec.ops import linear

    linear.KERNEL_CONFIG = replace(linear.KERNEL_CONFIG, **_config_fields(text, "linear", "--linear"))
    return asdict(linear.KERNEL_CONFIG)


def moe_config(text: str) -> dict:
    """`name=value,...` -> those fields of `hybridspec.ops.moe.KERNEL_CONFIG` (ints), e.g.
    `combine_in_consumer=1`, set for the run (checked by `_config_fields`). Returns the config."""
    from dataclasses import asdict, replace

    from hybridspec.ops import moe

    moe.KERNEL_CONFIG = replace(moe.KERNEL_CONFIG, **_config_fields(text, "moe", "--moe"))
    return asdict(moe.KERNEL_CONFIG)


def inductor_settings(text: str) -> dict:
    """`name=value,...` -> the same names set on `torch._inductor.config` and in the runner's own
    compile options (`hybridspec.ops.dispatch.LAYER_OPTIONS`, which would override the global setting), so
    `combo_kernels=0,triton.enable_pdl=0` measures the layers without the runner's settings (ints
    and floats parsed; an unknown name raises before anything runs)."""
    import torch._inductor.config as config

    from hybridspec.ops.dispatch import LAYER_OPTIONS, PDL

    settings = {}
    for name, value in _assignments(text):
        if not hasattr(config, name):
            raise SystemExit(f"--inductor: torch._inductor.config has no setting {name!r}")
        if name == "triton.enable_pdl" and not PDL:
            raise SystemExit("--inductor triton.enable_pdl with HYBRIDSPEC_PDL=0: PDL is off for every kernel there")
        current = getattr(config, name)
        parsed = bool(int(value)) if isinstance(current, bool) else type(current)(value) if current is not None else value
        setattr(config, name, parsed)
        LAYER_OPTIONS[name] = parsed
        settings[name] = parsed
    return settings


# everything here runs without autograd, as generate does (our ops have no backward)
@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/runner")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--skip-hf", action="store_true", help="skip transformers' compiled static AR (~90 s compile)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random models (a smoke test of this script)")
    parser.add_argument("--no-compile", action="store_true", help="capture eager decoder layers (no torch.compile)")
    parser.add_argument("--only-ar", action="store_true", help="stop after the autoregressive comparison")
    parser.add_argument("--skip-uncompiled", action="store_true",
                        help="no AR row with uncompiled layers (it is timed last of all, since rows timed after it "
                             "ran slower: the order effect)")
    parser.add_argument("--only-round-kernels", action="store_true",
                        help="after the autoregressive comparison, only the kernels of one whole round at w = 1 and 16")
    parser.add_argument("--inductor", default="",
                        help="inductor settings for this run, e.g. combo_kernels=0 (torch._inductor.config and the "
                             "runner's compile options, set before anything compiles; recorded in the output)")
    parser.add_argument("--no-fused-head", dest="fused_head", action="store_false",
                        help="the runner's greedy argmax from the logits (Runner(fused_head=False)) instead of the "
                             "fused LM-head top-1, the default")
    parser.add_argument("--linear", default="", help="small_linear's kernel config for this run, e.g. "
                        "block_n=32 (recorded in the output)")
    parser.add_argument("--moe", default="", help="the experts op's MoEKernelConfig for this run, e.g. "
                        "combine_in_consumer=1 (recorded in the output)")
    parser.add_argument("--ar-linear", default="",
                        help="after the AR row, the AR step again under each of these ';'-separated variants of "
                             "--linear, e.g. 'out_split_k=4;router_split_k=4;out_split_k=4,router_split_k=4' "
                             "(one process, same weights)")
    parser.add_argument("--split-batch", type=int, default=0,
                        help="only the per-part split and its kernel lists for a batch of this many rows (2..4: "
                             "the batched round's shapes), then stop")
    parser.add_argument("--split-at", type=widths_arg, default=SPLIT_AT,
                        help="with --split-batch, the verification lengths w to time the split at, e.g. "
                             "1,2,4,8,12,16 (default 1,4,8,16)")
    parser.add_argument("--split-variants", default="",
                        help="with --split-batch, the split again under each of these ';'-separated kernel config "
                             "variants, e.g. 'moe:down_block_h=32;linear:wide_block_n=32;gdn:BV=64' (one process, "
                             "same weights and prompts)")
    parser.add_argument("--ar-moe", default="",
                        help="after the AR row (and any --ar-linear variants), the AR step under each of these "
                             "';'-separated MoEKernelConfig variants, e.g. 'gate_up_block_i=32;down_block_h=32'")
    parser.add_argument("--ar-gdn", default="",
                        help="after the AR row (and any --ar-linear and --ar-moe variants), the AR step under each of "
                             "these ';'-separated VERIFY_CONFIG variants, e.g. 'BV=64;num_warps=8'")
    parser.add_argument("--ar-attention", default="",
                        help="after the other variants, the AR step under each of these ';'-separated "
                             "PROLOGUE_CONFIG variants (hybridspec/ops/prologue.py), e.g. 'fused=0'")
    args = parser.parse_args()
    if args.split_batch and not 2 <= args.split_batch <= 4:
        raise SystemExit(f"--split-batch must be in 2..4 (the batched round's sizes), got {args.split_batch}")
    if args.split_variants and not args.split_batch:
        raise SystemExit("--split-variants needs --split-batch (it repeats the batched split)")
    batch_variants = split_variants(args.split_variants)
    inductor = inductor_settings(args.inductor)
    linear_cfg = linear_config(args.linear)
    moe_cfg = moe_config(args.moe)
    variants = (config_variants(args.ar_linear, "linear") + config_variants(args.ar_moe, "moe")
                + config_variants(args.ar_gdn, "gdn") + config_variants(args.ar_attention, "attention"))
    global COMPILE, FUSED_HEAD
    COMPILE = not args.no_compile
    FUSED_HEAD = args.fused_head
    torch.backends.cuda.matmul.allow_tf32 = False
    info = dict(env_info(), inductor=inductor, linear_config=linear_cfg, moe_config=moe_cfg, fused_head=args.fused_head)
    print(info)
    t0 = time.perf_counter()
    if args.tiny:
        model, drafter = tiny_target().cuda(), tiny_drafter().cuda()
    else:
        model, drafter = build_target("qwen3.6-35b-a3b"), build_drafter("qwen3.6-35b-a3b")
    drafter.bind(model)
    print(f"built the models in {time.perf_counter() - t0:.1f} s")
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    bandwidth = copy_bandwidth_gbs()
    result = dict(env=info, prompt=args.prompt, new=args.new, copy_bandwidth_gbs=bandwidth, acceptance=ACCEPTANCE)
    print(f"acceptance: {ACCEPTANCE}")

    if args.split_batch:
        batch_split(model, drafter, args, batch_variants, result)
        return
    t0 = time.perf_counter()
    ar_ms, ar_host_us, ar_out, host_parts_us = our_ar(model, prompt, args.new)
    ar_setup = time.perf_counter() - t0
    _, ar_bound_ms = bytes_bound(model, 8 * model.config.num_hidden_layers, 1, bandwidth)
    replays_ms = host_parts_us.pop("replays_only_ms_per_token")
    ar_gpu_state = host_parts_us.pop("gpu_state")
    result["ar"] = dict(ours_ms_per_token=ar_ms, replays_only_ms_per_token=replays_ms, gpu_state=ar_gpu_state,
                        host_us_per_token=ar_host_us, host_parts_us=host_parts_us,
                        bytes_bound_ms=ar_bound_ms,
                        ours_uncompiled_layers_ms_per_token=None, setup_and_runs_s=ar_setup,
                        compiled_equals_uncompiled=None)
    replays = "n/a" if replays_ms is None else f"{replays_ms:.3f}"
    print(f"AR (ours, CUDA graph): {ar_ms:.3f} ms/token (replays back to back {replays}); bytes bound "
          f"{ar_bound_ms:.3f} ms; host {ar_host_us:.1f} us/token; compile+capture+runs {ar_setup:.0f} s")

    def finish() -> None:
        """The AR row with uncompiled layers, after everything else is timed, then the JSON. That row
        allocates and frees far more memory than the others, and rows timed after it in one process ran
        0.04-0.08 ms a token slower than the first AR row (docs/benchmarks.md, "The order effect
        traced"), so nothing timed follows it. It is not the whole order effect: with it left out, later
        rows still ran 0.02 ms slower in one process and 0.05-0.07 in the next ("The one-row verify on
        by default"), so A/B rows alternate."""
        if not args.skip_uncompiled:
            eager_ms, _, eager_out, _ = our_ar(model, prompt, args.new, compile=False)
            result["ar"].update(ours_uncompiled_layers_ms_per_token=eager_ms,
                                compiled_equals_uncompiled=bool(torch.equal(ar_out, eager_out)))
            print(f"AR with uncompiled layers (timed last): {eager_ms:.3f} ms/token")
        write_json(Path(args.out) / "runner.json", result)
    continuation = ar_out[0, args.prompt:]
    if variants:
        result["ar_variants"] = ar_variants(model, prompt, args.new, variants, ar_out)
        print_table(["config variant", "AR ms/token", "same tokens as the AR row", "lowest SM MHz"],
                    [[r["kind"] + ": " + (",".join(f"{k}={v}" for k, v in r["variant"].items()) or "(as run)"),
                      r["ms_per_token"], r["same_tokens"], r["gpu_state"].get("sm_clock_mhz_min")]
                     for r in result["ar_variants"]])
    if args.only_ar:
        finish()
        return
    if args.only_round_kernels:
        result["round_kernels"] = {}
        for w in (1, W):
            k = result["round_kernels"][str(w)] = round_kernels(model, drafter, prompt, continuation, w, COMPILE)
            print(f"one whole round at w = {w} (simulated acceptance, launched eagerly, front compiled with the "
                  f"layers): {k['kernels_per_layer']:.0f} kernels")
            for t in k["top"]:
                print(f"    {t['us_per_layer']:7.1f} us  x{t['launches_per_layer']:.0f}  {t['name']}")
        finish()
        return

    result["spec_host"] = spec_host_time(model, drafter, prompt, continuation, args.new)
    print(f"speculative rounds (w = 16, simulated acceptance): {result['spec_host']}")

    curve = verification_curve(model, drafter, prompt, bandwidth)
    result["verification"] = curve
    first = [r for r in curve["rows"] if r["block"] == 0]
    print_table(["w", "distinct (layer, expert)", "C(w) ms"], [[r["w"], r["distinct_pairs"], r["fixed_ms"]] for r in first])
    print(f"corr(C, distinct pairs) = {curve['r_distinct']:.4f}, {curve['ms_per_distinct_pair'] * 1e3:.2f} us per pair; "
          f"C(16) = {curve['c16_ms']:.3f} ms vs bytes bound {curve['c16_bound_ms']:.3f} ms ({curve['c16_over_bound']:.2f}x)")

    split, kernels, distinct = component_split(model, drafter, prompt)
    result["split"] = {str(w): v for w, v in split.items()}
    result["split_bound_ms"], bound_rows = split_bounds(model, drafter, split, distinct, args.prompt, bandwidth)
    result["kernels_at_w1"] = kernels
    print_kernels(kernels)
    fixed_at = {r["w"]: r["fixed_ms"] for r in first}
    target_parts = ("gdn", "attention", "moe", "lm_head_accept")
    print_table(["w", "GDN ms", "attention ms", "MoE ms", "LM head + accept ms", "other ms", "C(w) ms", "drafter ms"],
                [[w, v["gdn"], v["attention"], v["moe"], v["lm_head_accept"],
                  fixed_at[w] - sum(v[k] for k in target_parts), fixed_at[w], v["drafter"]] for w, v in split.items()])

    print("each part's time over its bytes bound (component_bytes: weights once, each distinct expert once, "
          f"the prompt's KV; at the copy bandwidth, {bandwidth:.0f} GB/s)")
    print_table(["w", "distinct (layer, expert)", *BOUND_PARTS], bound_rows)

    write_json(Path(args.out) / "runner.json", result)
    rounds = round_costs(model, drafter, prompt, continuation, compile_front=False)
    try:
        compiled_front = round_costs(model, drafter, prompt, continuation, compile_front=True)
    except Exception as error:  # an alternative's measurement: reported in the output, never hidden
        result["rounds_compiled_front_error"] = error_text(error)
        print(f"rounds with a compiled front: not measured ({result['rounds_compiled_front_error']})")
        compiled_front = {name: dict(ms=None) for name in rounds}
    result["rounds"] = round_table(rounds, compiled_front, fixed_at, split)
    print("the whole round (replay drafter, simulated acceptance, plain greedy: the fused head) at a fixed length "
          "and under the built-in HybridSpec policy, against its parts; rest = round - C(w) - drafter: what the round "
          "adds to a compiled verification from the embedding and the drafter (Stage 0, which runs Layer 0 again, "
          "the length choice, correction, accept, commit, host); last column: the round with its "
          "front (length choice, Stage 0, correction) compiled")
    columns = ("mean_w", "round_ms", "c_ms", "drafter_ms", "rest_ms", "stage0_ms", "stage0_compiled_ms",
               "round_compiled_front_ms")
    print_table(["w", "mean w", "round ms", "C(w) ms", "drafter ms", "rest ms", "Stage 0 as run ms",
                 "Stage 0 compiled ms", "round, compiled front ms"],
                [[name] + [r[c] if r.get(c) is not None else "-" for c in columns] for name, r in result["rounds"].items()])

    if not args.skip_hf:
        hf_ms, warmup = hf_static_ar(model, prompt, args.new)
        result["ar"].update(transformers_static_ms_per_token=hf_ms, transformers_warmup_s=warmup,
                            speedup_vs_transformers=hf_ms / ar_ms)
        print(f"AR transformers static compiled: {hf_ms:.3f} ms/token (warm-up {warmup:.0f} s); ours is {hf_ms / ar_ms:.2f}x faster")
    finish()


if __name__ == "__main__":
    main()
