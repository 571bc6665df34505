"""HybridSpec on a tensor-parallel target: the same `generate(..., assistant_model=drafter,
hybridspec=True)` call in every rank of a `torchrun` job (docs/design.md, "Tensor parallelism").

    # both tiny families sharded over two CPU processes (gloo), checked against the unsharded model
    torchrun --nproc-per-node 2 examples/tp_generate.py --tiny --device cpu
    # one GPU, world size 1 on NCCL: the sharded path, its collectives and the CUDA graphs
    torchrun --nproc-per-node 1 examples/tp_generate.py --tiny --device cuda
    # the Qwen3.5-122B-A10B shape, random bf16 weights drawn shard by shard on the GPUs: AR,
    # vanilla DFlash and HybridSpec timed (simulated, forced acceptance)
    torchrun --nproc-per-node 2 examples/tp_generate.py --shape qwen3.5-122b-a10b --device cuda
    # the same, reduced to run anywhere (a dry run of the sharded build and the benchmark loop)
    torchrun --nproc-per-node 2 examples/tp_generate.py --shape qwen3.5-122b-a10b --device cpu --layers 4 --scale 16

`--tiny` loads the target as users do, `from_pretrained(DIR, distributed_config=
DistributedConfig(tp_plan="auto"))` (rank 0 saves it first); at world size 1 transformers applies no
plan, so there the script shards the loaded model itself with the model's own plan
(`hybridspec.sharding.shard`). It prints, from rank 0, `identical to target-only greedy: True`
(against the unsharded model's greedy output computed here), that every rank chose the same
verification lengths, and a seeded sample drawn twice (the digest line repeats across invocations
with the same --seed). It exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

import hybridspec

FAMILIES = ("qwen3_5_moe", "qwen3_next")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--tiny", action="store_true", help="the tiny fp32 targets, checked against their unsharded greedy")
    what.add_argument("--shape", choices=["qwen3.5-122b-a10b", "qwen3.6-35b-a3b"],
                      help="a full-size shape with random bf16 weights, benchmarked (simulated, forced acceptance)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--family", choices=FAMILIES, action="append", help="--tiny: the families to run (default: both)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens to generate (default: 48 tiny, 256 shape)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling run (every rank alike)")
    p.add_argument("--layers", type=int, default=None, help="--shape: keep only the first layers")
    p.add_argument("--scale", type=int, default=1, help="--shape: divide the hidden size and widths (dry runs)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="--shape: random prompt length")
    p.add_argument("--repeats", type=int, default=3, help="--shape: timed passes per method (median)")
    p.add_argument("--out", default=None, help="--shape: write the results as JSON here (rank 0)")
    return p.parse_args()


def setup(device: str) -> tuple[torch.device, int, int]:
    """The process group of the job: gloo on CPU, NCCL on GPU bound to this rank's device (its
    communicator is created here, before any CUDA graph is captured)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
        # tiny models on few cores: one thread per process
        torch.set_num_threads(1)
    return dev, rank, world


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def agree(value) -> bool:
    """Whether every rank holds the same `value` (any picklable object)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def mesh_of(device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def load_sharded(family: str, device: torch.device):
    """The tiny target of `family`, sharded by transformers' tensor-parallel plan, and its unsharded twin."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    from hybridspec.sharding import shard
    from hybridspec.tiny import tiny_next_target, tiny_target

    build = tiny_target if family == "qwen3_5_moe" else tiny_next_target
    unsharded = build(seed=0).to(device)
    if dist.get_world_size() == 1:
        # transformers applies no plan at a TP size of 1: shard with the model's own plan here
        return shard(build(seed=0).to(device), mesh_of(device)), unsharded
    path = [tempfile.mkdtemp(prefix="hybridspec-tp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if dist.get_rank() == 0:
        unsharded.save_pretrained(path[0])
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path[0], dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_plan="auto"))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0])
    return model.eval(), unsharded


