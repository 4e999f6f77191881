"""Builds the tool agent's data files and its supervised warm start.

    .venv/bin/python examples/tool_agent/make_warm_start.py

Writes `data/train.jsonl`, `data/eval.jsonl` and `warm_start/` (an HF checkpoint with the
byte tokenizer) next to this file. The warm start is a fresh tiny Qwen3 trained with
next-token cross-entropy on formatted episodes of three kinds, mixed the way a model that
has seen tools but not learned when they pay off would behave:

- `tool` (--tool-frac): calls `python` with the expression, reads the response, answers;
- `wrong_tool` (--wrong-tool-frac): calls a `calculator` tool that does not exist, gets the
  error response, then answers from "mental arithmetic";
- `direct` (the rest): answers from "mental arithmetic" right away.

Every episode is produced by the real environment (`env.ToolAgentEnv`) with the real
sandbox, so its prompt, tool responses and error texts are byte for byte what GRPO will see.
Mental-arithmetic answers are the true values: the model cannot learn 3-digit
multiplication at this size, so those answers are wrong when it generates them. The
result answers directly most of the time, which is why its held-out success is low;
GRPO has to discover that calling the tool pays. Training stops once the model copies well
enough on the tool path (`--stop-at-tool-path-exact`); GRPO makes the copying exact. Deterministic for a seed (single-threaded
CPU; sandbox outputs are deterministic).

At the end the script measures the warm start as a run would, with the real vLLM engine
and sandbox: greedy held-out accuracy and the success rate of sampled episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # so `import task` / `import env` find the example's modules

import task  # noqa: E402
from env import ToolAgentEnv  # noqa: E402

from titanrl.data import write_rows  # noqa: E402
from titanrl.envs import SandboxPool  # noqa: E402
from titanrl.models.hf_checkpoint import save_checkpoint  # noqa: E402
from titanrl.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from titanrl.models.tiny import tiny_config  # noqa: E402
from titanrl.models.tokenizer import build_byte_tokenizer, save_byte_tokenizer  # noqa: E402
from titanrl.trainer.grpo import token_logprobs  # noqa: E402

BEHAVIOURS = ("tool", "wrong_tool", "direct")


@dataclass
class Episode:
    """One formatted episode as token ids, with the loss mask over the model's own tokens."""

    ids: list[int]
    """Prompt, model turns and observations, in order."""
    mask: list[int]
    """1 where the token is the model's (the SFT target), 0 for prompt and observations."""
    prompt_len: int
    """Tokens of the prompt; the first model token follows it."""
    behaviour: str
    """Which of BEHAVIOURS the episode shows."""
    reward: float
    """What the environment scored it (1.0 only for correct `tool` episodes)."""


async def play(pool: SandboxPool, tok, row: dict[str, str], behaviour: str, im_end: int) -> Episode:
    """Runs one scripted episode through the real environment and tokenizes it as the worker would."""
    env = ToolAgentEnv(pool)
    prompt = await env.reset(row)
    ids = tok.encode(prompt).ids
    prompt_len = len(ids)
    mask = [0] * len(ids)
    turns = [] if behaviour == "direct" else [task.tool_call(row["expression"], task.TOOL_NAME if behaviour == "tool"
                                                                 else task.WRONG_TOOL_NAME)]
    turns.append(row["answer"])
    reward = 0.0
    for text in turns:
        action = tok.encode(text).ids
        result = await env.step(text)
        if result.done:
            action.append(im_end)  # a final turn ends at <|im_end|>, a stop token of the worker
            reward = result.reward
        ids += action
        mask += [1] * len(action)
        if not result.done:
            obs = tok.encode(result.observation).ids
            ids += obs
            mask += [0] * len(obs)
    await env.close()
    return Episode(ids, mask, prompt_len, behaviour, reward)


async def play_all(rows: list[dict[str, str]], behaviours: list[str], tok, im_end: int) -> list[Episode]:
    async with SandboxPool(size=4) as pool:
        return list(await asyncio.gather(*(play(pool, tok, r, b, im_end) for r, b in zip(rows, behaviours, strict=True))))


