"""The committed reference pair (assets/pair, docs/pair.md): it loads with plain transformers and
`DFlashDrafter.from_pretrained`, and in fp32 on the CPU greedy speculative decoding of held-out
prompts is token-identical to target-only greedy, with real (not simulated) acceptance."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridspec
from hybridspec import DFlashDrafter

PAIR = Path(__file__).resolve().parents[2] / "assets" / "pair"
PROMPTS, NEW_TOKENS = 16, 64
# issue 17's bar: mean tokens per verification round over the held-out prompts (the committed
# drafter measures 3.54 with both settings, docs/pair.md; a drafter that learned nothing, ~1.0)
ACCEPTANCE_BAR = 3.0
MiB = 1 << 20


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    # two pytest workers on two cores: more threads per worker only contend
    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    drafter = DFlashDrafter.from_pretrained(PAIR / "drafter", dtype=torch.float32)
    rows = [json.loads(line) for line in (PAIR / "heldout_prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [torch.tensor([tokenizer(r["prompt"])["input_ids"]]) for r in rows[:PROMPTS]]
    reference = [target.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts]
    yield hybridspec.enable(target), tokenizer, drafter, rows, prompts, reference
    hybridspec.disable(target)
    torch.set_num_threads(threads)


def test_pair_files_and_structure(pair):
    target, tokenizer, drafter, rows, _, _ = pair
    sizes = {p: p.stat().st_size for p in PAIR.rglob("*") if p.is_file()}
    assert max(sizes.values()) <= 16 * MiB and sum(sizes.values()) <= 24 * MiB
    assert len(rows) == 64 and all(r["prompt"].strip() for r in rows)
    tc = target.config
    assert type(target).__name__ == "Qwen3_5MoeForCausalLM"
    assert tc.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (tc.num_experts, tc.num_experts_per_tok) == (64, 2) and tc.shared_expert_intermediate_size > 0
    assert tc.tie_word_embeddings and target.lm_head.weight is target.model.embed_tokens.weight
    assert sum(p.numel() for p in target.parameters()) <= 10_000_000
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1)
    assert tokenizer.mask_token_id == drafter.mask_token_id == 2
    assert max(tokenizer.get_vocab().values()) < tc.vocab_size
    assert drafter.block_size == 16 and drafter.bind(target) is drafter


@pytest.mark.parametrize("verify_length", [None, 16], ids=["default_policy", "verify_length_16"])
def test_greedy_speculation_is_exact_and_accepts(pair, verify_length):
    target, _, drafter, _, prompts, reference = pair
    lengths = []
    for prompt, ref in zip(prompts, reference):
        out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                              assistant_model=drafter, hybridspec=True, verify_length=verify_length)
        assert torch.equal(out.sequences, ref), f"prompt {len(lengths)}: not target-only greedy"
        stats = out.hybridspec_stats
        # a prompt whose first token ends generation has no verification round
        if stats.rounds:
            lengths.append(stats.mean_acceptance_length)
    mean = sum(lengths) / len(lengths)
    print(f"mean acceptance length {mean:.2f} over {len(lengths)} prompts")
    assert mean >= ACCEPTANCE_BAR, f"mean acceptance length {mean:.2f} < {ACCEPTANCE_BAR}"
