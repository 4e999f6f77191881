"""Our Qwen3-MoE inside vLLM: registration, weight loading and pushes, logprob parity with the
trainer, and the routing the generator records for router replay (Sample.routed_experts)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from titanrl.envs.base import Environment, StepResult  # noqa: E402
from titanrl.models.hf_checkpoint import hf_state_dict, load_model, load_state_dict_into  # noqa: E402
from titanrl.rollout.vllm.engine import VllmEngineConfig  # noqa: E402
from titanrl.rollout.vllm.routing_record import NOT_RECORDED, fit_routing, merge_routing  # noqa: E402
from titanrl.config import EngineConfig  # noqa: E402
from titanrl.trainer.setup import TrainerSetup  # noqa: E402

TOL = 1e-5
BLOCK = VllmEngineConfig.kv_block_size
"""The engine's KV-cache block: the prefix cache reuses whole blocks only."""


def _trainer_view(model, seq: list[int], temperature: float = 1.0) -> tuple[torch.Tensor, np.ndarray]:
    """(logprob of token t+1 given tokens <= t [T-1], routing [T, sparse layers, k]) from one
    forward of our model, as the trainer runs it."""
    for router in model.routers():
        router.keep_routing = True
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[0].float() / temperature
    lp = torch.log_softmax(logits, dim=-1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    routing = np.stack([r.last_routing.chosen.numpy() for r in model.routers()], axis=1)
    return lp, routing


def _recorded(routing: np.ndarray) -> np.ndarray:
    return (routing != NOT_RECORDED).all(axis=(1, 2))


def _check_routing_layout(c, num_layers: int = 2, k: int = 2) -> np.ndarray:
    """The routing's shape and which rows are unrecorded: the last token (never fed back) and,
    at most, a prefix of whole blocks served from the prefix cache. Returns the recorded mask."""
    seq_len = len(c.prompt_token_ids) + len(c.token_ids)
    assert c.routed_experts.shape == (seq_len, num_layers, k) and c.routed_experts.dtype == np.int16
    recorded = _recorded(c.routed_experts)
    assert not recorded[-1]
    cached = int(np.argmax(recorded)) if recorded.any() else seq_len
    assert cached % BLOCK == 0 and recorded[cached:-1].all()
    return recorded


def test_moe_generator_matches_trainer_logprobs_and_routing(vllm_moe_engine, vllm_moe_checkpoint):
    """The engine builds our MoE from a per-expert checkpoint; its logprobs equal our forward's
    (library kernels) to <= 1e-5, and every recorded position's top-k equals the trainer's.
    Prompts over one KV block show prefix-cache rows left unrecorded (-1), never wrong."""
    model, _ = load_model(vllm_moe_checkpoint)
    long_prompt = "routing over a long prompt: " + "0123456789" * 17
    groups = vllm_moe_engine.generate(["experts: ", long_prompt], n=3, temperature=1.0, max_tokens=16, seed=3)
    agree = total = 0
    cache_hits = 0
    for c in (c for g in groups for c in g):
        seq = c.prompt_token_ids + c.token_ids
        lp, routing = _trainer_view(model, seq)
        assert (lp[len(c.prompt_token_ids) - 1 :] - torch.tensor(c.logprobs)).abs().max().item() <= TOL
        recorded = _check_routing_layout(c)
        cache_hits += int(not recorded[0])
        same = (c.routed_experts[recorded] == routing[recorded]).all(axis=(1, 2))
        agree, total = agree + int(same.sum()), total + len(same)
    assert cache_hits >= 2  # the long prompt's 2nd and 3rd samples reused its first block
    # Library kernels round differently from the trainer's batch (~1e-6), so a near-tie could flip
    # in principle; seen: all equal. The exact claim is batch-invariant mode's (below).
    assert agree >= 0.99 * total
    # Routing is not trivial: every expert is used, and tokens differ in their top-2.
    r = groups[1][0].routed_experts[:-1]
    assert set(np.unique(r).tolist()) == {0, 1, 2, 3}
    assert len({tuple(sorted(row)) for row in r[:, 0].tolist()}) > 2


def test_moe_weight_push_stacked_and_per_expert_names(vllm_moe_engine, vllm_moe_checkpoint):
    """Pushes with the trainer's names (stacked experts [E, out, in]) and with the checkpoint's
    (one tensor per expert), and a shared-memory push of stacked experts, all land in the stacked
    parameters: logprobs then equal our forward on the new weights, and pushing the checkpoint
    back restores them exactly."""
    model, _ = load_model(vllm_moe_checkpoint)
    original = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(1)
    pushed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    assert pushed["model.layers.0.mlp.experts.gate_proj"].dim() == 3
    new_model, _ = load_model(vllm_moe_checkpoint)
    with torch.no_grad():
        for name, p in new_model.named_parameters():
            p.copy_(pushed[name])

    seq = vllm_moe_engine.generate(["push"], n=1, temperature=1.0, max_tokens=12, seed=2)[0][0]
    fixed = seq.prompt_token_ids + seq.token_ids
    before = _prompt_logprobs(vllm_moe_engine, fixed)
    version = vllm_moe_engine.policy_version
    try:
        vllm_moe_engine.update_weights(pushed, version=version + 1)
        running = vllm_moe_engine.worker_state_dict()
        assert all(torch.equal(running[k], pushed[k]) for k in pushed)
        after = _prompt_logprobs(vllm_moe_engine, fixed)
        assert (after - _trainer_view(new_model, fixed)[0]).abs().max().item() <= TOL
        assert (after - before).abs().max().item() > 1e-3
        # The trainer's transports write parameters by name too: a shared-memory push of stacked experts.
        from titanrl.rollout.weight_receiver import WeightReceiver
        from titanrl.weight_sync import TensorsWeights, make_plan, make_sender

        doubled = {k: 2 * v for k, v in pushed.items()}
        plan = make_plan("shared_memory", 1)
        sender, receiver = make_sender(plan), WeightReceiver(vllm_moe_engine)
        try:
            receiver.open(plan, 1)
            announcement = sender.publish(version + 2, TensorsWeights(doubled))
            sender.send(version + 2, TensorsWeights(doubled))
            receiver.receive(announcement, version + 2)
        finally:
            receiver.close()
            sender.close()
        running = vllm_moe_engine.worker_state_dict()
        assert all(torch.equal(running[k], doubled[k]) for k in doubled)
    finally:
        vllm_moe_engine.update_weights(hf_state_dict(model), version=version + 3)  # per-expert names
    assert torch.equal(_prompt_logprobs(vllm_moe_engine, fixed), before)


def _prompt_logprobs(engine, seq: list[int]) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = engine.llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    return torch.tensor([pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], seq[1:])])


