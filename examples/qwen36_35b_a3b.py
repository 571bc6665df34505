"""HybridSpec on the real Qwen3.6-35B-A3B with its DFlash drafter (needs the weights and one GPU).

    python examples/qwen36_35b_a3b.py --target /path/to/Qwen3.6-35B-A3B --drafter /path/to/Qwen3.6-35B-A3B-DFlash \
        [--calibration calib.json]

Both directories are local copies of the Hugging Face checkpoints (`huggingface-cli download ...`).
The bf16 target takes about 70 GB of GPU memory. `--calibration` takes the artifact of
`hybridspec calibrate --target ... --drafter ... --prompts examples/prompts.jsonl --out calib.json`
(docs/calibration.md); without it the length policy is the built-in default.
"""

import argparse
import time

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

import hybridspec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--calibration", default=None, help="artifact of `hybridspec calibrate` for this pair")
    args = ap.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    # the checkpoints use the image-text layout; hybridspec generates text with it
    model = AutoModelForImageTextToText.from_pretrained(args.target, dtype=torch.bfloat16, device_map="cuda")
    drafter = hybridspec.DFlashDrafter.from_pretrained(args.drafter, dtype=torch.bfloat16, device="cuda")
    hybridspec.enable(model)

    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).to("cuda")
    speculative = dict(assistant_model=drafter, hybridspec=True, calibration=args.calibration)
    for name, extra in (("target only", {}), ("hybridspec", speculative)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             return_dict_in_generate=True, **extra)
        torch.cuda.synchronize()
        new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
        print(f"{name}: {new / (time.perf_counter() - start):.1f} tokens/s")
        if name == "hybridspec":
            print(f"mean acceptance length {out.hybridspec_stats.mean_acceptance_length:.2f}")
    print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
