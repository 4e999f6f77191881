"""Router replay, routing metrics and load balancing of mixture-of-experts policies in the trainer.

The 'generator' is the policy with a perturbed router: its recorded routing differs from the
trainer's live routing on some tokens, as vLLM's library kernels make it differ in practice.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from moe_replay_cases import EOS, groups_with_routing, perturbed_router, tiny_moe_config, tiny_moe_model

from titanrl.config import (
    ConfigError,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    MoeConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    validate,
)
from titanrl.config.unplanned import concrete_memory
from titanrl.models.qwen3.moe import Router, SparseMoeBlock, routing_buffers
from titanrl.trainer.batch import pack
from titanrl.trainer.grpo import clipped_surrogate_loss, token_logprobs
from titanrl.trainer.moe import load_balancing_loss, real_tokens
from titanrl.trainer.optimizer import build_optimizers
from titanrl.trainer.parallel.parallelize import parallelize
from titanrl.trainer.step import GRPOStep
from titanrl.trainer.setup import TrainerSetup
from support.sections import merged


@pytest.fixture(scope="module")
def case():
    model = tiny_moe_model()
    groups = groups_with_routing(perturbed_router(model))
    return model, groups, pack(groups, EOS)


def _step(model, **train):
    cfg = merged(TrainConfig(memory=MemoryConfig(micro_batch_size=2), moe=MoeConfig(load_balance="none")), **train)
    pm = parallelize(copy.deepcopy(model), ParallelConfig(), None,
                     activation_checkpointing=concrete_memory(cfg.memory).activation_checkpointing)
    return GRPOStep(pm, build_optimizers(pm, cfg), cfg, 1.0), pm


def _grads(pm):
    return {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}


def test_replay_makes_the_used_routing_the_generators(case):
    model, _, batch = case
    live = _step(model)[0].accumulate_gradients(batch).moe
    replayed = _step(model, moe=MoeConfig(router_replay=True))[0].accumulate_gradients(batch).moe
    assert live.tokens_compared == replayed.tokens_compared > 0
    # Without replay the trainer routes some completion tokens elsewhere than the generator did.
    assert live.route_agreement < 0.9
    assert live.used_agreement == live.route_agreement
    # With it every recorded token goes through the generator's experts; the live scores still disagree.
    assert replayed.used_agreement == 1.0
    assert replayed.route_agreement < 1.0


def _reference_block(block: SparseMoeBlock, recorded_NK: torch.Tensor):
    """Block forward written out by hand: every expert on every token, the recorded experts
    (live top-k where not recorded) picked by a gather, weights = softmax of the live scores
    gathered there and renormalised."""

    def forward(x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(-1, D)
        probs = torch.softmax(x.float() @ block.gate.weight.float().T, -1)
        live = torch.topk(probs, block.gate.top_k, -1).indices
        experts = torch.where((recorded_NK >= 0).all(-1, keepdim=True), recorded_NK, live)
        w = probs.gather(1, experts)
        w = w / w.sum(-1, keepdim=True)
        e = block.experts
        h = F.silu(torch.einsum("nd,eid->nei", x, e.gate_proj)) * torch.einsum("nd,eid->nei", x, e.up_proj)
        y_all = torch.einsum("nei,edi->ned", h, e.down_proj)
        y = (y_all.gather(1, experts[..., None].expand(-1, -1, D)) * w[..., None]).sum(1)
        return y.view(B, T, D)

    return forward


def test_replayed_gradient_equals_hand_built_reference(case):
    model, _, batch = case
    step, pm = _step(model, moe=MoeConfig(router_replay=True))
    step.accumulate_gradients(batch)
    got = _grads(pm)

    ref = copy.deepcopy(model)
    recorded = batch.routed_experts_BTLK.long() - 1
    blocks = [m for m in ref.modules() if isinstance(m, SparseMoeBlock)]
    for i, block in enumerate(blocks):
        block.forward = _reference_block(block, recorded[:, :, i].reshape(-1, recorded.shape[-1]))
    logprobs = token_logprobs(ref(batch.input_ids_BT), batch.targets_BT)
    loss_sum, _ = clipped_surrogate_loss(logprobs, batch.old_logprobs_BT, batch.advantages_B, batch.loss_mask_BT, 0.2)
    (loss_sum / batch.loss_mask_BT.sum()).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    router = "model.layers.1.mlp.gate.weight"
    assert want[router].abs().max() > 1e-4  # the router has a gradient through the replayed weights
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)

    # The same reference without the recorded experts is another gradient: the replay is what matches.
    step_live, pm_live = _step(model)
    step_live.accumulate_gradients(batch)
    assert not torch.allclose(_grads(pm_live)[router], want[router], rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_recomputes_the_replayed_routing(case):
    model, _, batch = case
    grads = {}
    for ac in ("none", "full"):
        step, pm = _step(model, moe=MoeConfig(router_replay=True), memory=MemoryConfig(activation_checkpointing=ac))
        step.accumulate_gradients(batch)
        grads[ac] = _grads(pm)
    for name, g in grads["none"].items():
        assert torch.equal(grads["full"][name], g), name


def test_aux_loss_equals_transformers(case):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model, _, batch = case
    routers = model.routers()
    for r in routers:
        r.keep_routing = True
    with torch.no_grad():
        model(batch.input_ids_BT)
    routings = [r.last_routing for r in routers]
    for r in routers:
        r.keep_routing, r.last_routing = False, None
    mask = real_tokens(batch.loss_mask_BT)
    logits = [r.logits for r in routings]
    ours = load_balancing_loss(logits, [r.chosen for r in routings], mask.reshape(-1), 4)
    theirs = load_balancing_loss_func(tuple(logits), 4, 2, mask.long())
    assert abs(ours.item() - theirs.item()) <= 1e-6
    unmasked = load_balancing_loss(logits, [r.chosen for r in routings], torch.ones(mask.numel()), 4)
    assert abs(unmasked.item() - load_balancing_loss_func(tuple(logits), 4, 2).item()) <= 1e-6
    # A micro-batch of padding rows only (a data-parallel rank's filler) adds 0, not 0/0.
    assert load_balancing_loss(logits, [r.chosen for r in routings], torch.zeros(mask.numel()), 4).item() == 0.0


def test_aux_loss_gradient_reaches_the_router(case):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model, _, batch = case
    coef = 0.5
    grads = {}
    for c in (0.0, coef):  # one micro-batch (more rows than the batch): the auxiliary loss is HF's on the whole batch
        step, pm = _step(model, moe=MoeConfig(load_balance="aux_loss", aux_loss_coef=c),
                         memory=MemoryConfig(micro_batch_size=1000))
        stats = step.accumulate_gradients(batch)
        grads[c] = _grads(pm)
    ref = copy.deepcopy(model)
    for r in ref.routers():
        r.keep_routing = True
    ref(batch.input_ids_BT)
    mask = real_tokens(batch.loss_mask_BT)
    aux = load_balancing_loss_func(tuple(r.last_routing.logits for r in ref.routers()), 4, 2, mask.long())
    assert stats.moe.aux_loss == pytest.approx(aux.item(), abs=1e-6)
    (coef * aux).backward()
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"):
        diff = grads[coef][name] - grads[0.0][name]
        want = dict(ref.named_parameters())[name].grad
        assert want.abs().max() > 1e-4
        torch.testing.assert_close(diff, want, rtol=1e-4, atol=1e-7, msg=name)


def test_expert_bias_moves_the_choice_not_the_weights():
    router = Router(tiny_moe_config(), layer_id=0)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    plain = router(x)
    router.expert_bias[3] = 10.0
    biased = router(x)
    assert (biased.chosen == 3).any(-1).all()  # expert 3 chosen for every token
    assert not (plain.chosen == 3).any(-1).all()
    probs = torch.softmax(plain.logits, -1).gather(1, biased.chosen)
    torch.testing.assert_close(biased.weights, probs / probs.sum(-1, keepdim=True))
    assert routing_buffers(router) == {"expert_bias": router.expert_bias}
    assert "expert_bias" not in router.state_dict()  # HF files have no such tensor


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from titanrl.models.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", tiny_moe_config(), seed=0, std=0.2)


def test_expert_bias_update_resume_and_push(moe_checkpoint, tmp_path):
    from titanrl.trainer.trainer import GRPOTrainer
    from titanrl.weight_sync.target import ParameterTarget

    rate = 0.01
    train = TrainConfig(
        moe=MoeConfig(load_balance="bias", bias_update_rate=rate),
        memory=MemoryConfig(micro_batch_size=4),
        optimizer=OptimizerConfig(lr=1e-3),
    )
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(moe_checkpoint)), train, 1.0, seed=0))
    groups = groups_with_routing(None)
    batch = pack(groups, EOS)
    stats = trainer.accumulate_gradients(batch)
    _, _, taken = trainer.optimizer_step(stats)
    assert taken
    for i, router in enumerate(trainer.model.routers()):
        load = stats.moe.load[i].float()
        delta = rate * torch.sign(load.mean() - load)
        assert torch.equal(router.expert_bias, delta - delta.mean()), i
        assert router.expert_bias.abs().sum() > 0
    # Every layer counts the same assignments (k per real token); the load metric is, per layer,
    # the busiest expert's count over the mean count, averaged over layers (computed here by hand).
    totals = stats.moe.load.sum(1)
    assert torch.all(totals == totals[0]) and totals[0] > 0
    by_hand = sum(layer.max().item() / layer.mean().item() for layer in stats.moe.load) / len(stats.moe.load)
    assert stats.moe.load_max_over_mean == pytest.approx(by_hand, rel=1e-12) and by_hand > 1.0
    metrics = trainer.step(groups)  # a second update through the whole step
    assert metrics["moe/load_max_over_mean"] > 1.0 and "moe/aux_loss" in metrics
    biases = {k: v.clone() for k, v in routing_buffers(trainer.model).items()}
    assert len(biases) == 2

    trainer.save_state(str(tmp_path / "ckpt"))
    resumed = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(moe_checkpoint)), train, 1.0, seed=0))
    assert all(not b.any() for b in routing_buffers(resumed.model).values())
    resumed.load_state(str(tmp_path / "ckpt"))
    for name, b in routing_buffers(resumed.model).items():
        assert b.dtype == torch.float32 and torch.equal(b, biases[name]), name

    # Published with the weights, and a generator's model takes them.
    pushed = trainer.state_dict_for_push()
    for name, b in biases.items():
        assert torch.equal(pushed[name], b)
    source = trainer._weight_source()
    assert {n for n, _ in source.tensors()} == {s.name for s in source.layout().tensors}
    generator = tiny_moe_model(seed=3)
    dests = ParameterTarget(generator).check(source.layout())
    names = [s.name for s in source.layout().tensors]
    dest = dests[names.index("model.layers.1.mlp.gate.expert_bias")]
    assert dest is not None and dest.data_ptr() == generator.model.layers[1].mlp.gate.expert_bias.data_ptr()

    # Without 'bias' nothing extra is pushed.
    plain = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(moe_checkpoint)), TrainConfig(), 1.0, seed=0))
    assert not any(k.endswith("expert_bias") for k in plain.state_dict_for_push())


def test_step_metrics_of_a_moe_policy(moe_checkpoint):
    from titanrl.models.hf_checkpoint import load_model
    from titanrl.trainer.trainer import GRPOTrainer

    model, _ = load_model(moe_checkpoint)
    groups = groups_with_routing(perturbed_router(model))
    metrics = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=str(moe_checkpoint)), TrainConfig(moe=MoeConfig(router_replay=True)), 1.0, seed=0
        )
    ).step(groups)
    assert 0 < metrics["moe/route_agreement"] < 1.0
    assert metrics["moe/route_agreement_used"] == 1.0
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/load_max_over_mean"] >= 1.0


def test_replay_works_sharded(case):
    """dp_shard=2 (FSDP) and cp=2 (each rank a half of every sequence) give the one-process replay."""
    from moe_replay_worlds import replay_steps

    from titanrl.trainer.parallel.launch import run_local_world

    model, _, batch = case
    # 3 rows per micro-batch: the same micro-batches in one process and on each of 2 ranks (the
    # auxiliary loss's load statistics are per micro-batch; a CP rank's are over its chunks).
    fsdp = TrainConfig(
        moe=MoeConfig(router_replay=True, load_balance="aux_loss"), memory=MemoryConfig(micro_batch_size=3)
    )
    cp = TrainConfig(moe=MoeConfig(router_replay=True, load_balance="none"), memory=MemoryConfig(micro_batch_size=3))
    runs = {"fsdp": (dict(dp_shard=2), fsdp), "cp": (dict(cp=2), cp)}
    got = run_local_world(replay_steps, 2, model.state_dict(), batch, runs, timeout_s=300)[0]
    for name, (_, train) in runs.items():
        step, pm = _step(model, moe=train.moe, memory=train.memory)
        want = step.accumulate_gradients(batch).moe
        moe = got[name]["moe"]
        assert moe.used_agreement == 1.0, name
        assert moe.tokens_compared == want.tokens_compared, name
        assert moe.route_agreement == want.route_agreement, name
        assert torch.equal(moe.load, want.load), name
        if name == "fsdp":
            assert moe.aux_loss == pytest.approx(want.aux_loss, abs=1e-6)
        for param, g in _grads(pm).items():
            torch.testing.assert_close(got[name]["grads"][param], g, rtol=1e-5, atol=1e-6, msg=f"{name} {param}")


def _run_config(tmp_path, checkpoint, **train) -> RunConfig:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    return RunConfig(model=ModelConfig(checkpoint=str(checkpoint)), data=DataConfig(train_file=str(data)),
                     train=TrainConfig(**train), rewards=[lambda prompt, completion, **kw: 0.0])


def test_validation(tmp_path, moe_checkpoint):
    from titanrl.models.tiny import write_tiny_checkpoint

    dense = write_tiny_checkpoint(tmp_path / "dense")
    with pytest.raises(ConfigError, match=r"train\.moe\.router_replay=true needs a mixture-of-experts policy"):
        validate(_run_config(tmp_path, dense, moe=MoeConfig(router_replay=True)))
    validate(_run_config(tmp_path, moe_checkpoint, moe=MoeConfig(router_replay=True)))
    with pytest.raises(ConfigError, match=r"train\.moe\.router_replay=true runs in one process or under dp_replicate / dp_shard / cp only"):
        validate(
            _run_config(tmp_path, moe_checkpoint, moe=MoeConfig(router_replay=True), parallel=ParallelConfig(pp=2))
        )
    validate(
        _run_config(
            tmp_path, moe_checkpoint, moe=MoeConfig(router_replay=True), parallel=ParallelConfig(cp=2, dp_shard=2)
        )
    )
    from titanrl.models.tiny import write_checkpoint

    two_kv_heads = write_checkpoint(tmp_path / "moe_tp", tiny_moe_config(num_key_value_heads=2))  # tp=2 splits them
    for layout in (dict(pp=2), dict(tp=2, sequence_parallel=True)):
        with pytest.raises(ConfigError, match=r"train\.moe\.load_balance='aux_loss' is not implemented for pipelined"):
            validate(
                _run_config(
                    tmp_path, two_kv_heads, moe=MoeConfig(load_balance="aux_loss"), parallel=ParallelConfig(**layout)
                )
            )
        validate(_run_config(tmp_path, two_kv_heads, parallel=ParallelConfig(**layout)))  # 'none', the default
    with pytest.raises(ConfigError, match=r"train\.moe\.bias_update_rate"):
        validate(_run_config(tmp_path, moe_checkpoint, moe=MoeConfig(bias_update_rate=0.0)))
    validate(dataclasses.replace(_run_config(tmp_path, dense), train=TrainConfig(moe=MoeConfig(load_balance="bias"))))


def test_sample_checks_the_routing_shape():
    import numpy as np

    from titanrl.types import Sample

    routed = np.zeros((3, 2, 2), dtype=np.int16)
    Sample("", "", [5, 6], [7], [0.0], 1.0, 0, 0, routed_experts=routed)
    with pytest.raises(ValueError, match="routed_experts of shape"):
        Sample("", "", [5, 6], [7], [0.0], 1.0, 0, 0, routed_experts=routed[:2])


def test_loaded_models_route_without_bias(moe_checkpoint):
    """Every model built for loading (to_empty leaves buffers as found in memory; a dtype cast
    rounds them) starts with float32 zero biases."""
    from titanrl.models.hf_checkpoint import load_model

    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(moe_checkpoint, dtype=dtype)
        for name, b in routing_buffers(model).items():
            assert b.dtype == torch.float32 and not b.any(), (dtype, name)
