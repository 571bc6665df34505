"""`DFlashDrafter`: the DFlash block-diffusion drafter, loaded from z-lab checkpoints without
`trust_remote_code` and without its target.

Architecture (that of the reference, PyPI `dflash`): the tapped target hidden states of the
context, `hidden_norm(fc(concat(taps)))`, enter every layer as extra keys and values (through that
layer's `k_proj`/`v_proj`/`k_norm`, never through its layer norms); the block
`[anchor, mask, ..., mask]`, embedded with the target's embedding, is the query stream of a
Qwen3-style decoder (q/k RMSNorm, RoPE, SwiGLU MLP). Block queries see every context key and, unless
the layer is causal, every block key. The context feature of target position p and the block token
at position p both get RoPE position p. Draft token d_i is the argmax of the target's LM head at
block position i (i = 1..D); position 0 (the anchor) drafts nothing. Drafting needs only that
argmax, its probability and the entropy, so `propose` takes them from `hybridspec.ops.lm_head_top1`
(one pass over the LM head's weight) instead of the `[B, D, V]` logits (`top1`).

For drafting, each layer's context keys/values live in a `ContextCache` indexed by target
position: `observe` writes rows at each batch row's length and advances it ("write w, advance m"),
`propose` writes the block's keys/values just past it (rows L..L+W-1) and attends over the cache:
a layer without a sliding window through `hybridspec.ops.decode_attention` (rows start..L+W-1
only, lengths read on the device), a sliding-window layer through SDPA over every row under a
validity mask. No shape depends on a length and nothing reads one on the host. `compile_layers`
switches `propose`, and `observe` of a round's block of rows, to layer functions compiled once per
layer kind (`LayerBlocks`); the runner turns it on where it compiles the target's layers.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from hybridspec import parallel
from hybridspec.cache import compiled_once
from hybridspec.drafter.config import DFlashConfig
from hybridspec.drafter.context import MIN_ROWS, ContextCache
from hybridspec.drafter.layers import EAGER, CacheBlock, DFlashDecoderLayer, LayerBlocks, fuse_layers, visibility
from hybridspec.drafter.protocol import DraftBlock
from hybridspec.ops import lm_head_top1
from hybridspec.ops.dispatch import layer_options

# The target verifies at most 16 tokens per round (the GDN kernels' block).
MAX_BLOCK_SIZE = 16
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Some exports carry copies of the target's embedding / head; the drafter always uses the target's.
SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")


class DFlashDrafter(nn.Module):
    """A DFlash drafter (`hybridspec.drafter.protocol.DeviceDrafter`: fixed shapes and device-resident
    lengths, so the runner captures it in its graph; and `CompilableDrafter`). Weights as in z-lab checkpoints:
    `layers.*`, `fc`, `hidden_norm`, `norm`; the embedding and LM head are the target's (`bind`).

    Load one with `DFlashDrafter.from_pretrained(DIR, dtype=..., device=...)` and pass it to a target
    that `hybridspec.enable(model)` patched:

        out = model.generate(input_ids, assistant_model=drafter, hybridspec=True, max_new_tokens=256)

    The `generate` arguments hybridspec adds: `hybridspec=True` (route the call), `assistant_model=`
    (this drafter), `verify_length=w` (fixed tokens per round, 2..block size), `policy=` ("hybridspec",
    the default, or "nominal", "no_two_stage", "static", "dcut", "evict"), `calibration=` (an
    artifact from `hybridspec calibrate`), `enforce_eager=True` (no CUDA graphs), `reference_loop=True`
    (the host-driven loop), and with `return_dict_in_generate=True` the output's `hybridspec_stats`
    (per-round lengths, accepted drafts, mean acceptance length). `bind(target)` checks the pair
    (hidden size, vocabulary, tapped layers, target depth); `generate` calls it.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        text = config.text
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(text.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * text.hidden_size, text.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        self.norm = Qwen3RMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(text)
        # (embedding, lm_head) of the bound target, in a tuple so they are not submodules
        self._target: tuple[nn.Module, nn.Module] | None = None
        self.context: ContextCache | None = None
        # eager unless the runner compiles (`compile_layers`): CPU and the reference loop run eagerly
        self._blocks = EAGER

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | str | None = None, device=None):
        """Load a z-lab format directory (`config.json`, `model.safetensors` or a sharded index).
        `dtype=None` keeps the stored dtypes."""
        if isinstance(dtype, str):
            dtype = None if dtype == "auto" else getattr(torch, dtype)
        config = DFlashConfig.from_pretrained(path)
        weights = {k: v for k, v in _load_weights(path).items() if k not in SHARED_KEYS}
        with torch.device("meta"):
            model = cls(config)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        if missing or unexpected:
            raise ValueError(
                f"{path} is not a DFlash checkpoint for this config: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in weights.items()}, assign=True)
        # non-persistent RoPE buffers were built on the meta device; fp32 as in transformers
        model.rotary_emb = Qwen3RotaryEmbedding(config.text).to(device)
        return model.eval()

    def save_pretrained(self, path: str | os.PathLike) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config.to_dict(), f, indent=2)
        # clones: after drafting, projections are views of one fused weight, and safetensors refuses
        # tensors that share memory
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})

    def fingerprint_config(self) -> dict:
        """What identifies this drafter for calibration artifacts (`hybridspec.fingerprint`)."""
        return self.config.to_dict()

    def bind(self, target: nn.Module) -> "DFlashDrafter":
        """Share `target`'s input embedding and LM head; raises ValueError naming every mismatch
        (hidden size, vocabulary, `num_target_layers` against the target's depth, tapped layers,
        block size, mask token)."""
        tc = target.config.get_text_config()
        cfg, problems = self.config, []
        if tc.hidden_size != cfg.hidden_size:
            problems.append(f"hidden size: drafter {cfg.hidden_size}, target {tc.hidden_size}")
        if tc.vocab_size != cfg.vocab_size:
            problems.append(f"vocab size: drafter {cfg.vocab_size}, target {tc.vocab_size}")
        if cfg.num_target_layers is not None and cfg.num_target_layers != tc.num_hidden_layers:
            problems.append(
                f"the drafter's config names a target with num_target_layers={cfg.num_target_layers}, this "
                f"target has {tc.num_hidden_layers} layers (a drafter for another model?)"
            )
        bad = [t for t in cfg.target_layer_ids if not 0 <= t < tc.num_hidden_layers]
        if bad:
            problems.append(
                f"target_layer_ids {list(cfg.target_layer_ids)}: {bad} out of range for a target "
                f"with {tc.num_hidden_layers} layers"
            )
        if cfg.block_size > MAX_BLOCK_SIZE:
            problems.append(f"block_size {cfg.block_size} > {MAX_BLOCK_SIZE}")
        if not cfg.mask_token_id < tc.vocab_size:
            problems.append(f"mask_token_id {cfg.mask_token_id} >= target vocab size {tc.vocab_size}")
        if problems:
            raise ValueError("DFlash drafter does not fit this target: " + "; ".join(problems))
        head = getattr(target, "lm_head", None)
        head = target.get_output_embeddings() if head is None else head
        self._target = (target.get_input_embeddings(), head)
        return self

    def forward(self, target_hidden: torch.Tensor, noise_embedding: torch.Tensor, position_ids: torch.Tensor):
        """Stateless forward. `target_hidden` `[B, C, n_taps * H]` (before `fc`), `noise_embedding`
        `[B, T, H]`, `position_ids` `[B, C + T]` (context, then block); returns `[B, T, H]` after
        the final norm."""
        (B, C, feat), (_, T, H) = target_hidden.shape, noise_embedding.shape
        if feat != self.fc.in_features or H != self.config.hidden_size or tuple(position_ids.shape) != (B, C + T):
            raise ValueError(
                f"expected target_hidden [B, C, {self.fc.in_features}], noise_embedding [B, T, "
                f"{self.config.hidden_size}], position_ids [B, C + T]; got {tuple(target_hidden.shape)}, "
                f"{tuple(noise_embedding.shape)}, {tuple(position_ids.shape)}"
            )
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        masks = self._masks(position_ids[:, C:], position_ids)
        h = noise_embedding
        for layer in self.layers:
            attn = layer.self_attn
            past = attn.context_kv(ctx, cos[:, :C], sin[:, :C])
            h = layer(h, cos[:, C:], sin[:, C:], masks[attn.is_causal, attn.sliding_window], past)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits from drafter hidden states via the target's LM head (and the checkpoint's
        `output_multiplier` / `final_logit_softcapping`, as the reference applies them)."""
        head = self._bound()[1]
        # a tensor-parallel target's head is split over the vocabulary: every rank gathers the full logits
        logits = parallel.column(head, hidden.to(head.weight.dtype), gather=True) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's raw embedding rows (times `input_embedding_scale`), in the drafter's dtype."""
        # a tensor-parallel target's table may be split over the vocabulary (transformers 5.24)
        rows = parallel.embedding(self._bound()[0], input_ids, raw=True)
        return (rows * self.config.input_embedding_scale).to(self.fc.weight.dtype)

    def reset(self, batch_size: int, max_length: int | None = None, pad: torch.Tensor | None = None) -> None:
        """Empty every row's context. With `max_length` (target positions the caller promises never
        to exceed) the cache is sized once, `max_length + block_size` rows, and never reallocated, as
        CUDA graphs need; without it the cache grows on demand. A large enough cache is reused.
        `pad` `[B]`: each row's left padding (its first valid target position); None: none."""
        w, t = self.fc.weight, self.config.text
        rows = (max_length or 0) + self.block_size
        if self.context is None or not self.context.fits(batch_size, rows, w.dtype, w.device):
            self.context = ContextCache(
                len(self.layers), batch_size, t.num_key_value_heads, t.head_dim, max(rows, MIN_ROWS), w.dtype, w.device
            )
        self.context.clear(max_length, pad)
        # drafting runs each layer's q/k/v and gate/up projections as one GEMM each
        fuse_layers(self.layers)

    def compile_layers(self, enabled: bool) -> None:
        """`propose` runs its layers, and `observe` of a block of `block_size` rows the context
        keys/values, compiled with `torch.compile` once per layer kind, or eagerly (the default). The
        drafts are the same; the compiled form fuses each layer's elementwise work."""
        self._blocks = compiled_once(LayerBlocks, layer_options()) if enabled else EAGER

    def static_buffers(self) -> list[torch.Tensor]:
        """The device buffers a captured round reads and writes (the runner recaptures if they move)."""
        cache = self._context()
        # `start` too: the padding mask and the RoPE positions of a captured round read it; and the
        # weights and buffers (the fused weights among them): one replaced between calls moves
        return [cache.k, cache.v, cache.length, cache.start, cache.batch, *self.parameters(), *self.buffers()]

    def start(self, input_ids: torch.Tensor, features: torch.Tensor) -> None:
        """New context holding every prompt position (`reset`, then `observe` of the whole prompt)."""
        self.reset(input_ids.shape[0])
        self.observe(features, input_ids.shape[1])

    @torch.no_grad()
    def observe(self, features: torch.Tensor, num_commit: torch.Tensor | int) -> None:
        """Write `features` `[B, w, n_taps * H]` at each row's length L (positions L..L+w-1), then
        advance L by `num_commit` (an int or a `[B]` device tensor, 0 <= m <= w)."""
        cache, n = self._context(), features.shape[1]
        if isinstance(num_commit, int) and not 0 <= num_commit <= n:
            raise ValueError(f"num_commit must be in 0..{n} (the rows given), got {num_commit}")
        cache.reserve(n)
        pos = cache.positions(n)
        # a round's block of rows runs the compiled blocks (one fixed shape); a prompt's rows (any
        # count, once a request) run eagerly, so that no prompt length compiles a graph of its own
        blocks = self._blocks if n == self.block_size else EAGER
        ctx, cos, sin = blocks.context_inputs(self.fc, self.hidden_norm, self.rotary_emb, features,
                                              cache.rope_positions(pos))
        for i, layer in enumerate(self.layers):
            blocks.context(layer.self_attn, ctx, cos, sin, cache.k[i], cache.v[i], cache.batch, pos)
        cache.advance(n, num_commit)

    @torch.no_grad()
    def propose(self, sequence: torch.Tensor) -> DraftBlock:
        """Draft d_1..d_D after the anchor: `sequence[:, -1]` of a `[B, n]` sequence, or a `[B]`
        tensor of anchors. The anchor sits at position L of its row; the context is unchanged."""
        cache = self._context()
        anchor = sequence[:, -1] if sequence.dim() == 2 else sequence
        B, W = anchor.shape[0], self.block_size
        cache.reserve(W)
        masked = anchor.new_full((B, W - 1), self.mask_token_id)
        noise = self.embed(torch.cat([anchor[:, None], masked], dim=1))  # [B, W, H]
        pos = cache.positions(W)
        blocks = self._blocks
        cos, sin = blocks.rope(self.rotary_emb, noise, cache.rope_positions(pos))
        block = CacheBlock(cache.batch, pos, cache.length, cache.start)
        # masks only for the sliding-window layers (the others' decode_attention reads the lengths):
        # the block's own keys are written at rows L..L+W-1, so every row below L + W is live; rows
        # before `start` hold a left-padded row's padding
        keys = torch.arange(cache.rows, device=pos.device)[None]
        masks = self._masks(pos, keys, cache.length + W, cache.start, sliding_only=True)
        h = noise
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if attn.sliding_window is None:
                h = blocks.full(layer, h, cos, sin, cache.k[i], cache.v[i], block)
            else:
                mask = masks[attn.is_causal, attn.sliding_window]
                h = blocks.sliding(layer, h, cos, sin, mask, cache.k[i], cache.v[i], block)
        return self.top1(blocks.head_input(self.norm, h))

    def top1(self, hidden: torch.Tensor) -> DraftBlock:
        """Drafts from drafter hidden states `[B, D, H]`: the argmax of `compute_logits`, its fp32
        softmax probability and the softmax's entropy. A plain linear head without softcapping runs
        `hybridspec.ops.lm_head_top1`, one pass over the head's weight without the `[B, D, V]`
        logits; others (a softcapped checkpoint, a head with a bias or of another kind, a head split
        over the vocabulary by tensor parallelism) take the full logits."""
        head = self._bound()[1]
        cap = self.config.final_logit_softcapping
        plain = isinstance(head, nn.Linear) and head.bias is None and not parallel.is_sharded(head.weight)
        if plain and not (cap is not None and cap > 0):
            B, D, H = hidden.shape
            flat = hidden.reshape(B * D, H).to(head.weight.dtype)
            tokens, confidence, entropy = lm_head_top1(flat, parallel.local(head.weight), scale=self.config.output_multiplier)
            return DraftBlock(tokens.view(B, D), confidence.view(B, D), entropy.view(B, D))
        logits = self.compute_logits(hidden)
        tokens = torch.argmax(logits, dim=-1)
        probs = torch.softmax(logits.float(), dim=-1)
        confidence = probs.gather(-1, tokens[..., None])[..., 0]
        return DraftBlock(tokens, confidence, torch.special.entr(probs).sum(-1))

    def _masks(self, q_pos, k_pos, limit=None, first=None, sliding_only=False):
        kinds = {(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in self.layers}
        return {kind: visibility(q_pos, k_pos, *kind, limit, first) for kind in kinds
                if not sliding_only or kind[1] is not None}

    def _bound(self) -> tuple[nn.Module, nn.Module]:
        if self._target is None:
            raise RuntimeError("DFlashDrafter is not bound to a target: call drafter.bind(target) first")
        return self._target

    def _context(self) -> ContextCache:
        if self.context is None:
            raise RuntimeError("call drafter.start(...) or drafter.reset(...) before observe/propose")
        return self.context


def _load_weights(path) -> dict[str, torch.Tensor]:
    single, index = os.path.join(path, WEIGHTS_NAME), os.path.join(path, WEIGHTS_INDEX_NAME)
    if os.path.exists(single):
        return load_file(single)
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        weights = {}
        for shard in shards:
            weights.update(load_file(os.path.join(path, shard)))
        return weights
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} in {path}")
