"""Sampling under `hybridspec=True`: the point-mass rule against its closed form, then end to end
the joint distribution of the first generated tokens against the target's exact sampling law."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.generation import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hybridspec
from hybridspec.drafter.protocol import DraftBlock
from hybridspec.round.accept import greedy_accept, process_positions, sample_accept
from hybridspec.sim.scripted import ScriptedReplayDrafter
from hybridspec.tiny import TARGET
from tests.calibration.synthetic import synthetic_calibration

ALPHA = 0.01
DRAWS = 100_000


def chi_square_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of `counts` against `expected` (same total); cells expected below 5 are pooled
    so that the chi-square approximation holds."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    if len(expected) < 2:
        # one possible outcome, and the caller checked that nothing else occurred
        return 1.0
    rare = expected < 5
    if rare.any():
        counts = torch.cat([counts[~rare], counts[rare].sum()[None]])
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(expected) - 1, dtype=torch.float64)
    # the chi-square survival function is the regularised upper incomplete gamma
    return torch.special.gammaincc(dof / 2, stat / 2).item()


def outcome_law(probs: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """`law[a, x]` = P(A = a, x_new = x) of the point-mass rule for one row: `probs` `[w, V]`,
    `draft` `[w - 1]`. Rejecting d_{a+1} after keeping d_1..d_a has probability
    prod_{i<a} p_i(d_i) (1 - p_a(d)) r_a(x), and (1 - p_a(d)) r_a(x) is p_a(x) with x = d removed;
    keeping every draft: prod p_i(d_i) p_{w-1}(x)."""
    w = probs.shape[0]
    law = probs.double().clone()
    kept = 1.0
    for a in range(w):
        law[a] *= kept
        if a < w - 1:
            kept *= probs[a, draft[a]].item()
            law[a, draft[a]] = 0.0
    return law


def warped(logits: torch.Tensor, *warpers) -> torch.Tensor:
    """transformers' warpers applied to every position of `logits` `[w, V]`, as sampling applies them."""
    processors = LogitsProcessorList(warpers)
    return torch.stack([processors(torch.zeros(1, 0, dtype=torch.long), row[None])[0] for row in logits])


BASE = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)) * 1.5
TOP3 = BASE.topk(3, dim=-1).indices
LOW = BASE.argsort(dim=-1)[:, 0]
ONE_HOT = torch.full((3, 10), -float("inf")).scatter(-1, torch.tensor([[4], [7], [2]]), 0.0)

# (processed logits [w, V], drafts [w - 1]); comments name what each reaches
KERNEL_CASES = {
    "T=1": (BASE, TOP3[:2, 1]),
    "T=0.4": (warped(BASE, TemperatureLogitsWarper(0.4)), TOP3[:2, 0]),
    "T=2.5": (warped(BASE, TemperatureLogitsWarper(2.5)), TOP3[:2, 2]),
    # d_1 outside the top-k: p_t(d_1) = 0, always rejected, the residual is p_t itself
    "top_k=3, p(d)=0": (warped(BASE, TopKLogitsWarper(3)), torch.stack([LOW[0], TOP3[1, 0]])),
    "T=0.8, top_p=0.7": (warped(BASE, TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.7)), TOP3[:2, 1]),
    "T=1.3, top_k=5, top_p=0.9": (warped(BASE, TemperatureLogitsWarper(1.3), TopKLogitsWarper(5),
                                         TopPLogitsWarper(0.9)), TOP3[:2, 0]),
    # p_t(d_i) = 1: always accepted, the residual is empty and must not leak a NaN
    "p(d)=1": (ONE_HOT, torch.tensor([4, 7])),
    "p(d)=1 then p(d)=0": (ONE_HOT, torch.tensor([4, 3])),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_point_mass_rule_matches_its_closed_form(case):
    processed, draft = KERNEL_CASES[case]
    w, V = processed.shape
    torch.manual_seed(1)
    # one batch row per draw: rows draw independently, as successive rounds do
    tokens, accepted = sample_accept(processed.expand(DRAWS, w, V), draft.expand(DRAWS, w - 1))
    assert tokens.shape == (DRAWS, w) and accepted.shape == (DRAWS,)
    kept = torch.arange(w - 1) < accepted[:, None]
    assert (tokens[:, : w - 1] == draft)[kept].all(), "a kept draft was replaced"
    emitted = tokens.gather(1, accepted[:, None]).squeeze(1)
    counts = torch.bincount(accepted * V + emitted, minlength=w * V).view(w, V)
    probs = processed.softmax(-1)
    law = outcome_law(probs, draft)
    # a rejected draft is never the correction token, and no token outside the support is emitted
    assert counts[law == 0].sum() == 0, f"{case}: outcomes of probability 0 were drawn"
    p = chi_square_pvalue(counts[law > 0], DRAWS * law[law > 0])
    assert p > ALPHA, f"{case}: chi-square p = {p:.2e}"
    # the property that makes it exact: the first emitted token has the target's distribution
    first = torch.bincount(tokens[:, 0], minlength=V)
    support = probs[0] > 0
    assert first[~support].sum() == 0
    assert chi_square_pvalue(first[support], DRAWS * probs[0, support]) > ALPHA