def run_tiny(args, device) -> bool:
    from hybridspec.runner.decode import runner_of
    from hybridspec.sim.replay import DeviceReplayDrafter
    from hybridspec.tiny import tiny_drafter

    ok = True
    new = args.new_tokens or 48
    prompt = torch.tensor([[1, 17, 33, 64, 5, 90, 12, 7]], device=device)
    for family in args.family or FAMILIES:
        model, unsharded = load_sharded(family, device)
        reference = unsharded.generate(prompt, max_new_tokens=new, do_sample=False)
        # the drafter is replicated: the same seeded weights on every rank
        drafter = tiny_drafter(seed=0).to(device)
        hybridspec.enable(model)
        out = model.generate(prompt, assistant_model=drafter, hybridspec=True, max_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True)
        stats = out.hybridspec_stats
        same = torch.equal(out.sequences, reference)
        lengths = agree(stats.verify_lengths)
        # the greedy call's runner (the calls below build their own)
        captured = runner_of(model).captured
        # a random drafter is almost never right; the replay drafter proposes the target's own
        # continuation with drawn mistakes (simulated acceptance), so rounds keep several drafts
        replay = DeviceReplayDrafter(drafter, reference[0, prompt.shape[1]:])
        torch.manual_seed(args.seed)
        replayed = model.generate(prompt, assistant_model=replay, hybridspec=True, max_new_tokens=new,
                                  do_sample=False, return_dict_in_generate=True)
        same_replayed = torch.equal(replayed.sequences, reference)
        lengths &= agree(replayed.hybridspec_stats.verify_lengths)
        samples = []
        for _ in range(2):
            torch.manual_seed(args.seed)
            samples.append(model.generate(prompt, assistant_model=drafter, hybridspec=True, max_new_tokens=new,
                                          do_sample=True, temperature=0.8, top_p=0.95)[0, prompt.shape[1]:].tolist())
        digest = hashlib.sha1(json.dumps(samples[0]).encode()).hexdigest()[:12]
        reproducible, ranks_agree = samples[0] == samples[1], agree(samples[0])
        # ranks seeded differently would draw different tokens: the call refuses before any work
        refused = True
        if dist.get_world_size() > 1:
            torch.manual_seed(args.seed + dist.get_rank())
            try:
                model.generate(prompt, assistant_model=drafter, hybridspec=True, max_new_tokens=2, do_sample=True)
                refused = False
            except ValueError as e:
                refused = "same random state on every rank" in str(e)
        say(f"{family} on {dist.get_world_size()} rank(s), {device.type}, "
            f"{'graphs captured' if captured else 'eager runner'}:")
        say(f"  {stats.rounds} rounds for {new} tokens, mean acceptance length {stats.mean_acceptance_length:.2f}")
        say(f"  identical to target-only greedy: {same}")
        say(f"  with a replay drafter (simulated acceptance, mean acceptance length "
            f"{replayed.hybridspec_stats.mean_acceptance_length:.2f}): identical to target-only greedy: {same_replayed}")
        say(f"  verification lengths agree across ranks: {lengths} ({stats.verify_lengths[:12]} ...)")
        say(f"  sample (seed {args.seed}) reproducible: {reproducible}, the same on every rank: {ranks_agree}")
        say(f"  sample digest (seed {args.seed}): {digest} {samples[0][:12]} ...")
        if dist.get_world_size() > 1:
            say(f"  ranks seeded differently: sampling refused: {refused}")
        ok &= same and same_replayed and lengths and reproducible and ranks_agree and refused
        if device.type == "cuda":
            ok &= captured
        hybridspec.disable(model)
    return ok


