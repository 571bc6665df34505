"""Every option of `hybridspec train-drafter`, its default and its help, in one place: the command
line is built from these fields and `train_drafter(**options)` takes the same names. Imports
nothing heavy (the `hybridspec --help` path reads it)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


def _req(help: str):
    return field(metadata={"help": help, "required": True})


@dataclass
class TrainOptions:
    target: str = _req("local transformers target directory (a supported hybrid model)")
    corpus: str = _req("training texts: a .jsonl file (rows with `text` or `prompt`), a text file (one "
                       "document), or a directory of such files (sorted)")
    out: str = _req("directory for the drafter checkpoint (z-lab format: config.json + model.safetensors) "
                    "and report.json")
    tokenizer: str | None = _opt(None, "tokenizer directory (None: the target's)")
    eval_prompts: str | None = _opt(None, "JSONL prompts for the acceptance report (`prompt` rows, as "
                                          "`hybridspec calibrate` reads them); None: the held-out texts")
    heldout_percent: float = _opt(2.0, "percent of corpus texts held out (by text hash) for the report when "
                                       "--eval-prompts is not given; they never enter training")
    num_layers: int = _opt(1, "drafter decoder layers")
    intermediate_size: int | None = _opt(None, "drafter MLP width (None: 4 x the target's hidden size)")
    num_heads: int | None = _opt(None, "drafter attention heads (None: the target's)")
    num_kv_heads: int | None = _opt(None, "drafter key/value heads (None: the target's)")
    head_dim: int | None = _opt(None, "drafter head dimension (None: the target's)")
    block_size: int = _opt(16, "W: anchor plus W - 1 draft tokens (2..16)")
    target_layer_ids: str | None = _opt(None, "comma-separated taps (tap i = output of target layer i); None: "
                                              "min(5, L - 1) layers spread evenly over 0..L-2")
    mask_token_id: int | None = _opt(None, "the mask token id (None: the tokenizer's mask token)")
    gamma: float | None = _opt(None, "loss decay exp(-(k-1)/gamma) over block position k (None: 7 at "
                                     "block 16, 4 at block 8, as the DFlash paper)")
    num_sequences: int = _opt(4096, "prompt windows the target continues greedily (the training data)")
    prompt_tokens: int = _opt(64, "tokens per prompt window")
    response_tokens: int = _opt(192, "greedy tokens the target generates per prompt")
    generate_batch: int = _opt(256, "prompts per batched target generate call")
    blocks_per_sequence: int = _opt(16, "random anchors (blocks) per sequence and step")
    batch_size: int = _opt(32, "sequences per optimizer step")
    steps: int = _opt(1000, "optimizer steps (an upper bound when --time-budget is given)")
    time_budget: float | None = _opt(None, "seconds of training: the schedule is fitted to the measured step "
                                           "time and training stops at the budget")
    lr: float = _opt(6e-4, "AdamW peak learning rate")
    warmup: float = _opt(0.04, "warm-up fraction of the steps (linear), then cosine decay to 0")
    weight_decay: float = _opt(0.0, "AdamW weight decay (not applied to norms)")
    clip: float = _opt(1.0, "gradient-norm clipping")
    seed: int = _opt(0, "seeds the drafter's initialisation, prompt windows, anchors and report sampling")
    device: str | None = _opt(None, "cpu or cuda (None: cuda when available)")
    eval_count: int = _opt(16, "held-out prompts in the acceptance report (0: no report)")
    eval_new_tokens: int = _opt(64, "new tokens per report prompt")
    log_every: int = _opt(50, "steps between loss lines under the progress bar")


def option_fields():
    """(name, type, default or MISSING, help, required) of every option, in order."""
    for f in fields(TrainOptions):
        required = f.metadata.get("required", False)
        yield f.name, f.type, (MISSING if required else f.default), f.metadata["help"], required