def build_batch(episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs, next-token targets and the loss mask shifted onto the targets."""
    T = max(len(e.ids) for e in episodes) - 1
    inputs = torch.zeros(len(episodes), T, dtype=torch.long)
    targets = torch.zeros(len(episodes), T, dtype=torch.long)
    mask = torch.zeros(len(episodes), T)
    for i, e in enumerate(episodes):
        n = len(e.ids) - 1
        inputs[i, :n] = torch.tensor(e.ids[:-1])
        targets[i, :n] = torch.tensor(e.ids[1:])
        mask[i, :n] = torch.tensor(e.mask[1:], dtype=torch.float)
    return inputs, targets, mask


@torch.no_grad()
def diagnose(model: Qwen3ForCausalLM, tool_episodes: list[Episode], lt_id: int) -> dict[str, float]:
    """Teacher-forced checks on held-out `tool` episodes.

    `p_tool_first`: mean probability that the first model token is `<` (starts a tool call).
    `tool_path_exact`: fraction of episodes where argmax is right at every model token after
    the first: exactly the episodes greedy decoding completes correctly once it has chosen
    to call the tool.
    """
    inputs, targets, mask = build_batch(tool_episodes)
    logits = model(inputs)
    first = torch.tensor([e.prompt_len - 1 for e in tool_episodes])
    rows = torch.arange(len(tool_episodes))
    p_tool = logits[rows, first].softmax(-1)[:, lt_id]
    right = (logits.argmax(-1) == targets) | (mask == 0)
    right[rows, first] = True
    return {"p_tool_first": p_tool.mean().item(), "tool_path_exact": right.all(-1).float().mean().item()}


def measure_with_engine(checkpoint: Path, samples: int) -> dict[str, float]:
    """Greedy accuracy and sampled-episode success on eval rows, with the real vLLM + sandbox."""
    from config import config  # the example's config.py

    from titanrl.commands.evaluate import evaluate_checkpoint

    report = evaluate_checkpoint(config, checkpoint, k=1, samples=samples)
    return {"eval_greedy_accuracy": report.accuracy, "eval_sampled_success": report.sample_accuracy,
            "eval_samples_per_prompt": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "warm_start")
    parser.add_argument("--data-dir", type=Path, default=HERE / "data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-examples", type=int, default=5000, help="formatted episodes to train on")
    parser.add_argument("--tool-frac", type=float, default=0.15, help="share of `tool` episodes")
    parser.add_argument("--wrong-tool-frac", type=float, default=0.05, help="share of `wrong_tool` episodes")
    parser.add_argument("--max-steps", type=int, default=2000, help="SFT optimizer steps at most")
    parser.add_argument("--stop-at-tool-path-exact", type=float, default=0.7,
                        help="stop at the first check where this fraction of held-out *dev* tool episodes is "
                        "right token for token: the copy skills are mostly there, GRPO polishes them (the "
                        "mix, not the step count, sets how often the model calls the tool)")
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--train-rows", type=int, default=20_000)
    parser.add_argument("--eval-samples", type=int, default=8, help="sampled episodes per eval row for the "
                        "final measurement (0 skips it)")
    parser.add_argument("--measure-only", action="store_true", help="skip training: measure the checkpoint "
                        "already in --out and update its warm_start.json")
    args = parser.parse_args()
    if args.measure_only:
        meta_path = args.out / "warm_start.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        meta.update(measure_with_engine(args.out, args.eval_samples))
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        print(json.dumps(meta))
        return
    if not 0 <= args.tool_frac + args.wrong_tool_frac <= 1:
        parser.error("--tool-frac + --wrong-tool-frac must be within [0, 1]")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    start = time.time()

    write_rows(args.data_dir / "train.jsonl", list(itertools.islice(task.train_rows(seed=args.seed + 1),
                                                                   args.train_rows)))
    write_rows(args.data_dir / "eval.jsonl", task.eval_rows())
    # The warm start sees a disjoint stream of problems.
    sft_rows = list(itertools.islice(task.train_rows(seed=args.seed + 2), args.sft_examples))
    rng = random.Random(args.seed)
    weights = (args.tool_frac, args.wrong_tool_frac, 1 - args.tool_frac - args.wrong_tool_frac)
    behaviours = rng.choices(BEHAVIOURS, weights=weights, k=len(sft_rows))

    tok = build_byte_tokenizer()
    im_end, lt_id = tok.token_to_id("<|im_end|>"), tok.encode("<").ids[0]
    episodes = asyncio.run(play_all(sft_rows, behaviours, tok, im_end))
    dev = asyncio.run(play_all(task.dev_rows(), ["tool"] * task.DEV_SIZE, tok, im_end))
    bad = [e for e in episodes if (e.reward == 1.0) != (e.behaviour == "tool")]
    if bad:  # the scripted tool episodes must be exactly the rewarded ones, or the data is wrong
        raise RuntimeError(f"{len(bad)} scripted episodes scored unexpectedly, e.g. {tok.decode(bad[0].ids)!r}")
    longest = max(len(e.ids) for e in episodes + dev)
    print(f"{len(episodes)} episodes ({', '.join(f'{b} {behaviours.count(b)}' for b in BEHAVIOURS)}), "
          f"longest {longest} tokens, played in {time.time() - start:.0f}s", flush=True)

    config = tiny_config(**task.MODEL_CONFIG)
    if longest > config.max_position_embeddings:
        raise RuntimeError(f"episodes of {longest} tokens exceed max_position_embeddings "
                           f"{config.max_position_embeddings}")
    model = Qwen3ForCausalLM(config)
    model.init_weights(seed=args.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    order: list[int] = []
    stats: dict[str, float] = {}
    for step in range(1, args.max_steps + 1):
        if len(order) < args.batch_size:
            perm = list(range(len(episodes)))
            rng.shuffle(perm)
            order += perm
        batch, order = [episodes[i] for i in order[: args.batch_size]], order[args.batch_size :]
        inputs, targets, mask = build_batch(batch)
        loss = -(token_logprobs(model(inputs), targets) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.check_every == 0 or step == args.max_steps:
            stats = diagnose(model, dev, lt_id)
            print(f"step {step:5d}  loss {loss.item():.4f}  dev: p(tool first) {stats['p_tool_first']:.2f}  "
                  f"tool path exact {stats['tool_path_exact']:.1%}  {time.time() - start:.0f}s", flush=True)
            if stats["tool_path_exact"] >= args.stop_at_tool_path_exact:
                break

    save_checkpoint(model, args.out)
    save_byte_tokenizer(args.out, model_max_length=config.max_position_embeddings)
    summary = {"sft_examples": args.sft_examples, "tool_frac": args.tool_frac, "wrong_tool_frac": args.wrong_tool_frac,
               "steps": step, "lr": args.lr, "batch_size": args.batch_size, "seed": args.seed,
               **{f"dev_{k}": v for k, v in stats.items()}}
    if args.eval_samples > 0:
        summary.update(measure_with_engine(args.out, args.eval_samples))
    (args.out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print(f"wrote {args.out} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
