"""Optimizer param groups: no weight decay on norms, biases and the embedding (a tied LM head
included), decay on the other matrices; the groups survive a checkpoint resumed under another
layout (FSDP2 or a pipeline -> one process), and an older single-group checkpoint still loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanrl.config import ModelConfig
from titanrl.trainer.lr_schedule import build_scheduler
from support.layout_check import make_case
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup

WEIGHT_DECAY = 0.5
"""Large, so that decaying a parameter that must not be decayed (lr 1e-3: a norm's gain of 1
moves by 5e-4 per step) is far above the layouts' float differences."""


def _no_decay_expected(name: str, tied: bool) -> bool:
    """The rule, spelled independently of titanrl.trainer.optimizer."""
    return (name.endswith(("_layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight"
            or name.endswith(".bias") or name == "model.embed_tokens.weight" or (tied and name == "lm_head.weight"))


def _wrong_weight_decay(groups_by_param: dict[str, tuple[str, float]], tied: bool) -> list[str]:
    """Parameters whose group (name, weight_decay) is not the rule's."""
    wrong = []
    for name, (group, wd) in groups_by_param.items():
        want = ("no_decay", 0.0) if _no_decay_expected(name, tied) else ("decay", WEIGHT_DECAY)
        if (group, wd) != want:
            wrong.append(name)
    return wrong


def _groups_by_param(trainer: GRPOTrainer) -> dict[str, tuple[str, float]]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {names[id(p)]: (g.get("name", "?"), g["weight_decay"]) for g in trainer.optimizer.param_groups
            for p in g["params"]}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groups")
    return {
        tied: dataclasses.replace(
            case,
            train=dataclasses.replace(
                case.train, optimizer=dataclasses.replace(case.train.optimizer, weight_decay=WEIGHT_DECAY)
            ),
        )
        for tied, case in ((False, make_case(tmp, tied=False)), (True, make_case(tmp, tied=True)))
    }


def _trainer(case) -> GRPOTrainer:
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=case.checkpoint), case.train, case.temperature, seed=0))


