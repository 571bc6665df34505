"""The drafting protocol that generation drives, so that any drafter (the DFlash model, a replay
drafter with scripted acceptance) can stand in. The method names are those the decoding loop
(`hybridspec.generation.loop`) calls.

One generate call, with `L` a batch row's drafter context length (target positions whose tap
features the drafter holds), `W = block_size` and `D = W - 1`:

    drafter.bind(target)                        # once: check the pair, share embedding / LM head
    drafter.start(input_ids, prompt_features)   # context = every prompt position, L = P
    loop:
        block = drafter.propose(sequence)       # d_1..d_D after the anchor x_0 = sequence[:, -1],
                                                # which sits at target position L
        ...the target verifies (x_0, d_1, .., d_{w-1}) and accepts A drafts...
        drafter.observe(verified_features, A + 1)   # write those w rows at L.., then L += A + 1

`observe` writes all `w` rows it is given and advances the length by `m <= w` ("write w, advance
m"): rows past `L + m` are stale and the next round overwrites them, so no shape depends on `m`,
and a device tensor `m` is never read on the host.

A `DeviceDrafter` also drafts with fixed shapes and device-resident lengths, so the CUDA-graph
runner can capture it inside its round: `reset(B, max_length)` sizes its context once (the prompt
then arrives through `observe(features, P)`), `propose` takes the `[B, 1]` anchors, and
`static_buffers()` lists the buffers a captured round reads (the runner recaptures if they move).
A `CompilableDrafter` can run its layers compiled (`compile_layers(True)`); the runner turns that on
where it compiles the target's layers, and a drafter without it (a replay drafter) runs eagerly.

Features are the target's tap hidden states concatenated on the last dimension in
`target_layer_ids` order: tap i is the output of target layer i, `hidden_states[i + 1]` of a
transformers forward with `output_hidden_states=True`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import torch


class DraftBlock(NamedTuple):
    """One round's drafts. `tokens` int64 `[B, D]`: d_1..d_D. `confidence` fp32 `[B, D]`: the
    drafter's top-1 probability at each position. `entropy` fp32 `[B, D]`: the entropy (nats) of
    the drafter's distribution at each position."""

    tokens: torch.Tensor
    confidence: torch.Tensor
    entropy: torch.Tensor


@runtime_checkable
class Drafter(Protocol):
    block_size: int
    """W: the anchor plus D = W - 1 draft tokens per round."""
    target_layer_ids: Sequence[int]
    """Taps the drafter reads (may be empty for a drafter that reads none)."""

    def bind(self, target: torch.nn.Module) -> object:
        """Pair with a target; raises ValueError on a mismatch."""
        ...

    def start(self, input_ids: torch.Tensor, features: torch.Tensor) -> None:
        """New context: the prompt `[B, P]` and its tap features `[B, P, n_taps * H]`."""
        ...

    def propose(self, sequence: torch.Tensor) -> DraftBlock:
        """Draft D tokens after the anchor, the last column of `sequence` `[B, n]` (prompt and
        every emitted token)."""
        ...

    def observe(self, features: torch.Tensor, num_commit: torch.Tensor | int) -> None:
        """Tap features `[B, w, n_taps * H]` of the w verified tokens; the first `num_commit`
        (`m = A + 1`, an int or a `[B]` device tensor) are committed."""
        ...


@runtime_checkable
class DeviceDrafter(Drafter, Protocol):
    """A drafter the CUDA-graph runner can capture: fixed shapes, lengths on the device."""

    def reset(self, batch_size: int, max_length: int, pad: torch.Tensor | None = None) -> None:
        """Empty every row's context, sized once for `max_length` target positions; `pad` `[B]`:
        each row's left padding (the prompt's first valid position), None for none."""
        ...

    def static_buffers(self) -> list[torch.Tensor]:
        """The device tensors a captured round reads and writes (its buffers and weights): the
        runner captures again when one of them moves."""
        ...


@runtime_checkable
class CompilableDrafter(Protocol):
    """A drafter whose layers `torch.compile` can compile, once per layer kind (regional
    compilation, as the target's `hybridspec.patches.forward.Blocks`). Off until the runner turns it
    on; the drafts are the same either way."""

    def compile_layers(self, enabled: bool) -> None:
        """Run the layers of `propose` compiled (True) or eagerly (False)."""
        ...
