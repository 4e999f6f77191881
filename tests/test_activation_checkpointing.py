"""Activation checkpointing per decoder block (`train.memory.activation_checkpointing`): same gradients,
fewer stored activations, HF parameter names, and the same in a 2-process FSDP / TP / PP / CP world."""

from __future__ import annotations


import pytest
import torch

from titanrl.config import MemoryConfig, ModelConfig
from titanrl.trainer.parallel.activation_checkpoint import checkpointed_layers
from support.layout_check import make_case
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup
from support.sections import merged

MODES = {"full": dict(memory=MemoryConfig(activation_checkpointing="full")),
         "every_2nd": dict(memory=MemoryConfig(activation_checkpointing="every_nth", activation_checkpointing_every=2))}
WORLD_LAYOUTS = {"fsdp": dict(dp_shard=2), "tp_sp": dict(tp=2, sequence_parallel=True), "pp": dict(pp=2),
                 "cp": dict(cp=2)}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """make_case's 4-layer tiny policy and batch (uneven micro-batches, some clipped ratios)."""
    return make_case(tmp_path_factory.mktemp("ac"), tied=True)


def _trainer(case, batch_invariant: bool = False, **ac) -> GRPOTrainer:
    train = merged(case.train, **ac)
    return GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=case.checkpoint), train, case.temperature, seed=0, batch_invariant=batch_invariant
        )
    )


def _grads(case, batch_invariant: bool = False, **ac) -> dict[str, torch.Tensor]:
    trainer = _trainer(case, batch_invariant, **ac)
    trainer.accumulate_gradients(case.batch)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def _flags(trainer: GRPOTrainer) -> list[bool]:
    return [layer.checkpoint_activations for layer in trainer.model.model.layers]


def test_which_blocks_are_checkpointed(case):
    """'full' flags every block, 'every_nth' with N=2 the 2nd and 4th (global 1-based), 'none' none;
    parameter names stay HF's (no wrapper module prefix)."""
    assert checkpointed_layers(4, "every_nth", 2) == [1, 3] and checkpointed_layers(5, "every_nth", 1) == list(range(5))
    assert checkpointed_layers(4, "none", 2) == []
    assert _flags(_trainer(case)) == [False] * 4
    assert _flags(_trainer(case, **MODES["full"])) == [True] * 4
    trainer = _trainer(case, **MODES["every_2nd"])
    assert _flags(trainer) == [False, True, False, True]
    names = [n for n, _ in trainer.model.named_parameters()]
    assert "model.layers.3.mlp.up_proj.weight" in names and not [n for n in names if "checkpoint" in n]


@pytest.mark.parametrize("mode", list(MODES))
def test_gradients_equal_stored_activations(case, mode):
    """A GRPO gradient accumulation (micro-batches, clipped ratios) with checkpointed blocks gives
    every parameter's gradient within 1e-6 of the run that stores all activations."""
    ref, got = _grads(case), _grads(case, **MODES[mode])
    assert ref.keys() == got.keys()
    for n in ref:
        assert (got[n] - ref[n]).abs().max().item() <= 1e-6, n
    assert any(g.abs().max() > 0 for g in ref.values())


@pytest.mark.parametrize("mode", list(MODES))
def test_gradients_bitwise_in_batch_invariant_mode(case, mode):
    """In batch-invariant mode the recomputed blocks run the same fixed-order kernels: every
    gradient is bitwise (torch.equal) that of the run without checkpointing."""
    ref, got = _grads(case, batch_invariant=True), _grads(case, batch_invariant=True, **MODES[mode])
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


def _saved_bytes(case, **ac) -> int:
    """Bytes of the tensors autograd saved for backward (outside checkpointed regions) in one
    gradient accumulation: what stays alive between forward and backward."""
    trainer = _trainer(case, **ac)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.accumulate_gradients(case.batch)
    return total


def test_checkpointing_drops_stored_activations(case):
    """Fewer bytes are saved for backward with every 2nd block checkpointed, fewer still with
    every block; the same setting twice (no checkpointing) saves exactly the same bytes."""
    stored, again = _saved_bytes(case), _saved_bytes(case)
    every_2nd, full = _saved_bytes(case, **MODES["every_2nd"]), _saved_bytes(case, **MODES["full"])
    assert stored == again  # the count is a property of the setting, not noise
    assert full < every_2nd < stored, (full, every_2nd, stored)


def test_no_checkpointing_without_grad(case, monkeypatch):
    """A flagged block under no_grad (vLLM, logprob-only forwards) runs plainly: no checkpoint
    frame is created, so nothing is recomputed; with grad the same block does create one."""
    trainer = _trainer(case, **MODES["full"])
    layer = trainer.model.model.layers[0]
    x = torch.randn(1, 3, trainer.model_config.hidden_size)
    cos, sin = trainer.model.model.rotary_emb(torch.arange(3)[None], x.dtype)
    calls = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        layer(x, cos, sin)
    assert calls == []
    layer(x, cos, sin)
    assert calls == [1]


@pytest.fixture(scope="module")
def world(case, gloo_world):
    """One 2-rank world: per layout, the local gradient shards with and without checkpointing."""
    from parallel_worlds import run_jobs

    jobs = [("activation_checkpointing_grads", (case, WORLD_LAYOUTS, MODES))]
    return gloo_world.run(run_jobs, jobs, timeout_s=600)[0][0]


@pytest.mark.parametrize("layout", list(WORLD_LAYOUTS))
@pytest.mark.parametrize("mode", list(MODES))
def test_parallel_gradients_equal_stored_activations(world, layout, mode):
    """Under dp_shard=2 (FSDP2), tp=2 with sequence parallel, pp=2 and cp=2 (ring attention), every
    rank's gradient shards with checkpointed blocks equal (torch.equal) those without, and the
    gradients are not all zero."""
    res = world[layout]
    assert res["nonzero"], res
    assert res[mode]["unequal"] == 0, res[mode]
