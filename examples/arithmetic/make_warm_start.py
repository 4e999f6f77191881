"""Builds the arithmetic example's data files and its supervised warm start.

    .venv/bin/python examples/arithmetic/make_warm_start.py

Writes `data/train.jsonl`, `data/eval.jsonl` and `warm_start/` (an HF checkpoint with the
byte tokenizer) next to this file. The warm start is a fresh tiny Qwen3 trained with
next-token cross-entropy on a few thousand correct sums and deliberately stopped early:
it has learned the format and sometimes the answer, so GRPO sees groups with mixed
rewards (signal) while held-out greedy accuracy is still low. Deterministic for a seed
(single-threaded CPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # so `import task` finds the example's task.py

import task  # noqa: E402  (the example's own module, next to this file)

from titanrl.data import write_rows  # noqa: E402
from titanrl.models.hf_checkpoint import save_checkpoint  # noqa: E402
from titanrl.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from titanrl.models.tiny import EOS_TOKEN_ID, tiny_config  # noqa: E402
from titanrl.models.tokenizer import build_byte_tokenizer, save_byte_tokenizer  # noqa: E402
from titanrl.trainer.grpo import token_logprobs  # noqa: E402


def build_batch(tok, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs, next-token targets and a mask over the answer + eos tokens."""
    seqs, prompt_lens = [], []
    for row in rows:
        p = tok.encode(row["prompt"]).ids
        a = tok.encode(row["answer"]).ids + [EOS_TOKEN_ID]
        seqs.append(p + a)
        prompt_lens.append(len(p))
    T = max(map(len, seqs)) - 1
    inputs = torch.full((len(seqs), T), EOS_TOKEN_ID)
    targets = torch.full((len(seqs), T), EOS_TOKEN_ID)
    mask = torch.zeros(len(seqs), T)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        targets[i, : len(s) - 1] = torch.tensor(s[1:])
        mask[i, p - 1 : len(s) - 1] = 1.0
    return inputs, targets, mask


@torch.no_grad()
def greedy_accuracy(model: Qwen3ForCausalLM, tok, rows: list[dict], max_new_tokens: int) -> float:
    """Exact-match accuracy of greedy decoding (no KV cache: sequences are ~15 tokens)."""
    correct = 0
    for lo in range(0, len(rows), 100):
        chunk = rows[lo : lo + 100]
        prompts = [tok.encode(r["prompt"]).ids for r in chunk]
        # All prompts of a chunk are left-aligned; decode each row independently of padding
        # by running rows of equal prompt length together.
        for length in sorted({len(p) for p in prompts}):
            idx = [i for i, p in enumerate(prompts) if len(p) == length]
            ids = torch.tensor([prompts[i] for i in idx])
            for _ in range(max_new_tokens):
                nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
            for row_i, seq in zip(idx, ids.tolist(), strict=True):
                out = seq[length:]
                out = out[: out.index(EOS_TOKEN_ID)] if EOS_TOKEN_ID in out else out
                text = tok.decode(out)
                correct += task.reward(chunk[row_i]["prompt"], text, **{"answer": chunk[row_i]["answer"]}) >= 1.0
    return correct / len(rows)


def build_parser(description: str | None, out: Path) -> argparse.ArgumentParser:
    """The warm start's flags (shared with examples/moe/make_warm_start.py), writing to `out`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--data-dir", type=Path, default=HERE / "data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-examples", type=int, default=4000, help="distinct correct sums to train on")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument(
        "--stop-at-dev-accuracy", type=float, default=0.2,
        help="stop at the first check where held-out *dev* greedy accuracy reaches this",
    )
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--train-rows", type=int, default=20_000)
    return parser


def main() -> None:
    args = build_parser(__doc__, HERE / "warm_start").parse_args()
    model = Qwen3ForCausalLM(tiny_config(**task.MODEL_CONFIG))
    model.init_weights(seed=args.seed)
    train_warm_start(model, args)


def train_warm_start(model: Qwen3ForCausalLM, args: argparse.Namespace) -> None:
    """Writes the data files and `model` trained on correct sums until dev accuracy reaches the stop."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    eval_rows = task.eval_rows()
    train_rows = list(itertools.islice(task.train_rows(seed=args.seed + 1), args.train_rows))
    write_rows(args.data_dir / "train.jsonl", train_rows)
    write_rows(args.data_dir / "eval.jsonl", eval_rows)
    # The warm start sees a disjoint, smaller slice of the training stream.
    sft_rows = list(itertools.islice(task.train_rows(seed=args.seed + 2), args.sft_examples))

    tok = build_byte_tokenizer()
    config = model.config
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    rng = random.Random(args.seed)
    order: list[int] = []
    start = time.time()
    dev_rows = task.dev_rows()
    dev_acc = 0.0
    for step in range(1, args.max_steps + 1):
        if len(order) < args.batch_size:
            perm = list(range(len(sft_rows)))
            rng.shuffle(perm)
            order += perm
        batch, order = [sft_rows[i] for i in order[: args.batch_size]], order[args.batch_size :]
        inputs, targets, mask = build_batch(tok, batch)
        loss = -(token_logprobs(model(inputs), targets) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.check_every == 0:
            # Below a loss of ~1.2 the model has not learned the format; skip the slow check.
            dev_acc = greedy_accuracy(model, tok, dev_rows, task.MAX_NEW_TOKENS) if loss.item() < 1.2 else 0.0
            print(f"step {step:5d}  loss {loss.item():.4f}  dev greedy acc {dev_acc:.1%}  "
                  f"{time.time() - start:.0f}s", flush=True)
            if dev_acc >= args.stop_at_dev_accuracy:
                break
    acc = greedy_accuracy(model, tok, eval_rows, task.MAX_NEW_TOKENS)
    save_checkpoint(model, args.out)
    save_byte_tokenizer(args.out, model_max_length=config.max_position_embeddings)
    (args.out / "warm_start.json").write_text(
        json.dumps({"sft_examples": args.sft_examples, "steps": step, "lr": args.lr, "batch_size": args.batch_size,
                    "seed": args.seed, "dev_greedy_accuracy": dev_acc, "eval_greedy_accuracy": acc}, indent=2)
    )
    print(f"held-out greedy accuracy {acc:.1%}; wrote {args.out}")


if __name__ == "__main__":
    main()
