"""Where the AR step's wall time goes, kernel by kernel, in the form the runner runs it: the captured
graph with programmatic dependent launch, profiled over a few decoded tokens.

A kernel's duration under PDL includes the time it waited for the kernel before it, so durations
do not add up to the step. Here each kernel is charged what it added to the step's end instead:
its *exposed* time, `end_i - max(end_j, j < i)` (0 for a kernel that ends inside one before it). A
step's exposed times add up to its span from its first kernel's start to its last kernel's end. The
kernels are grouped by layer (a layer ends with its MoE block: `split_layers`; a step ends with the
LM head's combine kernel) and by kind (GDN where the layer runs `gdn_verify`, attention where it runs
`decode_attention`), and reported per position in the layer, medians over the layers of a kind and
the profiled steps, with the gap from the previous kernel's end to the kernel's start (negative:
it overlapped). The "head" is the LM head's top-1 (the final norm rides in the last layer's
residual kernel). Since a step is cut after the head, its first piece holds what the graph runs
after the head for the token before (the state commit, the runner's bookkeeping), the boundary
between two replays, then the embedding, RoPE and first norm, and layer 0: the "irregular" part.
Last, every Triton kernel inductor generated for the layer graphs is listed with the launch config
its autotuning chose (`inductor_kernels`: the JSON's "inductor_kernels"; their sources under
OUT/inductor_kernels/), since kernels of one name in two graphs can run differently.

    python benchmarks/ar_timeline.py [--prompt 512] [--tokens 24] [--out bench_out/ar_timeline]
    python benchmarks/ar_timeline.py --variants 'linear:out_split_k=1;moe:down_block_h=32'   # which kernels a config moves
    for i in 1 2 3; do python benchmarks/ar_timeline.py --fresh-cache --out bench_out/tl$i; done   # inductor's picks, compile to compile

Acceptance: not applicable (AR steps, no drafts).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ACCEPTANCE = "not applicable (AR steps, no drafts)"
LAYER_END = r"moe_down"
STEP_END = r"lm_head_combine_kernel"
HEAD_START = r"lm_head"
KINDS = (("gdn", "gdn_verify"), ("attention", "decode_attention"))


@dataclass(frozen=True)
class Kernel:
    name: str
    start: float  # us
    end: float  # us


def exposed(kernels: list[Kernel]) -> list[float]:
    """Each kernel's exposed time in a stream of kernels sorted by start: what it added to the latest
    end so far (the first kernel: its duration)."""
    out, latest = [], None
    for k in kernels:
        out.append(k.end - k.start if latest is None else max(0.0, k.end - latest))
        latest = k.end if latest is None else max(latest, k.end)
    return out


def split_steps(kernels: list[Kernel], step_end: str = STEP_END) -> list[list[Kernel]]:
    """Kernels sorted by start, cut after each kernel matching `step_end` (one per AR step); a
    trailing piece without one is dropped."""
    steps, current = [], []
    for k in sorted(kernels, key=lambda k: k.start):
        current.append(k)
        if re.search(step_end, k.name):
            steps.append(current)
            current = []
    return steps


def split_layers(step: list[Kernel], layer_end: str = LAYER_END,
                 head_start: str = HEAD_START) -> tuple[list[range], range, range]:
    """One step's kernels as index ranges (layers, tail, head). Every decoder layer ends with its MoE
    block: the experts' down kernel (`layer_end`) and, after it, the kernel that adds the block to
    the residual stream and takes the next layer's norm, so a layer runs from the kernel after the
    previous layer's to that one (the first one also holds everything before layer 0). The
    head starts at the first kernel matching `head_start` (the LM head); the tail is what lies
    between the last layer and the head."""
    n = len(step)
    head = next((i for i, k in enumerate(step) if re.search(head_start, k.name)), n)
    ends = [min(i + 2, head) for i, k in enumerate(step[:head]) if re.search(layer_end, k.name)]
    bounds = [0] + ends
    layers = [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    return layers, range(bounds[-1], head), range(head, n)


def kind_of(names: list[str]) -> str:
    for kind, anchor in KINDS:
        if any(anchor in name for name in names):
            return kind
    return "other"


def table(steps: list[list[Kernel]], layer_end: str = LAYER_END) -> dict:
    """Per layer kind and position in the layer: the kernel's (most frequent) name and the medians of
    its duration, exposed time and gap, over the layers of that kind with its most common kernel
    count (the others, the first layer with the step's embedding among them, are "irregular"); per
    step the median span and the exposed time of the irregular layers, the tail, the head, and the
    gap from one step's last kernel (the LM head's combine) to the next step's first: inside one
    replay, since the graph runs the commit after the head (the replay boundary falls in the
    irregular first layer)."""
    med = statistics.median
    cuts = [split_layers(step, layer_end) for step in steps]
    kinds = [[kind_of([step[i].name for i in layer]) for layer in cut[0]] for step, cut in zip(steps, cuts)]
    lengths: dict = {}
    for cut, step_kinds in zip(cuts, kinds):
        for layer, kind in zip(cut[0], step_kinds):
            lengths.setdefault(kind, []).append(len(layer))
    modal = {kind: max(set(ls), key=ls.count) for kind, ls in lengths.items()}
    cells: dict = {}
    spans, parts = [], {"irregular": [], "tail": [], "head": [], "between": []}
    for n, (step, (layers, tail, head), step_kinds) in enumerate(zip(steps, cuts, kinds)):
        ex = exposed(step)
        spans.append(max(k.end for k in step) - step[0].start)
        if n:
            parts["between"].append(step[0].start - steps[n - 1][-1].end)
        parts["tail"].append(sum(ex[i] for i in tail))
        parts["head"].append(sum(ex[i] for i in head))
        irregular = 0.0
        for layer, kind in zip(layers, step_kinds):
            if len(layer) != modal[kind]:
                irregular += sum(ex[i] for i in layer)
                continue
            for pos, i in enumerate(layer):
                cell = cells.setdefault(kind, {}).setdefault(pos, dict(names=[], duration=[], exposed=[], gap=[]))
                cell["names"].append(step[i].name)
                cell["duration"].append(step[i].end - step[i].start)
                cell["exposed"].append(ex[i])
                cell["gap"].append(step[i].start - step[i - 1].end if i else 0.0)
        parts["irregular"].append(irregular)
    out = {"span_us": med(spans) if spans else None, "steps": len(steps),
           "parts_us": {p: med(v) if v else 0.0 for p, v in parts.items()}, "layers": {}}
    for kind, positions in cells.items():
        rows = [dict(position=pos, name=max(set(c["names"]), key=c["names"].count)[:80], duration_us=med(c["duration"]),
                     exposed_us=med(c["exposed"]), gap_us=med(c["gap"])) for pos, c in sorted(positions.items())]
        out["layers"][kind] = dict(per_step=len(positions[0]["names"]) // max(1, len(steps)), rows=rows)
    # one step's kernels as they ran (offsets from its first start), for reading the names
    if steps:
        first = steps[len(steps) // 2]
        out["one_step"] = [dict(name=k.name[:80], start_us=k.start - first[0].start, end_us=k.end - first[0].start)
                           for k in first]
    return out


def profile_steps(runner, prompt, tokens: int) -> list[Kernel]:
    """The CUDA kernels of decoding `tokens` tokens on `runner` (graph replays) under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import kernel_events
    from hybridspec.round.stopping import HostStopping

    first, _ = runner.start(prompt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode(prompt.shape[1], int(first), HostStopping(prompt.shape[1] + tokens, set(), []))
        torch.cuda.synchronize()
    return [Kernel(e.name, e.time_range.start, e.time_range.end) for e in kernel_events(prof)]


def timeline(model, prompt, args) -> dict:
    """`table` of a fresh runner's AR step on `prompt` under the library's current configs."""
    from hybridspec.runner import Runner

    runner = Runner(model, capacity=args.prompt + args.tokens + 16, compile=True, fused_head=True)
    runner.generate(prompt, 8)
    kernels = profile_steps(runner, prompt, args.tokens)
    del runner
    steps = split_steps(kernels)[args.skip:]
    if not steps:
        raise SystemExit(f"no whole step among the {len(kernels)} profiled kernels (does the profiler see the kernels "
                         f"of graph replays here? names: {sorted({k.name[:40] for k in kernels})[:10]})")
    return table(steps, args.layer_end)


# inductor names a generated kernel by its form, then the ops it fuses
FORMS = {"per": "persistent reduction", "red": "looped reduction", "poi": "pointwise"}


def inductor_kernels(modules) -> list[dict]:
    """The Triton kernels of inductor's compiled graphs among `modules` (`PyCodeCache.modules`: each
    graph's wrapper module, which launches them, and each kernel's own module), with the launch
    config their autotuning settled on (coordinate descent included): one row per kernel and graph.
    A graph's kind is the layer kind whose op its wrapper calls (`KINDS`), so that two kernels of one
    name in two graphs, such as a layer's last kernel in the GDN and in the attention layers, can be
    told apart. Every graph the process compiled is listed (with `--variants`, each variant's graphs
    too, under their own wrapper files); under `triton.multi_kernel` both forms of a reduction are
    listed, not which one was picked. `source` is the kernel function, without inductor's heuristics
    decorator (its size and reduction hints)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    rows = []
    for module in modules:
        source = Path(module.__file__).read_text()
        # a graph's wrapper starts the compile workers; a kernel's own module (listed by its wrapper)
        # does not, though it may have a benchmark harness with a `call` of its own
        if "AsyncCompile()" not in source or "def call(" not in source:
            continue
        graph = next((kind for kind, anchor in KINDS if anchor in source), "other")
        for name, value in sorted(vars(module).items()):
            if not isinstance(value, CachingAutotuner):
                continue
            configs = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
                       for c in (launcher.config for launcher in value.launchers)]
            rows.append(dict(graph=graph, wrapper=Path(module.__file__).name, kernel=name,
                             form=FORMS.get((name.split("_") + [""])[1], "other"), configs=configs, source=value.fn.src))
    return rows


def report_kernels(rows: list[dict]) -> None:
    from benchmarks.common import print_table

    print("inductor's kernels in the layer graphs, with the configs autotuning chose (one config: settled)")
    print_table(["graph", "wrapper", "kernel", "form", "configs"],
                [[r["graph"], r["wrapper"][:12], r["kernel"][:80], r["form"], r["configs"]] for r in rows
                 if r["graph"] != "other"])


def kernel_listing(out: Path) -> list[dict] | dict:
    """`inductor_kernels` of this process, printed, with each kernel's source written apart under
    `out`/inductor_kernels/ (to keep the JSON readable); {"error": ...} where this torch's internals
    differ from what `inductor_kernels` reads."""
    try:
        from torch._inductor.codecache import PyCodeCache

        kernels = inductor_kernels(PyCodeCache.modules)
    except (AttributeError, ImportError, OSError) as err:
        return {"error": repr(err)}
    if not any(row["graph"] != "other" for row in kernels):
        # seen on an H100 under TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 (2026-12-07): the layers compiled
        # and ran, yet no layer graph's wrapper was among the modules read here. A fresh compile per
        # process, with the listing, takes a fresh TORCHINDUCTOR_CACHE_DIR instead
        error = ("no layer graph's kernels among inductor's loaded modules (under TORCHINDUCTOR_FORCE_DISABLE_CACHES "
                 "the listing comes out empty: recompile in a fresh TORCHINDUCTOR_CACHE_DIR instead, ar_timeline.py --fresh-cache)")
        print(f"inductor's kernels: not listed: {error}")
        return {"error": error}
    report_kernels(kernels)
    sources = out / "inductor_kernels"
    sources.mkdir(parents=True, exist_ok=True)
    for row in kernels:
        (sources / f"{row['graph']}-{Path(row['wrapper']).stem[:12]}-{row['kernel'][:150]}.py").write_text(row.pop("source"))
    return kernels


def fresh_inductor_cache() -> str:
    """Point inductor at a new empty cache directory, before anything compiles, so this process
    generates and tunes every kernel anew (coordinate descent's picks are cached beside the kernels):
    the way to compare inductor's choices between compiles. Returns the directory."""
    import os
    import tempfile

    path = tempfile.mkdtemp(prefix="inductor-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    print(f"inductor's cache: {path} (fresh)")
    return path


def report(label: str, result: dict) -> None:
    from benchmarks.common import print_table

    print(f"{label}: {result['steps']} steps, median span {result['span_us']:.1f} us; parts (us): {result['parts_us']}")
    for kind, layer in result["layers"].items():
        rows = layer["rows"]
        total = sum(r["exposed_us"] for r in rows)
        print(f"{kind} layers ({layer['per_step']} a step, the irregular ones apart): {total:.1f} us exposed each, "
              f"{total * layer['per_step']:.1f} a step (medians per position)")
        print_table(["pos", "kernel", "duration us", "exposed us", "gap us"],
                    [[r["position"], r["name"], r["duration_us"], r["exposed_us"], r["gap_us"]] for r in rows])


def main() -> None:
    import torch

    from benchmarks.bench_runner import config_variant, split_variants
    from benchmarks.common import env_info, write_json
    from hybridspec.shapes import build_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/ar_timeline")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=24, help="decoded tokens under the profiler")
    parser.add_argument("--skip", type=int, default=4, help="profiled steps dropped at the start")
    parser.add_argument("--layer-end", default=LAYER_END, help="regex of the last kernel but one of a layer")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="compile and tune inductor's kernels anew in an empty TORCHINDUCTOR_CACHE_DIR (its "
                             "configs still listed, which TORCHINDUCTOR_FORCE_DISABLE_CACHES prevents)")
    parser.add_argument("--variants", default="",
                        help="after the default, the timeline under each of these ';'-separated kernel config "
                             "variants, bench_runner's --split-variants form, e.g. 'linear:out_split_k=1;moe:down_block_h=32' "
                             "(one process, same weights)")
    args = parser.parse_args()
    if args.fresh_cache:
        fresh_inductor_cache()
    variants = split_variants(args.variants, "--variants")
    info = env_info()
    print(info)
    print(f"acceptance: {ACCEPTANCE}")
    model = build_target("qwen3.6-35b-a3b")
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    result = dict(env=info, acceptance=ACCEPTANCE, prompt=args.prompt, **timeline(model, prompt, args))
    report("default", result)
    result["variants"] = []
    for kind, changes in variants:
        with config_variant(kind, changes):
            row = dict(kind=kind, variant=changes, **timeline(model, prompt, args))
        result["variants"].append(row)
        report(f"{kind}: " + ",".join(f"{k}={v}" for k, v in changes.items()), row)
    try:
        result["inductor_kernels"] = kernel_listing(Path(args.out))
    finally:
        # whatever the listing does, the timeline reaches the disk
        write_json(Path(args.out) / "ar_timeline.json", result)


if __name__ == "__main__":
    main()