def test_acceptance_residual_and_bonus_separately():
    processed, draft = KERNEL_CASES["T=1.3, top_k=5, top_p=0.9"]
    w, V = processed.shape
    probs = processed.softmax(-1).double()
    torch.manual_seed(2)
    tokens, accepted = sample_accept(processed.expand(DRAWS, w, V), draft.expand(DRAWS, w - 1))
    emitted = tokens.gather(1, accepted[:, None]).squeeze(1)
    for i in range(w - 1):
        reached = accepted >= i
        rate = (accepted[reached] > i).double().mean().item()
        sd = (probs[i, draft[i]] * (1 - probs[i, draft[i]]) / reached.sum()).sqrt().item()
        assert abs(rate - probs[i, draft[i]].item()) < 4 * sd, f"acceptance at {i}: {rate} vs {probs[i, draft[i]]}"
        residual = probs[i].clone()
        residual[draft[i]] = 0
        counts = torch.bincount(emitted[accepted == i], minlength=V)
        assert counts[residual == 0].sum() == 0
        n = counts.sum()
        assert chi_square_pvalue(counts[residual > 0], n * residual[residual > 0] / residual.sum()) > ALPHA
    bonus = torch.bincount(emitted[accepted == w - 1], minlength=V)
    n = bonus.sum()
    assert n > 1000 and bonus[probs[-1] == 0].sum() == 0
    assert chi_square_pvalue(bonus[probs[-1] > 0], n * probs[-1, probs[-1] > 0]) > ALPHA


def test_sampling_is_seeded_by_torch_manual_seed():
    processed, draft = KERNEL_CASES["T=1"]
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(sample_accept(processed.expand(64, -1, -1), draft.expand(64, -1)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])


def test_greedy_accept_is_the_longest_argmax_prefix():
    g = torch.Generator().manual_seed(3)
    processed = torch.randn(200, 5, 6, generator=g)
    best = processed.argmax(-1)
    # drafts right on a random prefix, so every acceptance length occurs
    right = torch.randint(0, 5, (200, 1), generator=g)
    draft = torch.where(torch.arange(4) < right, best[:, :4], (best[:, :4] + 1) % 6)
    tokens, accepted = greedy_accept(processed, draft)
    assert torch.equal(accepted, right.squeeze(1))
    assert torch.equal(tokens, best)


def test_positions_are_processed_after_their_own_context():
    seq = torch.tensor([[3, 1, 4]])
    draft = torch.tensor([[1, 5, 2]])
    logits = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(4))
    # a processor that reads the context: penalises the tokens already in it
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0), TemperatureLogitsWarper(0.7)])
    processed = process_positions(processors, seq, draft, logits)
    for i in range(4):
        expected = processors(torch.cat([seq, draft[:, :i]], -1), logits[:, i].clone())
        assert torch.equal(processed[:, i], expected)


class TableDrafter:
    """Drafts from a table {context: (token, confidence)} of generated tokens so far; token 0 with
    confidence 0.5 after a context the table lacks. Drafts are a function of the context alone, so
    they are fixed before a round's draws, as a real drafter's are."""

    target_layer_ids: tuple[int, ...] = ()
    # the real drafters' block size, the one calibration artifacts are fitted for
    block_size = 16
    # what identifies a drafter in a calibration artifact
    config = PretrainedConfig(table_drafter=True)

    def __init__(self, prompt_len: int, table: dict):
        self.prompt_len, self.table = prompt_len, table

    def fingerprint_config(self) -> dict:
        # what a calibration artifact records of this drafter (`hybridspec.fingerprint`)
        return self.config.to_dict()

    def bind(self, model) -> None:
        pass

    def start(self, input_ids, features) -> None:
        pass

    def propose(self, sequence: torch.Tensor) -> DraftBlock:
        context = tuple(sequence[0, self.prompt_len :].tolist())
        tokens, confidence = [], []
        for _ in range(self.block_size - 1):
            token, conf = self.table.get(context, (0, 0.5))
            tokens.append(token)
            confidence.append(conf)
            context += (token,)
        conf = torch.tensor([confidence])
        return DraftBlock(torch.tensor([tokens]), conf, torch.ones_like(conf))

    def observe(self, features, num_commit) -> None:
        pass


def high_accuracy(probs: torch.Tensor, context: tuple) -> tuple[int, float]:
    """The most likely token, with its probability as confidence (a calibrated drafter)."""
    token = int(probs.argmax())
    return token, probs[token].item()


