"""`hybridspec train-drafter` end to end on the tiny target (CPU, a few steps): the checkpoint loads
with `DFlashDrafter.from_pretrained`, the upstream reference forward (PyPI dflash==0.1.0) reproduces
it, and the report comes from real speculative runs."""

import json
import random

import pytest
import torch
from transformers import Qwen3Config

from hybridspec import DFlashDrafter
from hybridspec.cli import main
from hybridspec.tiny import VOCAB
from hybridspec.training.train import default_taps
from tests.drafter.test_dflash import reference
from tests.helpers import assert_rel
from tests.models import qwen35_causal_lm

MASK = VOCAB - 3


def _tokenizer(directory):
    """A word-level tokenizer over the tiny vocab (`w{i}` words) with EOS 1, pad 0 and mask 125."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"Ġw{i}": i for i in range(2, VOCAB) if i != MASK}, "<mask>": MASK}
    tok = Tokenizer(models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                            mask_token="<mask>").save_pretrained(directory)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    qwen35_causal_lm().save_pretrained(root / "target")
    _tokenizer(root / "tokenizer")
    rng = random.Random(0)
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(30):
            words = " ".join(f"w{rng.randrange(2, 100)}" for _ in range(rng.randrange(12, 40)))
            f.write(json.dumps({"text": words}) + "\n")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "w5 w17 w33 w64 w12 w90"}) + "\n")
    argv = ["train-drafter", "--target", str(root / "target"), "--tokenizer", str(root / "tokenizer"),
            "--corpus", str(root / "corpus.jsonl"), "--out", str(root / "drafter"), "--device", "cpu",
            "--num-layers", "2", "--num-sequences", "8", "--prompt-tokens", "6", "--response-tokens", "20",
            "--generate-batch", "8", "--batch-size", "4", "--blocks-per-sequence", "4", "--steps", "4",
            "--log-every", "2", "--eval-prompts", str(root / "prompts.jsonl"), "--eval-count", "1",
            "--eval-new-tokens", "6"]
    assert main(argv) == 0
    return root


def test_checkpoint_loads_and_reports_acceptance(trained):
    drafter = DFlashDrafter.from_pretrained(trained / "drafter")
    assert drafter.mask_token_id == MASK and drafter.block_size == 16
    assert drafter.target_layer_ids == (0, 1, 2) == tuple(default_taps(4))
    assert len(drafter.layers) == 2
    report = json.loads((trained / "drafter" / "report.json").read_text())
    assert report["steps"] == 4 and [r["step"] for r in report["history"]] == [2, 4]
    assert set(report["acceptance"]) == {"greedy", "greedy, verify_length=16", "temperature 1",
                                         "temperature 1, verify_length=16"}
    greedy = report["acceptance"]["greedy"]
    assert greedy["identical_to_target_greedy"] == greedy["prompts"] == 1
    assert greedy["mean_acceptance_length"] >= 1.0
    # the shared embedding and head are the target's: the checkpoint holds no copy
    from safetensors.torch import load_file

    assert not any("embed" in k or "lm_head" in k for k in load_file(trained / "drafter" / "model.safetensors"))


def test_checkpoint_matches_the_reference_forward(trained):
    ours = DFlashDrafter.from_pretrained(trained / "drafter", dtype=torch.float32)
    raw = json.loads((trained / "drafter" / "config.json").read_text())
    ref = reference().DFlashDraftModel(Qwen3Config(**raw)).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("embed" in k or "lm_head" in k for k in missing)
    gen = torch.Generator().manual_seed(0)
    hidden = raw["hidden_size"]
    target_hidden = torch.randn(2, 9, len(ours.target_layer_ids) * hidden, generator=gen)
    noise = torch.randn(2, 16, hidden, generator=gen)
    position_ids = torch.arange(25)[None].expand(2, -1)
    with torch.no_grad():
        assert_rel(ours(target_hidden, noise, position_ids),
                   ref(position_ids=position_ids, noise_embedding=noise, target_hidden=target_hidden), 1e-5, "forward")


def test_help_documents_every_option(capsys):
    from hybridspec.training.options import option_fields

    with pytest.raises(SystemExit):
        main(["train-drafter", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, _, default, _, required in option_fields():
        assert f"--{name.replace('_', '-')}" in text
    assert "(default: 16)" in text and "(default: 0.0006)" in text