def test_moe_routing_reaches_single_turn_samples(vllm_moe_engine):
    """SingleTurn makes the completion's routing the Sample's; each sample has its own record."""
    from titanrl.rollout.single_turn import SingleTurn

    rows = [{"prompt": "a sample: ", "answer": "1"}]
    outputs = vllm_moe_engine.generate(["a sample: "], n=2, temperature=1.0, max_tokens=10, seed=5)
    (group,) = SingleTurn("prompt", None).groups(rows, outputs, [(0.0, None), (1.0, None)], first_group_id=0)
    for s, c in zip(group.samples, outputs[0]):
        assert s.routed_experts is c.routed_experts
        assert s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.completion_ids)
    a, b = (s.routed_experts for s in group.samples)
    n = len(outputs[0][0].prompt_token_ids)
    assert np.array_equal(a[:n], b[:n])  # same prompt, same routing
    if outputs[0][0].token_ids != outputs[0][1].token_ids:
        assert not np.array_equal(a, b)


class _TwoTurnEnv(Environment):
    """Answers the first model turn with an observation and ends after the second."""

    observation = "\n<obs>go on</obs>\n"

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self, row):
        return row["prompt"]

    async def step(self, action):
        self.steps += 1
        if self.steps == 2:
            return StepResult(observation="", reward=1.0, done=True)
        return StepResult(observation=self.observation, reward=0.0, done=False)

    async def close(self):
        pass


def test_moe_episode_routing_merges_turns(vllm_moe_engine, vllm_moe_checkpoint):
    """A multi-turn episode's routing covers its whole sequence: the first turn's last token,
    never fed in that turn, is recorded by the second (its prompt); observation tokens too; the
    episode's final token stays -1; recorded rows equal the trainer's routing."""
    from titanrl.rollout.episode import EpisodeBudget, run_episode
    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    budget = EpisodeBudget(max_turns=4, max_total_tokens=200, max_tokens_per_turn=8, max_model_len=512)

    async def main():
        async with AsyncGenerator(vllm_moe_engine) as gen:
            return await run_episode(_TwoTurnEnv(), {"prompt": "turns: "}, gen, vllm_moe_engine.llm.get_tokenizer(),
                                     budget, 1.0, 1.0, seed=4, stop_token_ids=None)

    ep = asyncio.run(main())
    assert ep.turns == 2 and ep.finished
    seq = ep.prompt_ids + ep.completion_ids
    assert ep.routed_experts.shape == (len(seq), 2, 2)
    recorded = _recorded(ep.routed_experts)
    assert recorded[:-1].all() and not recorded[-1]
    model, _ = load_model(vllm_moe_checkpoint)
    _, routing = _trainer_view(model, seq)
    same = (ep.routed_experts[:-1] == routing[:-1]).all(axis=(1, 2))
    assert same.mean() >= 0.99


