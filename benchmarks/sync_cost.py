"""What one dependency costs on this GPU: a PDL edge between kernels against a flag between the
programs of one persistent kernel (docs/ar-step-levers.md, "What the field reports for the first
route": the first measurement a per-layer persistent kernel needs).

The AR step is ~13 kernels a layer, and every link of its chain costs ~2-2.6 us on an H100 beyond
the work in it (the ledger's timeline). A persistent kernel would replace each link by a flag in
global memory. Three micro-measurements, each inside a CUDA graph, each the slope of the time over
the count (so the graph launch, the flag's reset and the first kernel's start fall out):

- `edge`: N dependent launches of a tiny kernel (each program adds one to its slot: `1` program
  or `P` = one per SM), with programmatic dependent launch (`pdl_enter`, as every kernel of ours)
  and without it. Per edge: what a link of today's chain costs at the least.
- `hop`: one launch of P programs passing one flag round: hop h is done by program h mod P, which
  spins until the flag reads h (acquire, GPU scope) and sets h + 1 (release). Per hop: a one-to-one
  hand-over between two SMs.
- `barrier`: one launch of P programs, R rounds of all of them adding one to a counter (release)
  and spinning until it reaches P (r + 1) (acquire). Per round: an all-to-all hand-over, what a
  layer step whose every consumer needs every producer's output would pay.

Acceptance: not applicable (no drafts, no model). Every program of the persistent kernels must be
resident at once, so P is the number of SMs and each program is one warp; the kernels check their
own end state (the flag and the counter) before anything is reported. A program that has spun
`MAX_SPINS` loads in all gives up and raises an error flag instead of hanging the GPU (another
process on the card, or a grid larger than can be resident), and the run stops with that error.

    python benchmarks/sync_cost.py [--out bench_out/sync_cost]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridspec.ops.dispatch import pdl_launch, use_pdl  # noqa: E402
from hybridspec.ops.pdl_triton import pdl_enter  # noqa: E402

ACCEPTANCE = "not applicable (no drafts, no model)"
# acquire loads a program may spin in all before it gives up (~0.5-1 us each: seconds, against the
# microseconds a wait of a resident grid takes)
MAX_SPINS = 1 << 22
# the counts whose slope is reported; the larger ones make the reset and the launch a small part
EDGES = (64, 256)
HOPS = (1024, 8192)
ROUNDS = (64, 512)


@triton.jit
def _edge_kernel(buf_ptr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    tl.store(buf_ptr + pid, tl.load(buf_ptr + pid) + 1)


@triton.jit
def spin_until(ptr, target, budget, EXACT: tl.constexpr):
    """Acquire loads of `*ptr` (GPU scope) until it equals `target` (EXACT) or reaches it, at most
    `budget` more. Returns the budget left, or -1 where it ran out first; a later call with a
    negative budget loads once, so a program that gave up passes its other waits at once."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    if EXACT:
        while (seen != target) & (budget > 0):
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            budget -= 1
        ok = seen == target
    else:
        while (seen < target) & (budget > 0):
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            budget -= 1
        ok = seen >= target
    return tl.where(ok, budget, -1)