def low_accuracy(probs: torch.Tensor, context: tuple) -> tuple[int, float]:
    """The least likely token the warpers keep, and after two-token contexts one they removed, at a
    confidence of 0.9 (an overconfident drafter, so adaptive lengths still verify several drafts)."""
    if len(context) == 2:
        return int((probs == 0).nonzero()[0]), 0.9
    return int(torch.where(probs > 0, probs, 2.0).argmin()), 0.9


def small_target():
    """The tiny target with one GDN and one attention layer (the statistics need thousands of
    generate calls, and the layer count does not enter the accept stage), its LM head scaled so
    that its distributions are as peaked as a trained model's (random logits have std ~0.15)."""
    torch.manual_seed(5)
    layers = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**TARGET, **layers})).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def model():
    m = hybridspec.enable(small_target())
    yield m
    hybridspec.disable(m)


PROMPT = torch.tensor([[11, 4, 97, 30]])
FIRST = 3
# top-k keeps the support of the first tokens small enough to enumerate
SETTINGS = {
    "T=0.7, top_k=3": dict(temperature=0.7, top_k=3),
    "T=1.2, top_k=4, top_p=0.9": dict(temperature=1.2, top_k=4, top_p=0.9),
}
DRAFTERS = {"high accuracy": high_accuracy, "low accuracy": low_accuracy}
# generate arguments per length policy, from the target and the drafter (a calibration names both)
LENGTHS = {
    "w=2": lambda model, drafter: dict(verify_length=2),
    "adaptive": lambda model, drafter: dict(policy="hybridspec"),
    # w0 = 2 always (a third token costs rho * 0.5 >= any p_2); the correction keeps token 3 when
    # p_2 > rho * (0.3 + 0.5 * (n_new - 1)): always for n_new = 0, never for n_new = 2
    "corrected": lambda model, drafter: dict(policy="hybridspec", calibration=synthetic_calibration(
        model, drafter, cost=tuple(0.5 * w for w in range(1, 17)), stage0_slope_ms=0.2, eta_ms=0.5)),
}
SAMPLES = 400


def exact_law(model, setting: dict) -> tuple[dict, dict]:
    """The target-only law of the first FIRST tokens, {tokens: probability}, by enumerating the
    support, and the processed conditionals {context: probs} it used. Each conditional is the
    distribution transformers' own sampling draws from after that context."""
    law, conditionals = {(): 1.0}, {}
    for _ in range(FIRST):
        contexts = list(law)
        generated = torch.tensor(contexts, dtype=torch.long).view(len(contexts), -1)
        ids = torch.cat([PROMPT.expand(len(contexts), -1), generated], 1)
        out = model.generate(ids, do_sample=True, max_new_tokens=1, return_dict_in_generate=True, output_scores=True,
                             **setting)
        probs = out.scores[0].double().softmax(-1)
        conditionals.update(zip(contexts, probs))
        law = {c + (x,): law[c] * p[x].item()
               for c, p in zip(contexts, probs) for x in p.nonzero().flatten().tolist()}
    return law, conditionals


@pytest.fixture(scope="module")
def laws(model):
    return {name: exact_law(model, setting) for name, setting in SETTINGS.items()}


def test_exact_law_is_target_only_sampling(model, laws):
    # the reference enumeration against transformers' own sampler, many rows at once
    for name, setting in SETTINGS.items():
        law = laws[name][0]
        torch.manual_seed(7)
        out = model.generate(PROMPT.expand(2000, -1), do_sample=True, max_new_tokens=FIRST, **setting)
        drawn = [tuple(row) for row in out[:, PROMPT.shape[1] :].tolist()]
        assert set(drawn) <= set(law), name
        keys = list(law)
        counts = torch.tensor([drawn.count(k) for k in keys])
        p = chi_square_pvalue(counts, len(drawn) * torch.tensor([law[k] for k in keys]))
        assert p > ALPHA, f"{name}: target-only sampling vs enumeration, p = {p:.2e}"


