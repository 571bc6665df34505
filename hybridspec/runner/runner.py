"""`Runner`: static buffers, captured steps and the host loop of the fast path (issue 6).

A runner owns one request slot of `batch_size` rows (1, 2 or 4; a batch of 3 runs as 4), each sized
for `capacity` positions: the verification state (KV
buffers, the GDN state buffer, conv windows, round factors), the drafter's context, and the
round's I/O buffers. Its step (a `hybridspec.round.Round`, or `ar_step` without a drafter) is
captured once as a CUDA graph. Per request the host runs transformers' prefill (eager), copies
the cache into the static buffers, then replays the step; after each replay it queues a copy of
the round's output into a pinned ring and reads round r - 1 while round r runs, so it never waits
on the round it just launched. Stopping is decided on the host from those tokens; a round that was
already running when the stop was seen is discarded, so the returned tokens are exactly those of
target-only decoding.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from hybridspec.cache import compiled_copy, compiled_once
from hybridspec.drafter.protocol import CompilableDrafter, DeviceDrafter
from hybridspec.ops.dispatch import layer_options
from hybridspec.parallel import model_group
from hybridspec.patches.forward import EAGER, Blocks, empty_state
from hybridspec.round.accept import process_positions
from hybridspec.round.cond import CondVerify
from hybridspec.round.emit import emit
from hybridspec.round.prefill import start
from hybridspec.round.round import Round, Sampler, ar_step, fused_head_applies
from hybridspec.round.stats import HybridSpecStats, device_time
from hybridspec.round.stopping import HostStopping
from hybridspec.round.target import Target
from hybridspec.runner.graphs import CapturedStep
from hybridspec.runner.io import EMPTY_COL, EXTRA, L0_COL, M, W0_COL, W_COL, RoundIO, write_outputs
from hybridspec.state import MAX_VERIFY, commit_buffers

# rounds in flight before the host reads one back
LAG = 1
RING = 4


class Runner:
    """The fast path for one target (and drafter), for batches of `batch_size` rows.

    `drafter`: a `DeviceDrafter` (`hybridspec.drafter.protocol`, e.g. `DFlashDrafter`) or None for
    autoregressive decoding. `policy`: a `hybridspec.policy.Policy` (ignored without a drafter).
    `capacity`: the longest sequence (prompt + output) a request may reach.
    `enforce_eager`: run the step without CUDA graphs (always so on the CPU). `compile`: compile
    each decoder-layer kind once with `torch.compile` (fusing its elementwise work) before capture,
    the drafter's layers too where it is a `CompilableDrafter`, and the step's commit and output
    writes (`HybridState.commit_fn`, `RoundIO.finish_fn`); default on when graphs are captured.
    `fused_head`: greedy calls without warpers take each position's argmax from the fused LM-head
    top-1 (`hybridspec.ops.lm_head_top1`: one pass over the head's weight, no logits) instead of
    the logits; on by default (the AR step 3.179 against 3.195 ms on the H200, docs/benchmarks.md;
    `benchmarks/bench_runner.py --no-fused-head` times it off). Sampling, warpers and a sharded
    head always score the logits. `compile_front`: compile the round's stages between the drafts and
    the verification (`hybridspec.round.round.front`: the length choice, Stage 0, the routing
    correction) as one region (an AR runner has no front: ignored without a drafter). On the H200 a
    round took 0.13-0.15 ms less with it under fixed lengths and the uncalibrated policy
    (`benchmarks/bench_runner.py` times the round both ways) and 0.26 ms less in calibration's
    rounds, whose policy adds the routing correction (docs/benchmarks.md, "The compiled front"),
    both measured before Stage 0's Layer 0 ran on the compiled layer blocks; since it does, the
    front's compilation saves 0.02 ms a round (4.56 against 4.58 ms at w = 1). Off by default: that
    is less than the seconds each runner would spend compiling its own front when it is captured (a
    runner is built per policy, sampler and capacity).

    `dispatch="cond"` (needs a drafter) verifies each round's w rows in per-length `torch.cond`
    branches (`hybridspec/round/cond.py`) instead of the default fixed 16-row graph. Such a step
    is never captured (torch 2.11 cannot put `torch.cond` in a CUDA graph) nor compiled by inductor
    (see `CondVerify`): dynamo traces the branches and runs them as traced. Kept as a tested,
    measured alternative: the fixed graph is faster (docs/benchmarks.md)."""

    def __init__(self, model, drafter: DeviceDrafter | None = None, policy=None, *, capacity: int,
                 sampler: Sampler | None = None, enforce_eager: bool = False, compile: bool | None = None,
                 dispatch: str = "fixed", batch_size: int = 1, fused_head: bool = True,
                 compile_front: bool = False):
        if dispatch not in ("fixed", "cond"):
            raise ValueError(f"dispatch must be 'fixed' or 'cond', got {dispatch!r}")
        if dispatch == "cond" and drafter is None:
            raise ValueError("dispatch='cond' picks a verification length per round; autoregressive decoding "
                             "(no drafter) has only w = 1")
        if dispatch == "cond" and model_group(model) is not None:
            raise ValueError("dispatch='cond' is not supported on a tensor-parallel model: its per-length branches "
                             "would hold collectives, which torch.cond is not tested with; use the default 'fixed'")
        if dispatch == "cond" and compile:
            raise ValueError("dispatch='cond' runs its branches as dynamo traced them: inductor cannot compile "
                             "custom ops that write into their arguments inside torch.cond (torch 2.11)")
        if drafter is not None and not isinstance(drafter, DeviceDrafter):
            raise TypeError(f"the runner captures its drafter in the round: {type(drafter).__name__} is not a "
                            "DeviceDrafter (hybridspec.drafter.protocol)")
        if dispatch == "cond" and compile_front:
            raise ValueError("dispatch='cond' runs its rounds as dynamo traced them; compile_front needs the fixed graph")
        if dispatch == "cond" and batch_size != 1:
            raise ValueError("dispatch='cond' dispatches on one row's length: batch size 1 only")
        if dispatch == "cond":
            enforce_eager = True
        self.batch_size = B = batch_size
        self.model, self.drafter, self.policy = model, drafter, policy
        self.sampler = sampler or Sampler(do_sample=False)
        self.capacity = capacity
        self.width = drafter.block_size if drafter is not None else 1
        # rounds launched past the stop still write up to `width` rows each
        self.rows = rows = capacity + (LAG + 1) * MAX_VERIFY
        graphs = not enforce_eager and model.get_output_embeddings().weight.device.type == "cuda"
        self.compiled = graphs if compile is None else compile
        taps = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self.target = Target(model, taps, compiled_once(Blocks, layer_options()) if self.compiled else EAGER)
        self.device = self.target.device
        self.state = empty_state(self.target.family, model, B, rows, self.device)
        if drafter is not None:
            drafter.reset(B, rows)
        self._compile_drafter()
        self.io = RoundIO.allocate(self.width, self.device, B)
        if self.compiled:
            # the step's bookkeeping after the head (the commit's conv windows and lengths, the
            # outputs for the host) as two compiled regions instead of about 18 eager kernels
            self.state.commit_fn = compiled_copy(commit_buffers, layer_options())
            self.io.finish_fn = compiled_copy(write_outputs, layer_options())
        self.round = None
        if drafter is not None:
            self.round = Round(self.target, self.state, drafter, policy, self.sampler, fused_head=fused_head,
                               compile_front=compile_front)
            if dispatch == "cond":
                self.round.cond = CondVerify(self.target.family, model, self.state, taps, drafter.block_size,
                                             self.round.two_stage)
        # the AR step's own decision (a Round makes its own): decided once, not per step
        self.fused_head = fused_head and fused_head_applies(self.sampler, self.target)
        self._step_fn = self._spec_step if drafter is not None else self._ar_step
        self._enforce_eager = enforce_eager
        self.step = CapturedStep(self._step_fn, self.device, enforce_eager)
        self._captured_at = self._pointers()
        pinned = self.device.type == "cuda"
        self.ring = torch.zeros(RING, B, self.width + EXTRA, dtype=torch.long, pin_memory=pinned)
        # views made once: each view costs microseconds of host time per round
        self._ring_rows = list(self.ring.unbind(0))
        self._out_row = self.io.out
        # timing events: the host waits on them and `HybridSpecStats.round_seconds` reads the device
        # time between consecutive rounds' ends from them (`_started` marks the decode's start)
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(RING)] if pinned else None
        self._started = torch.cuda.Event(enable_timing=True) if pinned else None

    def _spec_step(self) -> None:
        io = self.io
        r = self.round(io.anchor, io.budget, self.sampler.process)
        io.finish(r.tokens, r.accepted, r.w, r.w0, r.empty, r.layer0)

    def _ar_step(self) -> None:
        io = self.io
        tokens, accepted, empty = ar_step(self.target, self.state, io.anchor, self.sampler, self.fused_head)
        one = accepted + 1
        io.finish(tokens, accepted, one, one, empty, torch.full_like(one, -1))

    def _compile_drafter(self) -> None:
        # set again per request: a drafter shared with another runner may have been switched
        if isinstance(self.drafter, CompilableDrafter):
            self.drafter.compile_layers(self.compiled)

    def _pointers(self) -> list[int]:
        """Addresses of everything a captured step reads besides the runner's own buffers: the
        model's parameters and buffers (fused weights included) and the drafter's static buffers."""
        model = self.model
        ptrs = [t.data_ptr() for t in model.parameters()] + [t.data_ptr() for t in model.buffers()]
        if self.drafter is not None:
            ptrs += [t.data_ptr() for t in self.drafter.static_buffers()]
        return ptrs

    @property
    def captured(self) -> bool:
        return self.step.captured

    def release(self) -> None:
        """Drop the captured graph and the static buffers (what `hybridspec.disable` calls)."""
        self.step = self.round = self.state = self.io = self.ring = self._ring_rows = self._out_row = None

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, logits_processor=None, attention_mask: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill `input_ids` `[B, P]` (left-padded with `attention_mask` and transformers'
        `position_ids`, or unpadded) and load the static buffers. Returns the first tokens `[B, 1]`
        and their processed scores `[B, V]` (transformers' processors at the prompt's last position)."""
        B = self.batch_size
        if input_ids.shape[0] != B:
            raise ValueError(f"this runner decodes batches of {B}; got input_ids {tuple(input_ids.shape)}")
        P = input_ids.shape[1]
        if P >= self.capacity:
            raise ValueError(f"a prompt of {P} tokens does not fit a runner of capacity {self.capacity}")
        # re-link fused projections whose weights were replaced since the last call
        self.target.refuse()
        if self.drafter is not None:
            self.drafter.reset(B, self.rows)
            self._compile_drafter()
        pointers = self._pointers()
        if pointers != self._captured_at:
            # something the graph reads moved since the capture (a weight replaced or converted, a
            # fused weight restacked, the drafter's context reallocated by another call): capture
            # again, or the graph would read the old memory; `start` below clears what the warm-up left
            self.step = CapturedStep(self._step_fn, self.device, self._enforce_eager)
            self._captured_at = pointers
        if logits_processor is not None:
            def process(logits, drafts):
                return process_positions(logits_processor, input_ids, drafts, logits)
        else:
            process = self.sampler.process
        first, processed, _ = start(self.target, self.state, self.drafter, input_ids, process, self.sampler, self.rows,
                                    attention_mask, position_ids)
        self.io.anchor.copy_(first)
        return first, processed

    def start_timed(self, input_ids: torch.Tensor, logits_processor=None, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None) -> tuple[list[int], float]:
        """`start`, then the host's read of the first tokens, which waits for the prefill. Returns the
        first tokens (one per row) and the seconds from the call to that read: the time to the
        first token (`HybridSpecStats.prefill_seconds`)."""
        started = device_time(input_ids.device)
        first, _ = self.start(input_ids, logits_processor, attention_mask, position_ids)
        tokens = first[:, 0].tolist()
        return tokens, time.perf_counter() - started

    @torch.no_grad()
    def decode(self, prompt_length: int, first: int, stop: HostStopping, on_tokens=None) -> tuple[list[int], HybridSpecStats]:
        """Rounds after `start` (batch one) until `stop` says so. Returns the emitted tokens after the
        prompt (`first` included) and per-round statistics. `on_tokens(list)` sees each round's tokens."""
        rows, stats = self.decode_batch(prompt_length, [first], stop, on_tokens)
        return rows[0], stats

    @torch.no_grad()
    def decode_batch(self, prompt_length: int, first: list[int], stop: HostStopping, on_tokens=None,
                     live: int | None = None) -> tuple[list[list[int]], HybridSpecStats]:
        """Rounds after `start` until every row has stopped (`stop`, per row). Returns each row's
        emitted tokens after the (padded) prompt, `first` included, and per-round statistics. A
        row that stops keeps running on the device without budget (it commits nothing). `live`:
        the rows that count (a batch of 3 runs as 4; the filler row is stopped from the start)."""
        live = len(first) if live is None else live
        out, stats = [[t] for t in first], HybridSpecStats()
        done = [b >= live or stop(prompt_length + 1, t) for b, t in enumerate(first)]
        if all(done):
            return out, stats
        started = last_read = time.perf_counter()
        self.io.budget.fill_(stop.max_length - prompt_length - 1)
        self._retire(done)
        if self._started is not None:
            # after the budget writes: the device is idle here (the host has just read the first
            # tokens), so anything enqueued between this event and the first replay counts in the
            # first round's time
            self._started.record()
        pending: deque[int] = deque()
        launched = 0
        while True:
            t0 = time.perf_counter()
            self.step()
            stats.replay_seconds.append(time.perf_counter() - t0)
            slot = launched % RING
            self._ring_rows[slot].copy_(self._out_row, non_blocking=True)
            if self.events is not None:
                self.events[slot].record()
            pending.append(slot)
            launched += 1
            lag = LAG if self.events is not None else 0
            if len(pending) <= lag:
                continue
            slot = pending.popleft()
            t1 = time.perf_counter()
            if self.events is not None:
                self.events[slot].synchronize()
            t2 = time.perf_counter()
            table = self._ring_rows[slot].tolist()
            if self.events is not None:
                # rounds are read in launch order, so the round before this one ended at the event
                # of the slot before it (the decode's start for the first)
                before = self._started if stats.rounds == 0 else self.events[(slot - 1) % RING]
                seconds = before.elapsed_time(self.events[slot]) / 1e3
            else:
                # no events (CPU): the host's read waited for the round, so its clock times it
                now = time.perf_counter()
                seconds, last_read = now - last_read, now
            self._read(table, prompt_length, out, done, stats, stop, on_tokens, seconds, live)
            stats.host_seconds.append((t1 - t0) + (time.perf_counter() - t2))
            if all(done):
                if self.events is not None:
                    torch.cuda.synchronize(self.device)
                stats.decode_seconds, stats.launched = time.perf_counter() - started, launched
                return out, stats

    def _retire(self, done: list[bool]) -> None:
        """Rows that stopped get no more budget: from the next launched round on they commit
        nothing, and the batched length choice no longer counts them (a write between replays)."""
        # a fill per row, not a mask copied from the host: that copy from pageable memory would
        # wait for the round in flight and lose the one-round overlap
        for b, stopped in enumerate(done):
            if stopped:
                self.io.budget[b : b + 1].zero_()

    def _read(self, table, prompt_length, out, done, stats, stop, on_tokens, seconds: float, live: int) -> None:
        w, w0, layer0 = (table[0][self.width + c] for c in (W_COL, W0_COL, L0_COL))
        # full: every live row still emitting, with budget (the device's, which the host mirrors)
        # for all w tokens
        full = all(not done[b] and stop.max_length - prompt_length - len(out[b]) >= w for b in range(live))
        kept_rows, newly = [], [False] * len(done)
        for b, row in enumerate(table):
            if done[b]:
                continue
            m, empty = row[self.width + M], row[self.width + EMPTY_COL]
            new = []

            def take(i, token, b=b, new=new):
                new.append(token)
                return stop(prompt_length + len(out[b]) + len(new), token)

            kept, done[b] = emit(row[:m], empty, take)
            newly[b] = done[b]
            out[b].extend(new)
            kept_rows.append(kept)
            if on_tokens is not None:
                on_tokens(new)
        stats.record(w, w0, kept_rows, layer0, seconds=seconds, full=full)
        if any(newly):
            # only the rows that stopped in this round: the others were retired already
            self._retire(newly)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> tuple[torch.Tensor, HybridSpecStats]:
        """Plain decoding (no transformers processors, batch one): `[1, P + n]` and the statistics."""
        P = input_ids.shape[1]
        if P + max_new_tokens > self.capacity:
            raise ValueError(f"{P} prompt + {max_new_tokens} new tokens exceed the runner's capacity {self.capacity}")
        eos = set(torch.as_tensor(eos_token_id).flatten().tolist()) if eos_token_id is not None else set()
        stop = HostStopping(P + max_new_tokens, eos, [])
        first, _ = self.start(input_ids)
        tokens, stats = self.decode(P, int(first), stop)
        return torch.cat([input_ids, torch.tensor([tokens], device=input_ids.device)], dim=-1), stats
