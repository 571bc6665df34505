"""Train the pair's target from scratch: corpus, tokenizer, a ~7M-parameter `Qwen3_5MoeForCausalLM`.

    PYTHONPATH=. python scripts/make_pair/train_target.py --out OUT --train-seconds 330

The target has the real models' structure in miniature: 4 layers (3 Gated DeltaNet : 1 gated
attention), 64 routed experts top-2 plus a shared expert, tied embedding and LM head, vocab 8192.
Trained with transformers' own torch GDN path (no fla), bf16 autocast on CUDA, AdamW with warm-up
and cosine decay fitted to a wall-clock budget, and the router's load-balancing loss so routing
does not collapse. Writes OUT/target (model in bf16 + tokenizer), OUT/heldout_prompts.jsonl,
OUT/drafter_corpus.jsonl (a seeded sample of training files for `hybridspec train-drafter`) and
OUT/target_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus as corpus_mod  # noqa: E402
import tokenizer as tokenizer_mod  # noqa: E402

HIDDEN = 192
TARGET = dict(
    vocab_size=8192, hidden_size=HIDDEN, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=HIDDEN, tie_word_embeddings=True,
    max_position_embeddings=4096, router_aux_loss_coef=0.01, output_router_logits=False,
    bos_token_id=None, eos_token_id=0, pad_token_id=1,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--train-seconds", type=float, default=330.0, help="wall-clock budget of the training loop")
    p.add_argument("--encode-seconds", type=float, default=60.0, help="budget for tokenising training files")
    p.add_argument("--max-files", type=int, default=None, help="first N source files only (dry runs)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.03)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--tokenizer-bytes", type=int, default=40_000_000)
    p.add_argument("--drafter-corpus-bytes", type=int, default=corpus_mod.DRAFTER_CORPUS_BYTES)
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows of --seq-len for the loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    return p.parse_args(argv)


def encode(tok, texts, eos_id, seconds):
    """Texts (in the given order) to one token stream with EOS after each, until the budget."""
    out, began, used = [], time.perf_counter(), 0
    for i in range(0, len(texts), 2000):
        for enc in tok.encode_batch(texts[i : i + 2000]):
            out.extend(enc.ids)
            out.append(eos_id)
        used = i + 2000
        if time.perf_counter() - began > seconds:
            break
    return torch.tensor(out, dtype=torch.int32), min(used, len(texts))


def pick_experts(model, x, autocast, cuda):
    """The fastest experts implementation that runs forward + backward here (grouped_mm needs a
    kernel for fp32 weights under autocast; eager always works), timed on 3 steps after a warm-up."""
    timings = {}
    for impl in ("grouped_mm", "batched_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            for i in range(4):
                if i == 1:
                    if cuda:
                        torch.cuda.synchronize()
                    began = time.perf_counter()
                with autocast:
                    model(x, labels=x, use_cache=False, output_router_logits=True).loss.backward()
            if cuda:
                torch.cuda.synchronize()
            timings[impl] = (time.perf_counter() - began) / 3
        except Exception as e:  # noqa: BLE001 - any failure rules the implementation out
            timings[impl] = repr(e)[:200]
        model.zero_grad(set_to_none=True)
    best = min((t, impl) for impl, t in timings.items() if isinstance(t, float))[1]
    model.set_experts_implementation(best)
    return best, timings


def lr_factor(step, total, warmup):
    warm = max(1, round(warmup * total))
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


@torch.no_grad()
def heldout_loss(model, stream, seq_len, windows, device, autocast):
    n = min(windows, len(stream) // seq_len)
    total = 0.0
    for i in range(0, n, 32):
        x = stream[i * seq_len : min(n, i + 32) * seq_len].view(-1, seq_len).long().to(device)
        with autocast:
            total += model(x, labels=x, use_cache=False).loss.float().item() * x.shape[0]
    return total / max(1, n), n * seq_len


def main(argv=None):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    args = parse_args(argv)
    began = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    out = Path(args.out)
    (out / "target").mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "torch": torch.__version__}
    try:
        import fla  # noqa: F401

        report["fla"] = "importable (NOT the torch GDN path)"
    except ImportError:
        report["fla"] = "not importable"

    corpus = corpus_mod.build(args.max_files)
    report["corpus"] = {"roots": [str(r) for r in corpus_mod.roots()], "files": corpus.files,
                        "duplicates": corpus.duplicates, "skipped": corpus.skipped, "bytes": corpus.bytes,
                        "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
                        "seconds": round(time.perf_counter() - began, 1)}
    print(json.dumps(report["corpus"]), flush=True)
    tok = tokenizer_mod.train(corpus.train, TARGET["vocab_size"], args.tokenizer_bytes, args.seed)
    tokenizer_mod.save(tok, str(out / "target"))
    eos = tok.token_to_id(tokenizer_mod.EOS)
    assert (eos, tok.token_to_id(tokenizer_mod.PAD)) == (TARGET["eos_token_id"], TARGET["pad_token_id"])
    prompts = corpus_mod.heldout_prompts(corpus, 64, args.seed)
    corpus_mod.write_jsonl(out / "heldout_prompts.jsonl", prompts)
    drafter_texts = corpus_mod.sample_texts(corpus.train, args.drafter_corpus_bytes, args.seed)
    corpus_mod.write_jsonl(out / "drafter_corpus.jsonl", [{"text": t} for t in drafter_texts])

    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(corpus.train), generator=gen).tolist()
    stream, used = encode(tok, [corpus.train[i] for i in order], eos, args.encode_seconds)
    held, _ = encode(tok, corpus.heldout, eos, 1e9)
    report["tokens"] = {"train": len(stream), "train_files_encoded": used, "heldout": len(held),
                        "seconds_since_start": round(time.perf_counter() - began, 1)}
    print(json.dumps(report["tokens"]), flush=True)

    torch.manual_seed(args.seed)
    config = Qwen3_5MoeTextConfig(**TARGET)
    model = Qwen3_5MoeForCausalLM(config).to(device).train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    S, B = args.seq_len, args.batch_size
    total, step, history = args.max_steps, 0, []
    offsets = torch.arange(S)
    probe = stream[torch.randint(0, len(stream) - S, (B,), generator=gen)[:, None] + offsets].long().to(device)
    report["experts_implementation"], report["experts_timings"] = pick_experts(model, probe, autocast, cuda)
    print(json.dumps({"experts": report["experts_timings"]}), flush=True)
    bar = tqdm(total=total, desc="train target", unit="step")
    t0 = time.perf_counter()
    while step < total:
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(step, total, args.warmup)
        starts = torch.randint(0, len(stream) - S, (B,), generator=gen)
        x = stream[starts[:, None] + offsets].long().to(device, non_blocking=True)
        with autocast:
            res = model(x, labels=x, use_cache=False, output_router_logits=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 10:
            if cuda:
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t0) / step
            total = max(step, min(args.max_steps, int(args.train_seconds / per_step)))
            bar.total = total
        if step % 50 == 0 or step == total:
            aux = res.aux_loss.float().item()
            row = {"step": step, "loss": res.loss.float().item() - config.router_aux_loss_coef * aux, "aux": aux,
                   "lr": opt.param_groups[0]["lr"], "seconds": round(time.perf_counter() - t0, 1)}
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", aux=f"{aux:.3f}")
        bar.update(1)
        if time.perf_counter() - t0 > args.train_seconds * 1.02:
            break
    bar.close()
    train_seconds = time.perf_counter() - t0

    model.eval().to(torch.bfloat16)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = TARGET["pad_token_id"]
    model.generation_config.bos_token_id = None
    model.save_pretrained(out / "target")
    loss, tokens = heldout_loss(model, held, S, args.eval_windows, device, nullcontext())
    report.update(parameters=params, steps=step, train_seconds=round(train_seconds, 1),
                  tokens_seen=step * B * S, tokens_per_second=round(step * B * S / train_seconds),
                  heldout_loss_bf16=loss, heldout_tokens=tokens, history=history,
                  tokenizer=tokenizer_mod.check_auto(str(out / "target"), tok, [p["prompt"] for p in prompts]))
    ids = torch.tensor([tok.encode(prompts[0]["prompt"]).ids], device=device)
    sample = model.generate(ids, max_new_tokens=64, do_sample=False)
    report["sample"] = {"prompt": prompts[0]["prompt"], "continuation": tok.decode(sample[0, ids.shape[1]:].tolist())}
    report["seconds"] = round(time.perf_counter() - began, 1)
    (out / "target_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("parameters", "steps", "tokens_per_second", "heldout_loss_bf16",
                                             "seconds", "tokenizer", "fla",
                                             "experts_implementation")}), flush=True)
    print(report["sample"]["continuation"], flush=True)


if __name__ == "__main__":
    main()