@pytest.mark.parametrize("length", list(LENGTHS))
@pytest.mark.parametrize("drafter_kind", list(DRAFTERS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_first_tokens_follow_target_only_sampling(model, laws, setting, drafter_kind, length):
    law, conditionals = laws[setting]
    pick = DRAFTERS[drafter_kind]
    drafter = TableDrafter(PROMPT.shape[1], {c: pick(probs, c) for c, probs in conditionals.items()})
    lengths = LENGTHS[length](model, drafter)
    torch.manual_seed(0)
    drawn, accepted, first_round = [], [], []
    for _ in range(SAMPLES):
        out = model.generate(PROMPT, do_sample=True, max_new_tokens=FIRST + 1, assistant_model=drafter,
                             hybridspec=True, return_dict_in_generate=True, **SETTINGS[setting], **lengths)
        drawn.append(tuple(out.sequences[0, PROMPT.shape[1] : PROMPT.shape[1] + FIRST].tolist()))
        stats = out.hybridspec_stats
        # rounds of w = 1 (one token left to generate) carry no draft
        accepted.extend(a for a, w in zip(stats.accepted, stats.verify_lengths) if w > 1)
        first_round.append((stats.nominal_lengths[0], stats.verify_lengths[0]))
    assert set(drawn) <= set(law), "a token sequence of probability 0 under target-only sampling"
    keys = list(law)
    counts = torch.tensor([drawn.count(k) for k in keys])
    p = chi_square_pvalue(counts, SAMPLES * torch.tensor([law[k] for k in keys]))
    rate = sum(a > 0 for a in accepted) / len(accepted)
    print(f"{setting}, {drafter_kind}, {length}: chi-square p = {p:.3f}, rounds keeping a draft {rate:.2f}")
    assert p > ALPHA, f"chi-square p = {p:.2e}"
    # the drafters reach the paths they are meant to: often accept, mostly reject
    assert rate > 0.4 if drafter_kind == "high accuracy" else rate < 0.2
    if length == "corrected":
        # first rounds (3 tokens left, w0 = 2): the correction adds token 3; for the high-accuracy
        # drafter, whose p_2 straddles the threshold, it also declines (the low-accuracy drafter's
        # p_2 = 0.81 clears it unless token 3 brings two new experts, which its drafts never do)
        assert {w0 for w0, _ in first_round} == {2}
        assert {w for _, w in first_round} == ({2, 3} if drafter_kind == "high accuracy" else {3})


def test_seed_reproduces_and_scores_are_the_processed_logits(model):
    setting = dict(temperature=0.7, top_k=20, top_p=0.95)
    free = model.generate(PROMPT, do_sample=False, max_new_tokens=24)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        drafter = ScriptedReplayDrafter(PROMPT.shape[1], free[0, PROMPT.shape[1] :], [3, 0, 15])
        runs.append(model.generate(PROMPT, do_sample=True, max_new_tokens=24, assistant_model=drafter,
                                   hybridspec=True, return_dict_in_generate=True, output_scores=True, **setting))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert not torch.equal(runs[0].sequences, runs[2].sequences)
    seq = runs[0].sequences
    logits = model(seq).logits[0, PROMPT.shape[1] - 1 : -1]
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.95)])
    for i, score in enumerate(runs[0].scores):
        expected = warpers(seq[:, : PROMPT.shape[1] + i], logits[i][None].clone())
        assert torch.equal(score.isfinite(), expected.isfinite())
        assert torch.allclose(score[score.isfinite()], expected[expected.isfinite()], atol=1e-4)
        assert score[0, seq[0, PROMPT.shape[1] + i]].isfinite()


@pytest.mark.parametrize("setting", [dict(top_k=1), dict(top_p=0.0), dict(temperature=0.5, top_p=1e-9)])
def test_settings_that_keep_one_token_equal_target_only(model, setting):
    # transformers keeps at least one token (min_tokens_to_keep=1): these settings sample the argmax
    torch.manual_seed(0)
    ref = model.generate(PROMPT, do_sample=True, max_new_tokens=20, **setting)
    drafter = ScriptedReplayDrafter(PROMPT.shape[1], ref[0, PROMPT.shape[1] :], [2, 0, 15])
    got = model.generate(PROMPT, do_sample=True, max_new_tokens=20, assistant_model=drafter, hybridspec=True,
                         **setting)
    assert torch.equal(got, ref)


def test_temperature_zero_raises_as_target_only(model):
    with pytest.raises(ValueError) as target_only:
        model.generate(PROMPT, do_sample=True, temperature=0.0, max_new_tokens=4)
    drafter = ScriptedReplayDrafter(PROMPT.shape[1], PROMPT[0], [0])
    with pytest.raises(ValueError) as ours:
        model.generate(PROMPT, do_sample=True, temperature=0.0, max_new_tokens=4, assistant_model=drafter,
                       hybridspec=True)
    assert str(ours.value) == str(target_only.value)


def test_a_position_with_no_token_left_raises_as_target_only(model):
    # a processor that masks every token: transformers' sampler raises, and so must the verifier
    class MaskAll:
        def __call__(self, input_ids, scores):
            return torch.full_like(scores, float("-inf"))

    kwargs = dict(do_sample=True, max_new_tokens=4, logits_processor=[MaskAll()])
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        model.generate(PROMPT, **kwargs)
    drafter = ScriptedReplayDrafter(PROMPT.shape[1], torch.zeros(8, dtype=torch.long), [3])
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        model.generate(PROMPT, assistant_model=drafter, hybridspec=True, verify_length=4, **kwargs)
