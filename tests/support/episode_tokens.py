"""Token-level checks of multi-turn samples (environment episodes and agent episodes alike)."""

from __future__ import annotations

import torch


def check_training_tokens(trainer, groups, tokenizer) -> None:
    """Observation tokens are exactly the environment's text and get zero loss gradient;
    every model token gets a gradient."""
    from titanrl.trainer.batch import pack
    from titanrl.trainer.grpo import clipped_surrogate_loss

    observations = 0
    for group in groups:
        for s in group.samples:
            env_texts = [t["text"] for t in s.turns if t["role"] == "env"]
            runs, run = [], []
            for token, m in zip(s.completion_ids, s.loss_mask, strict=True):
                if m == 0:
                    run.append(token)
                elif run:
                    runs.append(run)
                    run = []
            runs += [run] if run else []
            assert [tokenizer.decode(r, skip_special_tokens=False) for r in runs] == env_texts
            observations += len(runs)
    assert observations > 0, "no episode had an inserted observation: nothing to check"

    batch = pack(groups, trainer.pad_id, current_version=0)
    logits = trainer.model(batch.input_ids_BT)
    logprobs = trainer.token_logprobs(logits, batch.targets_BT).detach().requires_grad_(True)
    advantages = torch.ones_like(batch.advantages_B)  # every row trains, so every model token must get a gradient
    loss, _ = clipped_surrogate_loss(logprobs, batch.old_logprobs_BT, advantages, batch.loss_mask_BT, 0.2)
    loss.backward()
    rows = [s for g in groups for s in g.samples]
    for i, s in enumerate(rows):
        start = len(s.prompt_ids) - 1  # target index of the first completion token
        grad = logprobs.grad[i, start : start + len(s.completion_ids)]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
        assert (grad[mask] != 0).all()
        assert torch.equal(logprobs.grad[i, :start], torch.zeros(start))  # the prompt carries no loss either
