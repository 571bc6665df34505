"""What calibration measures on the target: per-round drafts, acceptance and routing from a run
that verifies all D drafts, mean round times at fixed lengths, the Stage-0 slope and the MoE
cost per distinct expert. Times are wall-clock milliseconds (synchronised on CUDA)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from hybridspec.experts import hybridspec_experts_forward
from hybridspec.ops.routing import distinct_prefix_counts, new_expert_counts
from hybridspec.patches import family_of
from hybridspec.patches.forward import allocate_state, stage0
from hybridspec.round.stats import device_time


@dataclass
class RoundRecorder:
    """Passed to the decoding loop (`hybridspec_recorder=`): it calls `begin()` before drafting
    and `end(...)` after the round's accept stage. Keeps host copies per round."""

    device: torch.device
    num_experts: int
    confidence: list = field(default_factory=list)
    entropy: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    lengths: list = field(default_factory=list)
    stopped: list = field(default_factory=list)
    distinct_all: list = field(default_factory=list)
    new_layer0: list = field(default_factory=list)
    # Layer-0 expert ids `[w, k]` per round with routing (the batched entries' union over a batch)
    layer0_ids: list = field(default_factory=list)

    def new_call(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def end(self, block, w: int, accepted: int, routing: list | None, stopped: bool) -> None:
        self.confidence.append(block.confidence[0].float().cpu())
        self.entropy.append(block.entropy[0].float().cpu())
        self.accepted.append(accepted)
        self.lengths.append(w)
        self.stopped.append(stopped)
        if routing:
            ids = torch.stack([r[0] for r in routing])  # [layers, w, k]
            self.distinct_all.append(distinct_prefix_counts(ids, self.num_experts).sum(0).cpu())
            self.new_layer0.append(new_expert_counts(ids[0], self.num_experts).cpu())
            self.layer0_ids.append(ids[0].cpu())


def generate_rounds(model, drafter, prompts, recorder: RoundRecorder, max_new_tokens: int, verify_length: int,
                    desc: str, accept=None) -> None:
    """Greedy HybridSpec generation of every prompt at a fixed verification length, recorded.
    `prompts`: (input_ids `[1, n]`, continuation or None) pairs; a continuation is handed to a
    replay drafter before its prompt."""
    for ids, continuation in tqdm(prompts, desc=desc, leave=False):
        if continuation is not None:
            drafter.continuation = continuation
        recorder.new_call()
        model.generate(ids, assistant_model=drafter, hybridspec=True, verify_length=verify_length,
                       max_new_tokens=max_new_tokens, do_sample=False, hybridspec_recorder=recorder,
                       hybridspec_accept=accept)


def timed_round_ms(model, drafter, prompts, max_new_tokens: int, verify_length: int, desc: str,
                   accept=None) -> float:
    """Mean round time at a fixed verification length, as decoding runs it: on the CUDA-graph
    runner where the drafter allows (no recorder here, so nothing adds host work to a round). The
    first prompt only warms up (capture, compiles); the rest are timed."""
    calls = [(ids, None, continuation) for ids, continuation in prompts]
    return mean_round_ms(model, drafter, calls, desc, verify_length=verify_length, max_new_tokens=max_new_tokens,
                         hybridspec_accept=accept)


def full_round_seconds(stats, verify_length: int) -> list[float]:
    """The device seconds of `stats`' rounds that time C(`verify_length`): full rounds
    (`HybridSpecStats.full`: every row verified all w tokens) at that length. A fixed length is
    capped by the largest budget left, so near the token limit a round runs shorter, and all its
    rows may still verify all of its w: full, but not a round of the requested length."""
    return [s for s, w, full in zip(stats.round_seconds, stats.verify_lengths, stats.full) if full and w == verify_length]


def mean_round_ms(model, drafter, calls, desc: str, *, verify_length: int, **generate_kwargs) -> float:
    """Mean device time of the full rounds at `verify_length` (`full_round_seconds`) of greedy
    `generate` calls, `calls` being (input_ids, attention_mask or None, continuation or None) triples
    (a continuation is handed to a replay drafter first); the first call only warms up (capture,
    compiles) unless it is the only one. Rounds that are not full verify fewer rows (a row near its
    token limit counts only its budget, a stopped row of a batch one row, a length capped by the
    largest budget fewer for every row), so counting them makes long lengths look cheaper than they
    are (the B = 4 calibration at f82ab31, a 64-token budget, timed 14.3 ms at w = 16 where vanilla
    DFlash's rounds in the same run took 16.5). Per-round times come from the runner's events
    (device time between rounds' ends)."""
    seconds = []
    for n, (ids, mask, continuation) in enumerate(tqdm(calls, desc=desc, leave=False)):
        if continuation is not None:
            drafter.continuation = continuation
        padded = {} if mask is None else {"attention_mask": mask}
        out = model.generate(ids, assistant_model=drafter, hybridspec=True, do_sample=False,
                             return_dict_in_generate=True, verify_length=verify_length, **padded, **generate_kwargs)
        if n > 0 or len(calls) == 1:
            seconds += full_round_seconds(out.hybridspec_stats, verify_length)
    if not seconds:
        raise ValueError(f"{desc}: no timed round verified every row's {verify_length} tokens: raise the "
                         "calibration's max_new_tokens (`hybridspec calibrate --max-new-tokens`) so each call "
                         f"runs a round with {verify_length} tokens of budget left")
    return float(np.mean(seconds)) * 1e3


def capture_arrays(recorder: RoundRecorder, block_size: int) -> dict[str, np.ndarray]:
    """The capture run's per-round arrays. A round is valid (used for labels and tables) when it
    verified all `block_size` tokens and did not stop generation (EOS or the output limit)."""
    valid = np.array([w == block_size and not s for w, s in zip(recorder.lengths, recorder.stopped)])
    full = [i for i, w in enumerate(recorder.lengths) if w == block_size]
    return dict(
        confidence=torch.stack(recorder.confidence).numpy(),
        entropy=torch.stack(recorder.entropy).numpy(),
        accepted=np.array(recorder.accepted),
        valid=valid,
        # routing tables need all W tokens of a round: only full-length rounds carry them
        distinct_all=torch.stack([recorder.distinct_all[i] for i in full]).numpy() if full else np.zeros((0, block_size)),
        new_layer0=torch.stack([recorder.new_layer0[i] for i in full]).numpy() if full else np.zeros((0, block_size)),
        full_valid=valid[full] if full else np.zeros(0, dtype=bool),
        layer0_ids=[recorder.layer0_ids[i] for i in full if valid[i]],
    )


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    # in decoding, a layer's weights are long out of L2 when it runs again: evict them before each
    # timed call (256 MB > any current L2), outside the timed span
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    times = []
    for _ in range(repeats):
        if scratch is not None:
            scratch.zero_()
        start = device_time(device)
        fn()
        times.append((device_time(device) - start) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def stage0_latency(model, input_ids: torch.Tensor, lengths, repeats: int = 20) -> dict[int, float]:
    """Stage-0 time (embedding, Layer-0 GDN, Layer-0 router) for u tokens after a prompt, per u.
    Nothing is committed, so every call sees the same state."""
    from hybridspec.round.prefill import prefill

    family = family_of(model)
    _, cache, _ = prefill(model, input_ids, ())
    state = allocate_state(family, model, cache, input_ids.shape[1] + 32)
    tokens = input_ids[:, -1:].expand(1, max(lengths)).contiguous()
    return {u: _median_ms(lambda u=u: stage0(family, model, tokens[:, :u], state), input_ids.device, repeats)
            for u in lengths}


def distinct_expert_ids(rows: int, k: int, distinct: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """`[rows, k]` expert ids touching exactly `distinct` experts (k <= distinct <= rows * k), each
    row's k choices different, as a router gives them."""
    chosen = torch.randperm(num_experts, generator=generator)[:distinct]
    slots = torch.arange(rows * k) % distinct
    return chosen[slots].view(rows, k)


@torch.inference_mode()
def expert_latency(model, counts, rows: int = 16, repeats: int = 20, seed: int = 0) -> dict[int, float]:
    """Latency of one layer's routed experts for `rows` tokens touching exactly U distinct experts,
    per U in `counts` (Layer 0's experts; every MoE layer has the same shape)."""
    mlp = family_of(model).text_model(model).layers[0].mlp
    experts = mlp.experts
    device = experts.gate_up_proj.device
    k = model.config.get_text_config().num_experts_per_tok
    E = experts.gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, experts.gate_up_proj.shape[-1], generator=g).to(device, experts.gate_up_proj.dtype)
    weights = torch.full((rows, k), 1.0 / k, device=device)
    out = {}
    for U in counts:
        ids = distinct_expert_ids(rows, k, U, E, g).to(device)
        out[U] = _median_ms(lambda ids=ids: hybridspec_experts_forward(experts, x, ids, weights), device, repeats)
    return out
