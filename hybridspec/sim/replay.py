"""`ReplayDrafter`: simulated acceptance on top of a real drafter's cost (docs/design.md, "Simulated acceptance").

Its tokens are the target's own greedy continuation with mistakes drawn from the acceptance model
that issue 3 fixes (so that no one tunes it); its cost, shapes and device traffic are those of the
wrapped real drafter, whose `start`/`propose`/`observe` run every round. Figures obtained with it
are *simulated acceptance* and must be labelled so.

Acceptance model, per round and batch row:
    c ~ Beta(5, 2);  x_i ~ Bernoulli(c) independently (draft i correct);
    confidence_i = sigmoid(logit(c) + 1.5 (2 x_i - 1) + e_i),  e_i ~ N(0, 1);
    entropy_i = entropy of (confidence_i, and 1 - confidence_i spread evenly over 63 other tokens).
With D = 15 and w = 16, E[A + 1] = sum_{k=0..15} E[c^k] = 30 (1/5 - 1/21) = 4.57.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridspec.drafter.protocol import CompilableDrafter, DraftBlock

BETA_A, BETA_B = 5, 2
CONFIDENCE_SHIFT = 1.5
OTHER_TOKENS = 63


class ReplayRound(NamedTuple):
    """One round's simulated drafts, `[B, D]` each; `correct` is the model's x_i."""

    tokens: torch.Tensor
    confidence: torch.Tensor
    entropy: torch.Tensor
    correct: torch.Tensor


def replay_round(generator: torch.Generator | None, truth: torch.Tensor, known: torch.Tensor, vocab_size: int) -> ReplayRound:
    """Draw one round of the acceptance model on the device of `truth` (with `generator`, or torch's
    global generator of that device when None). `truth` int64 `[B, D]`: the target's
    greedy tokens at d_1..d_D; `known` bool `[B, D]`: where `truth` is known (past the end of the
    continuation a draft is marked wrong and its token is arbitrary). Always draws the same
    amounts in the same order, so a seed fixes the whole sequence of rounds whatever `known` is."""
    B, D = truth.shape
    at = dict(generator=generator, device=truth.device)
    # Beta(5, 2) is the 5th smallest of 6 uniforms (order statistic), which a torch.Generator can
    # draw directly (torch.distributions.Beta takes no generator)
    c = torch.rand(B, BETA_A + BETA_B - 1, **at).sort(-1).values[:, BETA_A - 1 : BETA_A]
    correct = (torch.rand(B, D, **at) < c) & known
    noise = torch.randn(B, D, **at)
    # a wrong token is the truth shifted by 1..V-1, so it never equals the truth
    shift = torch.randint(1, vocab_size, (B, D), **at)
    tokens = torch.where(correct, truth, (truth + shift) % vocab_size)
    confidence = torch.sigmoid(torch.logit(c) + CONFIDENCE_SHIFT * (2 * correct.float() - 1) + noise)
    return ReplayRound(tokens, confidence, confidence_entropy(confidence), correct)


def confidence_entropy(confidence: torch.Tensor) -> torch.Tensor:
    """The replay drafter's entropy (nats) of a top-1 `confidence`: the rest spread evenly over
    `OTHER_TOKENS` other tokens."""
    return torch.special.entr(confidence) + OTHER_TOKENS * torch.special.entr((1 - confidence) / OTHER_TOKENS)


def replay_fingerprint_config(plain: dict) -> dict:
    """A replay drafter's identity: the wrapped drafter's config and the fixed acceptance model (host
    or device draws: the same model), so a calibration made with it never passes for the plain one."""
    return {"replay": {"beta": [BETA_A, BETA_B], "shift": CONFIDENCE_SHIFT, "other_tokens": OTHER_TOKENS},
            "drafter": plain}


class _Wrapping:
    """What both replay drafters take from the real drafter they wrap (`self.drafter`)."""

    drafter: object
    vocab_size: int | None

    def fingerprint_config(self) -> dict:
        return replay_fingerprint_config(self.drafter.fingerprint_config())

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def target_layer_ids(self):
        return self.drafter.target_layer_ids

    def bind(self, target: torch.nn.Module):
        self.drafter.bind(target)
        if self.vocab_size is None:
            self.vocab_size = target.get_output_embeddings().weight.shape[0]
        return self


class ReplayDrafter(_Wrapping):
    """A Drafter (`hybridspec.drafter.protocol`) that runs `drafter` (e.g. a `DFlashDrafter`) every
    round for its cost and replaces its tokens, confidences and entropies by `replay_round`'s.

    `continuation`: the target's greedy tokens after the prompt, `[n]` or `[B, n]`; to reuse one
    ReplayDrafter across prompts assign `.continuation` before each call (the generator keeps
    running, so rounds stay independent across prompts). `seed` seeds the generator once; use
    different seeds for calibration and for evaluation, so a policy is never scored on the very
    draws it was calibrated on.
    """

    def __init__(self, drafter, continuation: torch.Tensor, seed: int = 0, vocab_size: int | None = None):
        self.drafter = drafter
        self.continuation = continuation
        self.seed = seed
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_len = 0
        self._truth = torch.zeros(1, 0, dtype=torch.long)

    def start(self, input_ids: torch.Tensor, features: torch.Tensor) -> None:
        self.prompt_len = input_ids.shape[1]
        # one host copy per call, so that rounds never copy the continuation back from the device
        self._truth = self.continuation.reshape(-1, self.continuation.shape[-1]).to("cpu", torch.long)
        self.drafter.start(input_ids, features)

    def propose(self, sequence: torch.Tensor) -> DraftBlock:
        real = self.drafter.propose(sequence)
        B, D = real.tokens.shape
        # the anchor is continuation[done - 1]; drafts d_1..d_D are the next D tokens. `done` is a
        # shape, known on the host, so this reads nothing from the device
        done = sequence.shape[1] - self.prompt_len
        truth = self._truth.expand(B, -1)[:, done : done + D]
        known = torch.zeros(B, D, dtype=torch.bool)
        known[:, : truth.shape[1]] = True
        truth = torch.cat([truth, truth.new_zeros(B, D - truth.shape[1])], 1)
        drawn = replay_round(self.generator, truth, known, self.vocab_size)
        dev = real.tokens.device
        return DraftBlock(drawn.tokens.to(dev, real.tokens.dtype), drawn.confidence.to(dev, real.confidence.dtype),
                          drawn.entropy.to(dev, real.entropy.dtype))

    def observe(self, features: torch.Tensor, num_commit: torch.Tensor | int) -> None:
        self.drafter.observe(features, num_commit)


class DeviceReplayDrafter(_Wrapping):
    """The same acceptance model, drawn on the device inside the round: a drafter the runner can
    capture in its CUDA graph (`ReplayDrafter` draws on the host). `drafter` must be
    device-resident (a `DFlashDrafter`); it runs every round for its cost.

    Draws come from torch's global generator of the device (`torch.manual_seed` fixes a run); set
    `.continuation` (the target's greedy tokens after the prompt, `[n]`) before each call. The
    first `observe` after `reset` is the prompt's; the rounds' count the emitted tokens. Batched:
    every row draws its own rounds (`continuation` `[B, n]`, one per row).

    Each `propose` also keeps the round's continuation (`truth`) and its count of leading correct
    drafts (`correct_prefix`): `hybridspec.sim.forced.ForcedAcceptance` reads them to replace the
    target's acceptance in benchmarks on random weights.

    `acceptance`: where a round's draws come from instead of the Beta model, e.g. a
    `hybridspec.sim.traces.TraceAcceptance` replaying a real pair's recorded rounds."""

    def __init__(self, drafter, continuation: torch.Tensor, vocab_size: int | None = None, acceptance=None):
        self.drafter = drafter
        self.acceptance = acceptance
        self.continuation = continuation
        self.vocab_size = vocab_size
        self.truth: torch.Tensor | None = None  # [B, D + 1] continuation from the anchor's successor
        self.correct_prefix: torch.Tensor | None = None  # [B] leading correct drafts of the last round
        self._truth: torch.Tensor | None = None  # [B, rows] long, static
        self._known = None  # [B] long: tokens of the continuation in `_truth`
        self._emitted = None  # [B] long: tokens emitted so far, the anchor included
        self._prompt_next = False

    def reset(self, batch_size: int, max_length: int, pad: torch.Tensor | None = None) -> None:
        """As `DFlashDrafter.reset` with a fixed size (the runner's call); the continuation (`[n]`
        for every row, or `[B, n]`, one per row) is copied into a static buffer."""
        self.drafter.reset(batch_size, max_length, pad)
        self._load(batch_size, max_length)
        self._emitted.fill_(0)
        self._prompt_next = True

    def start(self, input_ids: torch.Tensor, features: torch.Tensor) -> None:
        """The reference loop's call: a growable context holding the prompt."""
        self.drafter.start(input_ids, features)
        self._load(input_ids.shape[0], self.continuation.shape[-1])
        # the first emitted token is the anchor of the first round
        self._emitted.fill_(1)
        self._prompt_next = False

    def compile_layers(self, enabled: bool) -> None:
        """The wrapped drafter's layers compiled or not (a replay round runs it for its cost, which
        must be the real drafter's)."""
        if isinstance(self.drafter, CompilableDrafter):
            self.drafter.compile_layers(enabled)

    def static_buffers(self) -> list[torch.Tensor]:
        own = [] if self.acceptance is None else self.acceptance.static_buffers()
        return [self._truth, self._known, self._emitted, *own, *self.drafter.static_buffers()]

    def fingerprint_config(self) -> dict:
        config = super().fingerprint_config()
        if self.acceptance is not None:
            config["replay"] = self.acceptance.fingerprint_config()
        return config

    def _load(self, batch_size: int, rows: int) -> None:
        cont = self.continuation.reshape(-1, self.continuation.shape[-1])
        if cont.shape[0] > batch_size:
            raise ValueError(f"continuation {tuple(self.continuation.shape)} has {cont.shape[0]} rows for a batch of "
                             f"{batch_size}")
        # rows past the continuation's (one for every row, or the filler row of a batch of 3 run
        # as 4, a copy of row 0) replay row 0's
        cont = torch.cat([cont, cont[:1].expand(batch_size - cont.shape[0], -1)])
        device = self.drafter.fc.weight.device
        rows = max(rows, 1)
        if (self._truth is None or self._truth.shape[0] != batch_size or self._truth.shape[1] < rows
                or self._truth.device != device):
            self._truth = torch.zeros(batch_size, rows, dtype=torch.long, device=device)
            self._known = torch.zeros(batch_size, dtype=torch.long, device=device)
            self._emitted = torch.zeros(batch_size, dtype=torch.long, device=device)
        if self.acceptance is not None:
            self.acceptance.prepare(device)
        n = min(cont.shape[1], self._truth.shape[1])
        self._truth[:, :n].copy_(cont[:, :n])
        self._known.fill_(n)

    def propose(self, sequence: torch.Tensor) -> DraftBlock:
        anchor = sequence[:, -1] if sequence.dim() == 2 else sequence
        real = self.drafter.propose(anchor)
        B, D = real.tokens.shape
        # drafts d_1..d_D are continuation[emitted .. emitted + D - 1]
        index = self._emitted[:, None] + torch.arange(D + 1, device=anchor.device)  # [B, D + 1]
        known = index < self._known[:, None]
        truth = self._truth.gather(1, index.clamp(max=self._truth.shape[1] - 1))
        if self.acceptance is None:
            drawn = replay_round(None, truth[:, :D], known[:, :D], self.vocab_size)
        else:
            drawn = self.acceptance.draw(truth[:, :D], known[:, :D], self.vocab_size)
        self.truth = truth
        self.correct_prefix = drawn.correct.long().cumprod(-1).sum(-1)
        return DraftBlock(drawn.tokens, drawn.confidence.to(real.confidence.dtype), drawn.entropy.to(real.entropy.dtype))

    def observe(self, features: torch.Tensor, num_commit: torch.Tensor | int) -> None:
        self.drafter.observe(features, num_commit)
        if self._prompt_next:
            # the prompt's features: the first emitted token is the anchor of the first round
            self._prompt_next = False
            self._emitted.fill_(1)
        else:
            self._emitted += num_commit