def run_shape(args, device) -> bool:
    from hybridspec.parallel import local
    from hybridspec.runner import Runner
    from hybridspec.shapes import build_drafter, build_target
    from hybridspec.sim.forced import ForcedAcceptance
    from hybridspec.sim.replay import DeviceReplayDrafter

    new = args.new_tokens or 256
    t0 = time.perf_counter()
    mesh = mesh_of(device)
    model = build_target(args.shape, device, num_layers=args.layers, mesh=mesh, scale=args.scale)
    replay = DeviceReplayDrafter(build_drafter(args.shape, device, num_layers=args.layers, scale=args.scale),
                                 torch.zeros(0, dtype=torch.long))
    replay.bind(model)
    forced = ForcedAcceptance(replay)
    hybridspec.enable(model)
    local_gb = sum(local(p).numel() * p.element_size() for p in model.parameters()) / 1e9
    say(f"{args.shape} (layers {args.layers or 'all'}, scale 1/{args.scale}), random bf16 weights, "
        f"{dist.get_world_size()} rank(s): {local_gb:.1f} GB of weights per rank, built in {time.perf_counter() - t0:.0f} s")
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(args.seed)).to(device)
    capacity = 1 << (args.prompt_tokens + new - 1).bit_length()
    ar = Runner(model, capacity=capacity)
    ar.generate(prompt, 8)

    def timed_ar():
        out, stats = ar.generate(prompt, new)
        return out[0, prompt.shape[1]:], stats.decode_seconds, None

    continuation = timed_ar()[0]
    replay.continuation = continuation

    def speculative(**kwargs):
        def call(n):
            torch.manual_seed(args.seed)
            return model.generate(prompt, assistant_model=replay, hybridspec=True, hybridspec_accept=forced,
                                  max_new_tokens=n, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                                  **kwargs)
        call(8)

        def timed():
            out = call(new)
            return out.sequences[0, prompt.shape[1]:], out.hybridspec_stats.decode_seconds, out.hybridspec_stats
        return timed

    methods = {"AR (ours)": timed_ar, "vanilla DFlash (w=16)": speculative(verify_length=16),
               "HybridSpec": speculative()}
    seconds = {name: [] for name in methods}
    last = {}
    # repeats interleaved across methods: load on the machine lands on every row alike
    for _ in range(args.repeats):
        for name, fn in methods.items():
            tokens, secs, stats = fn()
            seconds[name].append(secs)
            last[name] = (tokens, stats)
    rows = []
    ar_rate = (new - 1) / statistics.median(seconds["AR (ours)"])
    for name, secs in seconds.items():
        rate = (new - 1) / statistics.median(secs)
        stats = last[name][1]
        rows.append(dict(method=name, tokens_per_s=rate, speedup_vs_ar=rate / ar_rate, seconds=secs,
                         mean_acceptance_length=None if stats is None else stats.mean_acceptance_length,
                         mean_w=None if stats is None else statistics.mean(stats.verify_lengths)))
    say(f"decode tokens/s, {new} new tokens after a {args.prompt_tokens}-token prompt, median of {args.repeats} "
        "(simulated acceptance: forced, replay drafter, synthetic draws):")
    for r in rows:
        extra = "" if r["mean_acceptance_length"] is None else \
            f"  mean acceptance {r['mean_acceptance_length']:.2f}, mean w {r['mean_w']:.1f}"
        say(f"  {r['method']:<24} {r['tokens_per_s']:8.1f} tok/s  {r['speedup_vs_ar']:.2f}x AR{extra}")
    ok = all(agree(last[name][0].tolist()) for name in methods)
    say(f"every rank emitted the same tokens: {ok}")
    ar.release()
    hybridspec.disable(model)
    if args.out and dist.get_rank() == 0:
        env = dict(world_size=dist.get_world_size(), device=torch.cuda.get_device_name(device) if device.type == "cuda"
                   else "cpu", torch=torch.__version__, transformers=__import__("transformers").__version__)
        result = dict(shape=args.shape, layers=args.layers, scale=args.scale, prompt_tokens=args.prompt_tokens,
                      new_tokens=new, acceptance="simulated: forced, replay drafter, synthetic draws", rows=rows, **env)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return ok


def main() -> None:
    args = parse()
    device, rank, _ = setup(args.device)
    if rank != 0:
        # every rank makes the same calls: rank 0 says what needs saying
        warnings.simplefilter("ignore")
    ok = run_tiny(args, device) if args.tiny else run_shape(args, device)
    # NCCL destroys a communicator only once every CUDA graph that captured one of its collectives
    # is gone (pytorch/pytorch#115388): the runs above released their runners' graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