def test_merge_and_fit_routing():
    """merge_routing keeps the later request's rows where recorded and fills its -1 rows from the
    earlier one; fit_routing pads with -1 (and cuts) to a length."""
    earlier = np.full((4, 1, 2), NOT_RECORDED, dtype=np.int16)
    earlier[:3] = [[[0, 1]], [[1, 2]], [[2, 3]]]
    later = np.full((6, 1, 2), NOT_RECORDED, dtype=np.int16)
    later[2:5] = [[[3, 0]], [[0, 2]], [[1, 3]]]
    merged = merge_routing(earlier, later)
    assert merged[:, 0].tolist() == [[0, 1], [1, 2], [3, 0], [0, 2], [1, 3], [-1, -1]]
    assert fit_routing(merged, 7, 1, 2)[5:, 0].tolist() == [[-1, -1], [-1, -1]]
    assert fit_routing(merged, 2, 1, 2)[:, 0].tolist() == [[0, 1], [1, 2]]
    assert fit_routing(None, 3, 2, 2).shape == (3, 2, 2) and (fit_routing(None, 3, 2, 2) == -1).all()


def test_routed_experts_survive_the_driver_checkpoint(tmp_path):
    """A Sample's routed_experts goes through the driver's checkpoint (to_plain, driver.pt with
    weights_only loading, from_plain) as a compact int16 tensor and comes back equal, as an array."""
    from titanrl.rundir.driver_state import read_driver_state, write_driver_state
    from titanrl.rundir.plain import from_plain, to_plain
    from titanrl.types import Group, Sample

    routing = np.random.default_rng(0).integers(-1, 4, size=(9, 2, 2)).astype(np.int16)
    samples = [Sample("p", "c", [1, 2, 3, 4], [5, 6, 7, 8, 9], [-0.5] * 5, 1.0, 0, 3, routed_experts=routing),
               Sample("p", "c", [1, 2, 3, 4], [5], [-0.5], 0.0, 0, 3)]
    plain = to_plain([Group(samples)], "rollouts")
    stored = plain[0]["samples"][0]["routed_experts"]
    assert isinstance(stored, torch.Tensor) and stored.dtype == torch.int16
    write_driver_state(tmp_path / "driver.pt", {"rollouts": plain})
    (group,) = from_plain(list[Group], read_driver_state(tmp_path)["rollouts"], "rollouts")
    back = group.samples[0].routed_experts
    assert isinstance(back, np.ndarray) and back.dtype == np.int16 and np.array_equal(back, routing)
    assert group.samples[1].routed_experts is None
    with pytest.raises(ValueError, match="routed_experts"):
        Sample("p", "c", [1], [2], [-0.1], 0.0, 0, 0, routed_experts=routing)  # 2 tokens, 9 rows


def test_recording_needs_a_moe_checkpoint(vllm_tiny_checkpoint):
    """record_routed_experts on a dense checkpoint is refused before vLLM starts."""
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    with pytest.raises(ValueError, match="record_routed_experts"):
        VllmEngine(
            VllmEngineConfig(checkpoint=str(vllm_tiny_checkpoint), settings=EngineConfig(record_routed_experts=True))
        )


# --- batch-invariant mode ------------------------------------------------------------------

