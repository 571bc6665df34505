"""`train_drafter`: the DFlash training recipe for a transformers target.

Data are the target's own greedy continuations of corpus prompt windows with its tap features
(computed once, kept on the device); every step draws random anchors in each response and trains
on the blocks `[anchor, mask * (W - 1)]` (`blocks.py`, `forward.py`). The embedding and LM head are
the target's, frozen and never saved; AdamW with linear warm-up and cosine decay, gradient
clipping, bf16 autocast on CUDA. The checkpoint is the z-lab format `DFlashDrafter.from_pretrained`
loads; the report measures acceptance with real speculative runs of the saved checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hybridspec.drafter import DFlashConfig, DFlashDrafter
from hybridspec.training import blocks, data
from hybridspec.training.forward import block_loss
from hybridspec.training.options import TrainOptions

# a --time-budget fixes the schedule from the pace of steps WARMUP_STEPS..TIMING_STEPS: the first
# steps are several times slower (kernel selection, allocator growth) and would shorten the schedule
WARMUP_STEPS, TIMING_STEPS = 10, 30
MAX_TAPS = 5


def default_taps(num_layers: int) -> list[int]:
    """min(5, L - 1) taps spread evenly over layers 0..L-2. The last layer is left out: transformers'
    `hidden_states[-1]` is after the final norm while the verification path taps the layer's raw
    output, so a last-layer tap would differ between the prompt and later rounds."""
    n = max(1, min(MAX_TAPS, num_layers - 1))
    top = max(0, num_layers - 2)
    return sorted({round(i * top / max(1, n - 1)) for i in range(n)})


def drafter_config(target, options: TrainOptions, mask_token_id: int, taps: list[int]) -> dict:
    """The z-lab `config.json` of a drafter for `target` (a Qwen3 config plus `dflash_config`)."""
    tc = target.config.get_text_config()
    rope = getattr(tc, "rope_parameters", None) or {}
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
        intermediate_size=options.intermediate_size or 4 * tc.hidden_size, num_hidden_layers=options.num_layers,
        num_attention_heads=options.num_heads or tc.num_attention_heads,
        num_key_value_heads=options.num_kv_heads or tc.num_key_value_heads,
        head_dim=options.head_dim or getattr(tc, "head_dim", tc.hidden_size // tc.num_attention_heads),
        rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=tc.max_position_embeddings, hidden_act="silu", attention_bias=False,
        tie_word_embeddings=False, num_target_layers=tc.num_hidden_layers, block_size=options.block_size,
        dflash_config={"target_layer_ids": list(taps), "mask_token_id": int(mask_token_id)},
    )


def _schedule(warmup: float):
    """LambdaLR factor: linear warm-up over `warmup` of the steps, then cosine to 0. `total` is a
    one-element list so that a time budget can fix it after the first steps."""
    total = [1]

    def factor(step: int) -> float:
        warm = max(1, round(warmup * total[0]))
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total[0] - warm))))

    return factor, total


def planned_steps(max_steps: int, budget: float, elapsed: float, seconds_per_step: float, done: int) -> int:
    """Steps that fit a time budget: those done plus what the remaining time buys at the measured
    steady pace (never more than `max_steps`, never fewer than done)."""
    return max(done, min(max_steps, done + int(max(0.0, budget - elapsed) / seconds_per_step)))


def _optimizer(drafter, options: TrainOptions):
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    rest = [p for p in drafter.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": options.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=options.lr, betas=(0.9, 0.95))


def _eval_prompts(options: TrainOptions, tokenizer, heldout: list[str]) -> list[torch.Tensor]:
    if options.eval_prompts:
        from hybridspec.calibration.prompts import load_prompts, render

        return [render(p, tokenizer) for p in load_prompts(options.eval_prompts)[: options.eval_count]]
    if not heldout:
        warnings.warn("hybridspec train-drafter: no held-out texts (raise --heldout-percent or pass "
                      "--eval-prompts); skipping the acceptance report", stacklevel=2)
        return []
    windows = data.prompt_windows(tokenizer, heldout, options.eval_count, options.prompt_tokens, options.seed + 1)
    return [w[None] for w in windows]


def train_drafter(**kwargs) -> dict:
    """Train and save a DFlash drafter; returns the report (also written to `out/report.json`).
    Keyword arguments are the fields of `TrainOptions` (the command line's options)."""
    from hybridspec.api import enable
    from hybridspec.calibration.prompts import load_tokenizer
    from hybridspec.loading import load_target

    options = TrainOptions(**kwargs)
    if not 2 <= options.block_size <= 16:
        raise ValueError(f"--block-size must be in 2..16, got {options.block_size}")
    began = time.perf_counter()
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = str(device).startswith("cuda")
    target = load_target(options.target, device)
    target.requires_grad_(False)
    tc = target.config.get_text_config()
    tokenizer = load_tokenizer(options.tokenizer, options.target, tc.vocab_size)
    mask_id = options.mask_token_id if options.mask_token_id is not None else tokenizer.mask_token_id
    if mask_id is None:
        raise ValueError("no mask token: pass --mask-token-id or use a tokenizer with a mask token")
    taps = ([int(t) for t in options.target_layer_ids.split(",")] if options.target_layer_ids
            else default_taps(tc.num_hidden_layers))
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)

    texts = data.read_texts(options.corpus)
    heldout = [] if options.eval_prompts else [t for t in texts if data.is_heldout(t, options.heldout_percent)]
    train_texts = texts if options.eval_prompts else [t for t in texts if not data.is_heldout(t, options.heldout_percent)]
    windows = data.prompt_windows(tokenizer, train_texts, options.num_sequences, options.prompt_tokens, options.seed)
    ids, end = data.regenerate(target, windows, options.response_tokens, options.generate_batch, eos, pad)
    feats = data.tap_features(target, ids, taps, options.generate_batch, device, target.dtype)
    ids, end = ids.to(device), end.to(device)
    data_seconds = time.perf_counter() - began

    torch.manual_seed(options.seed)
    config = DFlashConfig.from_dict(drafter_config(target, options, mask_id, taps))
    drafter = DFlashDrafter(config).to(device).bind(target).train()
    weights = blocks.loss_weights(options.block_size, options.gamma or blocks.default_gamma(options.block_size))
    optimizer = _optimizer(drafter, options)
    factor, total = _schedule(options.warmup)
    total[0] = options.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    gen = torch.Generator().manual_seed(options.seed)
    start = torch.full((options.batch_size,), options.prompt_tokens, dtype=torch.long, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    order, cursor, history = torch.randperm(len(ids), generator=gen), 0, []
    bar = tqdm(total=options.steps, desc="train drafter", unit="step")
    step, t0 = 0, time.perf_counter()
    t_warm = t0
    while step < total[0]:
        if cursor + options.batch_size > len(order):
            order, cursor = torch.randperm(len(ids), generator=gen), 0
        idx = order[cursor : cursor + options.batch_size].to(device)
        cursor += options.batch_size
        anchors, valid = blocks.sample_anchors(start[: len(idx)], end[idx], ids.shape[1],
                                               options.blocks_per_sequence, gen)
        with autocast:
            loss, stats = block_loss(drafter, feats[idx], ids[idx], anchors, valid, end[idx], weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), options.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if options.time_budget is not None and step in (WARMUP_STEPS, TIMING_STEPS):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if step == WARMUP_STEPS:
                t_warm = now
            else:
                per_step = (now - t_warm) / (TIMING_STEPS - WARMUP_STEPS)
                total[0] = planned_steps(options.steps, options.time_budget, now - t0, per_step, step)
                bar.total = total[0]
        if step % options.log_every == 0 or step == total[0]:
            row = {"step": step, "loss": loss.item(), **{k: v.item() for k, v in stats.items()},
                   "lr": scheduler.get_last_lr()[0]}
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.3f}")
        bar.update(1)
        if options.time_budget is not None and time.perf_counter() - t0 > options.time_budget:
            break
    bar.close()
    train_seconds = time.perf_counter() - t0

    out = Path(options.out)
    drafter.eval().to(target.dtype).save_pretrained(out)
    report = {"options": dataclasses.asdict(options), "target_layer_ids": taps, "mask_token_id": mask_id,
              "sequences": len(ids), "sequence_tokens": ids.shape[1], "steps": step, "history": history,
              "data_seconds": round(data_seconds, 1), "train_seconds": round(train_seconds, 1),
              "parameters": sum(p.numel() for p in drafter.parameters())}
    _write(out, report)
    prompts = _eval_prompts(options, tokenizer, heldout) if options.eval_count > 0 else []
    if prompts:
        from hybridspec.training.acceptance import acceptance_report

        saved = DFlashDrafter.from_pretrained(out, device=device)
        report["acceptance"] = acceptance_report(enable(target), saved, prompts, options.eval_new_tokens,
                                                 options.seed)
        _write(out, report)
    return report


def _write(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