def _single_group(trainer: GRPOTrainer) -> None:
    """The trainer's optimizer and schedule as before param groups: one AdamW group decaying all."""
    cfg = trainer.cfg
    trainer.optimizers[0] = torch.optim.AdamW(
        trainer.model.parameters(),
        lr=cfg.optimizer.lr,
        betas=cfg.optimizer.betas,
        weight_decay=cfg.optimizer.weight_decay,
    )
    trainer.schedulers[0] = build_scheduler(trainer.optimizers[0], cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_groups_follow_the_rule(cases, tied):
    """Every norm and the embedding are in 'no_decay' (weight_decay 0), every other matrix in
    'decay' (train.optimizer.weight_decay), an untied lm_head among them; the single group of before fails
    the same check (negative control)."""
    trainer = _trainer(cases[tied])
    groups = _groups_by_param(trainer)
    assert [g["name"] for g in trainer.optimizer.param_groups] == ["decay", "no_decay"]
    assert _wrong_weight_decay(groups, tied) == []
    assert ("lm_head.weight" in groups) == (not tied)
    assert sum(_no_decay_expected(n, tied) for n in groups) == 1 + 4 * 4 + 1  # embed, 4 norms x 4 layers, final
    _single_group(trainer)
    assert _wrong_weight_decay(_groups_by_param(trainer), tied)


def test_no_decay_parameters_are_not_decayed(cases):
    """An AdamW step on zero gradients changes only what decays: every decayed matrix shrinks by
    exactly (1 - lr * weight_decay), every norm gain and the embedding stay bitwise unchanged."""
    trainer = _trainer(cases[False])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for p in trainer.model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    lr = trainer.cfg.optimizer.lr
    for n, p in trainer.model.named_parameters():
        if _no_decay_expected(n, tied=False):
            assert torch.equal(p.detach(), before[n]), n
        else:
            assert torch.equal(p.detach(), before[n] * (1 - lr * WEIGHT_DECAY)), n


@pytest.fixture(scope="module")
def world(cases, tmp_path_factory, gloo_world):
    """One 2-rank world: a dp_shard=2 trainer (untied) and a pp=2 trainer (tied: the matrix is
    split into a first- and a last-stage copy, each with its stage's optimizer), each trained one
    step, saved, and trained one more step."""
    from parallel_worlds import run_jobs

    tmp = tmp_path_factory.mktemp("groups_world")
    jobs = [("optimizer_groups_resume", (cases[False], str(tmp / "fsdp"), dict(dp_shard=2))),
            ("optimizer_groups_resume", (cases[True], str(tmp / "pp"), dict(pp=2)))]
    results = gloo_world.run(run_jobs, jobs, timeout_s=600)[0]
    return {"fsdp": results[0], "pp": results[1]}


@pytest.mark.parametrize("layout", ["fsdp", "pp"])
def test_parallel_optimizers_follow_the_rule(world, layout):
    """Under dp_shard=2 every rank's optimizer and under pp=2 every stage's optimizer groups its
    parameters by the rule; the pp last stage's copy of the tied matrix (lm_head.weight) is in
    'no_decay' like the embedding, so after two steps the two copies are still bitwise equal."""
    res, tied = world[layout], layout == "pp"
    seen = set()
    for rank_groups in res["groups"]:
        for groups in rank_groups:
            assert _wrong_weight_decay(groups, tied) == [], groups
            seen |= set(groups)
    if tied:
        assert len(res["groups"][0]) == len(res["groups"][1]) == 1  # one optimizer per stage
        assert "lm_head.weight" in res["groups"][1][0] and res["tied_copies_equal"] is True
    assert "model.layers.3.mlp.up_proj.weight" in seen and "model.norm.weight" in seen


@pytest.mark.parametrize("layout", ["fsdp", "pp"])
def test_resume_in_one_process_keeps_groups(world, cases, layout):
    """The dp_shard=2 (pp=2, tied) checkpoint loaded by a one-process GRPOTrainer: every parameter
    is in its group with its weight decay, and one more step gives the parameters of the
    uninterrupted 2-rank run (to 1e-6, measured 3e-8; a wrongly decayed norm would move 5e-4)."""
    res, tied = world[layout], layout == "pp"
    trainer = _trainer(cases[tied])
    trainer.load_state(res["checkpoint"])
    assert _wrong_weight_decay(_groups_by_param(trainer), tied) == []
    trainer.optimizer_step(trainer.accumulate_gradients(cases[tied].batch))
    got, want = trainer.state_dict_for_push(), res["weights_after"]
    assert got.keys() == want.keys()
    for n in want:
        assert (got[n] - want[n]).abs().max().item() <= 1e-6, n


def test_older_single_group_checkpoint_loads(cases, tmp_path):
    """A checkpoint of the former single-group optimizer (everything decayed, groups unnamed) loads
    into the grouped optimizer: AdamW moments and the schedule are the saved ones, and the group
    settings stay this run's (norms and embedding not decayed)."""
    case = cases[False]
    old = _trainer(case)
    _single_group(old)
    old.optimizer_step(old.accumulate_gradients(case.batch))
    old.save_state(str(tmp_path / "old"))
    names = {id(p): n for n, p in old.model.named_parameters()}
    saved = {names[id(p)]: s["exp_avg"].clone() for p, s in old.optimizer.state.items()}

    new = _trainer(case)
    new.load_state(str(tmp_path / "old"))
    assert _wrong_weight_decay(_groups_by_param(new), tied=False) == []
    names = {id(p): n for n, p in new.model.named_parameters()}
    loaded = {names[id(p)]: s["exp_avg"] for p, s in new.optimizer.state.items()}
    assert loaded.keys() == saved.keys()
    for n in saved:
        assert torch.equal(loaded[n], saved[n]), n
    assert new.scheduler.get_last_lr() == [old.scheduler.get_last_lr()[0]] * 2
    new.optimizer_step(new.accumulate_gradients(case.batch))  # trains on


def test_checkpoint_grouped_otherwise_keeps_this_runs_groups(cases, tmp_path):
    """A checkpoint whose groups put parameters elsewhere (here: one group named 'decay') loads
    with a warning that names the difference, keeping this run's group settings."""
    case = cases[False]
    other = _trainer(case)
    _single_group(other)
    other.optimizer.param_groups[0]["name"] = "decay"
    other.optimizer_step(other.accumulate_gradients(case.batch))
    other.save_state(str(tmp_path / "other"))
    new = _trainer(case)
    with pytest.warns(UserWarning, match="groups parameters differently"):
        new.load_state(str(tmp_path / "other"))
    assert _wrong_weight_decay(_groups_by_param(new), tied=False) == []