@pytest.mark.own_vllm_engine
def test_moe_batch_invariant_generator_equals_trainer_exactly(vllm_moe_checkpoint):
    """With batch_invariant=True the generator's logprobs equal the batch-invariant trainer
    model's bit for bit (decode, and one prompt alone vs inside a batch), its recorded routing
    equals the trainer's top-k everywhere, and GRPOTrainer's parity/logprob_diff_max is 0.0.
    The routing comparison can fail: perturbing the trainer's gate by 1e-3 flips some top-k."""
    from titanrl.config import EngineConfig, MemoryConfig, ModelConfig, TrainConfig
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig
    from titanrl.trainer.trainer import GRPOTrainer
    from titanrl.types import Group, Sample

    model, _ = load_model(vllm_moe_checkpoint)
    model.set_batch_invariant(True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40, 75, 150)]
    config = VllmEngineConfig(
        checkpoint=str(vllm_moe_checkpoint),
        settings=EngineConfig(max_model_len=512, max_num_seqs=64, record_routed_experts=True),
        batch_invariant=True,
    )
    with VllmEngine(config) as engine:
        groups = engine.generate(prompts, n=2, temperature=1.0, max_tokens=24, seed=7)
        crowd = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(2, 60, (31,), generator=g)]
        (alone,) = engine.generate([prompts[3]], n=1, temperature=0.0, max_tokens=20)[0]
        (inside,) = engine.generate(crowd[:20] + [prompts[3]] + crowd[20:], n=1, temperature=0.0, max_tokens=20)[20]
    assert alone.token_ids == inside.token_ids
    assert torch.equal(torch.tensor(alone.logprobs), torch.tensor(inside.logprobs))
    # Decoding alone runs the gate on one row at a time, where F.linear rounds differently than on
    # the trainer's T rows (seen: 1.4e-6 with the gate on F.linear); kernels.linear does not.
    lp = _trainer_view(model, alone.prompt_token_ids + alone.token_ids)[0][len(alone.prompt_token_ids) - 1 :]
    assert torch.equal(torch.tensor(alone.logprobs), lp)

    sampled = [c for grp in groups for c in grp]
    flipped = 0
    for c in sampled:
        seq = c.prompt_token_ids + c.token_ids
        lp, routing = _trainer_view(model, seq)
        assert torch.equal(torch.tensor(c.logprobs), lp[len(c.prompt_token_ids) - 1 :])
        recorded = _check_routing_layout(c)
        assert np.array_equal(c.routed_experts[recorded], routing[recorded])
        flipped += _flips_under_gate_perturbation(model, seq, routing)
    assert flipped > 0

    batch = [Group([Sample("p", c.text, c.prompt_token_ids, c.token_ids, c.logprobs, float(i % 2), j, 0,
                           routed_experts=c.routed_experts) for i, c in enumerate(grp)])
             for j, grp in enumerate(groups)]
    trainer = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=str(vllm_moe_checkpoint)),
            TrainConfig(memory=MemoryConfig(micro_batch_size=4)),
            1.0,
            0,
            batch_invariant=True,
        )
    )
    metrics = trainer.step(batch)
    assert metrics["parity/tokens_checked"] == sum(len(c.token_ids) for c in sampled)
    assert metrics["parity/logprob_diff_max"] == 0.0


def _flips_under_gate_perturbation(model, seq: list[int], routing: np.ndarray, scale: float = 1e-3) -> int:
    """Positions whose top-k changes when every router weight moves by `scale` x its std."""
    gen = torch.Generator().manual_seed(0)
    saved = [r.weight.detach().clone() for r in model.routers()]
    with torch.no_grad():
        for r in model.routers():
            r.weight.add_(scale * r.weight.std() * torch.randn(r.weight.shape, generator=gen))
    try:
        _, perturbed = _trainer_view(model, seq)
    finally:
        with torch.no_grad():
            for r, w in zip(model.routers(), saved):
                r.weight.copy_(w)
    return int((perturbed != routing).any(axis=(1, 2)).sum())


def test_run_config_refuses_recording_for_a_dense_policy(tmp_path, vllm_tiny_checkpoint, vllm_moe_checkpoint):
    """rollout.engine.record_routed_experts=True with a dense model.checkpoint is a ConfigError naming the
    field; None (the default) and True with a MoE checkpoint validate."""
    import dataclasses

    from titanrl.config import DataConfig, ModelConfig, RolloutConfig, RunConfig
    from titanrl.config.validation import validate
    from titanrl.errors import ConfigError

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1="}\n')
    config = RunConfig(model=ModelConfig(checkpoint=str(vllm_tiny_checkpoint)), data=DataConfig(train_file=str(train)),
                       rewards=[lambda prompt, completion, **fields: 0.0])
    validate(config)
    config.rollout = RolloutConfig(engine=EngineConfig(record_routed_experts=True))
    with pytest.raises(ConfigError, match=r"rollout\.engine\.record_routed_experts"):
        validate(config)
    validate(dataclasses.replace(config, model=ModelConfig(checkpoint=str(vllm_moe_checkpoint))))


@pytest.mark.slow
def test_multiprocess_engine_records_routing(vllm_moe_checkpoint):
    """The multiprocess engine (engine core in a spawned process, which finds our MoE class through
    the plugin entry point) records routing there and returns it as plain bytes, equal to the trainer's."""
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    config = VllmEngineConfig(
        checkpoint=str(vllm_moe_checkpoint),
        settings=EngineConfig(max_model_len=128, max_num_seqs=8, multiprocess=True, record_routed_experts=True),
    )
    with VllmEngine(config) as engine:
        group = engine.generate(["mp moe"], n=2, temperature=1.0, max_tokens=8, seed=0)[0]
    model, _ = load_model(vllm_moe_checkpoint)
    for c in group:
        recorded = _check_routing_layout(c)
        _, routing = _trainer_view(model, c.prompt_token_ids + c.token_ids)
        assert recorded[:-1].all() and np.array_equal(c.routed_experts[recorded], routing[recorded])