@triton.jit
def report_gave_up(budget, err_ptr):
    if budget < 0:
        tl.atomic_xchg(err_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def _hop_kernel(flag_ptr, err_ptr, hops, spins):
    pid = tl.program_id(0)
    budget = spins
    for h in range(pid, hops, tl.num_programs(0)):
        budget = spin_until(flag_ptr, h, budget, True)
        tl.atomic_xchg(flag_ptr, h + 1, sem="release", scope="gpu")
    report_gave_up(budget, err_ptr)


@triton.jit
def _barrier_kernel(count_ptr, err_ptr, rounds, spins):
    programs = tl.num_programs(0)
    budget = spins
    for r in range(rounds):
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        budget = spin_until(count_ptr, programs * (r + 1), budget, False)
    report_gave_up(budget, err_ptr)


def check_waits(err: torch.Tensor, what: str) -> None:
    """Stop where a program of `what` gave up waiting (`err` set by `report_gave_up`)."""
    if int(err.item()):
        raise SystemExit(f"{what}: a program gave up waiting after {MAX_SPINS} loads, so not every program "
                         "was resident at once (another process on the GPU?); its figures would be wrong")


def edges(buf: torch.Tensor, n: int, pdl: bool) -> None:
    """`n` dependent launches over `buf`'s slots (one program per slot)."""
    on = pdl and use_pdl(buf)
    for _ in range(n):
        _edge_kernel[(buf.numel(),)](buf, USE_PDL=on, num_warps=1, **pdl_launch(on))


def hops(flag: torch.Tensor, programs: int, n: int, err: torch.Tensor, spins: int = MAX_SPINS) -> None:
    """One launch of `programs` programs passing the flag `n` times (the flag reset first); `err`
    (int32, one element) is set where a program gave up waiting."""
    from benchmarks.common import check_resident

    check_resident(programs, flag)
    flag.zero_()
    _hop_kernel[(programs,)](flag, err, n, spins, num_warps=1)


def barriers(count: torch.Tensor, programs: int, n: int, err: torch.Tensor, spins: int = MAX_SPINS) -> None:
    """One launch of `programs` programs meeting `n` times at a counter (reset first); `err` as in
    `hops`."""
    from benchmarks.common import check_resident

    check_resident(programs, count)
    count.zero_()
    _barrier_kernel[(programs,)](count, err, n, spins, num_warps=1)


def slope_us(run, counts: tuple[int, int]) -> tuple[float, list[float]]:
    """Per-unit microseconds: the difference of the graphs' times over the difference of counts."""
    from benchmarks.common import capture, time_ms

    times = []
    for n in counts:
        graph = capture(lambda n=n: run(n))
        times.append(time_ms(graph.replay, replays=10, samples=30))
    return (times[1] - times[0]) * 1e3 / (counts[1] - counts[0]), times


def main() -> None:
    from benchmarks.common import print_table, start_gpu_run, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/sync_cost")
    args = parser.parse_args()
    info = start_gpu_run("sync_cost.py", ACCEPTANCE)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for programs in (1, sms):
        for pdl in (True, False):
            buf = torch.zeros(programs, dtype=torch.int32, device="cuda")
            us, times = slope_us(lambda n: edges(buf, n, pdl), EDGES)
            rows.append(dict(kind="edge", programs=programs, pdl=pdl and use_pdl(buf), counts=EDGES, graph_ms=times, us_each=us))
    flag, err = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2))
    us, times = slope_us(lambda n: hops(flag, sms, n, err), HOPS)
    torch.cuda.synchronize()
    check_waits(err, "the hop kernel")
    if int(flag.item()) != HOPS[1]:
        raise SystemExit(f"the hop kernel ended with the flag at {int(flag.item())}, not {HOPS[1]}")
    rows.append(dict(kind="hop", programs=sms, pdl=False, counts=HOPS, graph_ms=times, us_each=us))
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    us, times = slope_us(lambda n: barriers(count, sms, n, err), ROUNDS)
    torch.cuda.synchronize()
    check_waits(err, "the barrier kernel")
    if int(count.item()) != sms * ROUNDS[1]:
        raise SystemExit(f"the barrier kernel ended with the counter at {int(count.item())}, not {sms * ROUNDS[1]}")
    rows.append(dict(kind="barrier", programs=sms, pdl=False, counts=ROUNDS, graph_ms=times, us_each=us))
    print_table(["what", "programs", "PDL", "counts", "graph ms", "us each"],
                [[r["kind"], r["programs"], r["pdl"], r["counts"], [round(t, 4) for t in r["graph_ms"]], r["us_each"]]
                 for r in rows])
    write_json(Path(args.out) / "sync_cost.json", dict(env=info, acceptance=ACCEPTANCE, sms=sms, rows=rows))


if __name__ == "__main__":
    main()
