"""Calibration prompts: JSONL loading (plain, chat, SPEED-Bench rows), the seeded split, rendering,
the byte-level fallback tokenizer and the tokenizer choice."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from hybridspec.calibration import prompts as P
from hybridspec.calibration.prompts import (
    SPEED_BENCH_PLACEHOLDER,
    ByteTokenizer,
    Prompt,
    load_prompts,
    load_tokenizer,
    render,
    split_prompts,
)
from tests.models import tiny_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"
# user turns as ` w2 CONTENT`, assistant turns as ` w3 CONTENT`, the generation prompt as ` w4`:
# every piece is a word of the tiny vocabulary
TEMPLATE = (
    "{% for m in messages %} w{{ 2 if m.role == 'user' else 3 }} {{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %} w4{% endif %}"
)


def write(tmp_path, rows, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def speed_bench_row(qid, category, turns, multiturn=False):
    """A row with the columns of the published nvidia/SPEED-Bench configs."""
    return {
        "question_id": qid, "category": category, "sub_category": None, "turns": turns,
        "source": "https://example.test/source", "src_id": "src_0", "difficulty": None,
        "multiturn": multiturn,
    }


@pytest.fixture
def chat_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_plain_prompts_categories_ids_and_blank_lines(tmp_path):
    path = write(tmp_path, [
        {"prompt": "w5 w6", "category": "coding"},
        "",
        "   ",
        {"prompt": "w7", "id": 42},
        {"prompt": "w8", "question_id": "q-8", "extra": [1, 2]},
    ])
    got = load_prompts(path)
    assert got == [
        Prompt(text="w5 w6", turns=None, category="coding", id="prompts.jsonl:1"),
        Prompt(text="w7", turns=None, category=None, id="42"),
        Prompt(text="w8", turns=None, category=None, id="q-8"),
    ]


def test_turns_as_strings_and_as_messages(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w5"}]
    path = write(tmp_path, [
        {"turns": ["w5", "w6"], "category": "chat"},
        {"turns": messages},
        {"messages": messages + [{"role": "assistant", "content": "w9", "name": "bot"}]},
    ])
    a, b, c = load_prompts(path)
    assert a.turns == ("w5", "w6") and a.text is None and a.category == "chat"
    assert b.turns == tuple(messages)
    # only role and content are kept
    assert c.turns[-1] == {"role": "assistant", "content": "w9"}


def test_speed_bench_rows_load_as_published(tmp_path):
    qid = "0123456789abcdef0123456789abcdef"
    path = write(tmp_path, [
        speed_bench_row(qid, "coding", ["Write binary search in C."]),
        speed_bench_row("f" * 32, "roleplay", ["Who are you?", "And where do you live?"], multiturn=True),
        # the JSONL form aiperf reads for SPEED-Bench
        {"question_id": "e" * 32, "category": "math", "messages": [{"role": "user", "content": "2 + 2?"}]},
    ])
    got = load_prompts(path)
    assert [(p.id, p.category, p.turns) for p in got] == [
        (qid, "coding", ("Write binary search in C.",)),
        ("f" * 32, "roleplay", ("Who are you?", "And where do you live?")),
        ("e" * 32, "math", ({"role": "user", "content": "2 + 2?"},)),
    ]


def test_masked_speed_bench_row_is_refused(tmp_path):
    row = speed_bench_row("a" * 32, "summarization", [f"{SPEED_BENCH_PLACEHOLDER}\n\nSummarise: {{article}}"])
    path = write(tmp_path, [speed_bench_row("b" * 32, "qa", ["Why is the sky blue?"]), row])
    with pytest.raises(ValueError, match=r"prompts\.jsonl:2: a masked SPEED-Bench row.*prepare_data"):
        load_prompts(path)


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "w5",', "not valid JSON"),
    ('["w5"]', "expected a JSON object, got list"),
    ('{"category": "qa"}', "a row needs exactly one of prompt, turns, messages; its keys are"),
    ('{"prompt": "w5", "turns": ["w6"]}', "a row needs exactly one of .*; it has prompt, turns"),
    ('{"prompt": "  "}', "`prompt` must be a non-empty string"),
    ('{"prompt": 5}', "`prompt` must be a non-empty string"),
    ('{"turns": []}', "`turns` must be a non-empty list"),
    ('{"turns": ["w5", 7]}', r"`turns\[1\]` must be a string or an object"),
    ('{"turns": ["w5", ""]}', r"`turns\[1\]` is empty"),
    ('{"messages": ["w5"]}', r"`messages\[0\]` must be an object"),
    ('{"messages": [{"role": "user"}]}', r"`messages\[0\]` must be an object with a string `role`"),
    ('{"messages": [{"role": "system", "content": "w5"}]}', "`messages` has no user message"),
    ('{"prompt": "w5", "category": 3}', "`category` must be a string"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, message):
    path = write(tmp_path, ['{"prompt": "w5"}', "", bad])
    with pytest.raises(ValueError, match=rf"prompts\.jsonl:3: {message}"):
        load_prompts(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"empty\.jsonl: no prompts"):
        load_prompts(path)


def make_prompts(n):
    return [Prompt(text=f"w{i + 2}", turns=None, category=None, id=str(i)) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 33])
@pytest.mark.parametrize("seed", [0, 1, 123])
def test_split_is_seeded_disjoint_and_covering(n, seed):
    prompts = make_prompts(n)
    calibration, held_out = split_prompts(prompts, seed=seed)
    assert (calibration, held_out) == split_prompts(prompts, seed=seed)
    assert len(calibration) == (n + 1) // 2 and len(held_out) == n // 2
    assert {p.id for p in calibration}.isdisjoint(p.id for p in held_out)
    assert sorted(calibration + held_out, key=lambda p: int(p.id)) == prompts
    # each half keeps file order
    assert calibration == sorted(calibration, key=lambda p: int(p.id))


def test_split_is_pinned_and_depends_on_the_seed():
    # pinned: the shuffle draws only on Random.random(), whose sequence Python keeps across versions
    calibration, held_out = split_prompts(make_prompts(10), seed=0)
    assert [p.id for p in calibration] == ["0", "2", "4", "5", "9"]
    assert [p.id for p in held_out] == ["1", "3", "6", "7", "8"]
    assert split_prompts(make_prompts(10), seed=1) != (calibration, held_out)


def test_split_of_nothing_raises():
    with pytest.raises(ValueError, match="no prompts"):
        split_prompts([])


@pytest.mark.parametrize("vocab_size", [256, 300, 248320])
def test_byte_tokenizer_round_trip(vocab_size):
    tok = ByteTokenizer(vocab_size)
    text = "Hello, world!\n\tx = [1, 2]  # ok ~ {}"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    # every byte is one token, non-ASCII included
    text = "wörld € 日本"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(tok(text)["input_ids"]) == text


def test_byte_tokenizer_folds_a_small_vocabulary():
    tok = ByteTokenizer(128)
    text = "ascii stays; wörld € 日本 folds"
    ids = tok(text)["input_ids"]
    assert ids == [b % 128 for b in text.encode()] and max(ids) < 128
    assert tok.decode(tok("plain ASCII, exact.")["input_ids"]) == "plain ASCII, exact."
    assert max(ByteTokenizer(5)(text)["input_ids"]) < 5


def test_byte_tokenizer_has_no_extras():
    tok = ByteTokenizer(128)
    assert tok("")["input_ids"] == [] and tok("w")["input_ids"] == [ord("w")]
    assert tok.chat_template is None and len(tok) == 128
    with pytest.raises(ValueError, match="at least 1"):
        ByteTokenizer(0)


def test_render_text_prompt():
    ids = render(Prompt(text="w5 w9 w30", turns=None, category=None, id="a"), tiny_tokenizer())
    assert ids.dtype == torch.long and ids.tolist() == [[5, 9, 30]]


def test_render_turns_with_chat_template(chat_tokenizer):
    strings = Prompt(text=None, turns=("w5 w6", "w7"), category=None, id="a")
    # every user turn, as successive user messages, then the generation prompt
    assert render(strings, chat_tokenizer).tolist() == [[2, 5, 6, 2, 7, 4]]
    messages = Prompt(text=None, turns=(
        {"role": "system", "content": "w9"}, {"role": "user", "content": "w5"},
        {"role": "assistant", "content": "w6"}, "w7", {"role": "assistant", "content": "w8"},
    ), category=None, id="b")
    # the trailing assistant reply is not prompt
    assert render(messages, chat_tokenizer).tolist() == [[3, 9, 2, 5, 3, 6, 2, 7, 4]]


def test_render_speed_bench_row(tmp_path, chat_tokenizer):
    path = write(tmp_path, [speed_bench_row("c" * 32, "qa", ["w11 w12", "w13"], multiturn=True)])
    (prompt,) = load_prompts(path)
    assert render(prompt, chat_tokenizer).tolist() == [[2, 11, 12, 2, 13, 4]]


def test_render_without_template_joins_turns_and_warns_once(monkeypatch):
    monkeypatch.setattr(P, "_warned_no_template", False)
    tok = ByteTokenizer(128)
    prompt = Prompt(text=None, turns=("ab", {"role": "user", "content": "c"}), category=None, id="a")
    with pytest.warns(UserWarning, match="no chat template"):
        assert render(prompt, tok).tolist() == [list(b"ab\nc")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert render(prompt, tok).tolist() == [list(b"ab\nc")]


def test_render_of_nothing_raises():
    with pytest.raises(ValueError, match="'empty' renders to no tokens"):
        render(Prompt(text="", turns=None, category=None, id="empty"), ByteTokenizer(128))


def test_load_tokenizer_prefers_the_given_directory(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    target = tmp_path / "target"
    target.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = load_tokenizer(tmp_path / "tok", target, vocab_size=128)
    assert tok("w5 w9")["input_ids"] == [5, 9]


def test_load_tokenizer_from_the_target_directory(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = load_tokenizer(None, tmp_path, vocab_size=128)
    assert not isinstance(tok, ByteTokenizer) and tok("w7")["input_ids"] == [7]


@pytest.mark.parametrize("has_dir", [True, False])
def test_load_tokenizer_falls_back_to_bytes_with_a_warning(tmp_path, has_dir):
    (tmp_path / "config.json").write_text("{}")
    target = tmp_path if has_dir else None
    why = "has no tokenizer files" if has_dir else "the target has no directory"
    with pytest.warns(UserWarning, match=f"{why}.*built-in byte-level tokenizer"):
        tok = load_tokenizer(None, target, vocab_size=128)
    assert isinstance(tok, ByteTokenizer) and max(tok("ü€")["input_ids"]) < 128


def test_load_tokenizer_refuses_ids_past_the_vocabulary(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="ids up to 127, past the target's vocabulary of 100"):
        load_tokenizer(tmp_path, None, vocab_size=100)


def test_example_prompts_file():
    prompts = load_prompts(EXAMPLE)
    assert len(prompts) >= 16 and all(p.category for p in prompts)
    assert any(p.turns and len(p.turns) > 1 for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    tok = ByteTokenizer(128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert all(0 < render(p, tok).shape[1] and render(p, tok).max() < 128 for p in prompts)
