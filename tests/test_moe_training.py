"""A Qwen3-MoE policy in the single-process trainer (router and experts train, also under
activation checkpointing and bf16 mixed precision, in AdamW's decay group) and `titanrl export` of
its training checkpoint, loaded by transformers and by vLLM's built-in Qwen3-MoE."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from titanrl.config import ComputeConfig, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig
from titanrl.models.hf_checkpoint import hf_state_dict, load_model, read_state_dict
from titanrl.models.qwen3.moe import GroupedExperts, Qwen3MoeForCausalLM, Router
from titanrl.models.tiny import write_tiny_moe_checkpoint
from titanrl.trainer.batch import pack
from titanrl.trainer.grpo import token_logprobs
from titanrl.trainer.optimizer import DECAY, GROUP_NAME
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, Sample

TRAIN = TrainConfig(
    memory=MemoryConfig(micro_batch_size=4), optimizer=OptimizerConfig(lr=1e-2, grad_clip=1.0, weight_decay=0.1)
)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A tiny untied Qwen3-MoE checkpoint: 3 layers, the middle one dense (mlp_only_layers), 4
    experts top-2 in the others; std 0.1 so routing varies by token."""
    return write_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", seed=4, std=0.1,
                                     tie_word_embeddings=False, num_hidden_layers=3, mlp_only_layers=[1])


def _groups(checkpoint, groups: int = 3, group_size: int = 4, seed: int = 0) -> list[Group]:
    """Random prompt/completion groups with varied rewards, the generator's logprobs those of the
    checkpoint plus noise (so the PPO ratio is not one everywhere)."""
    model, _ = load_model(checkpoint)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(256) for _ in range(rng.randint(3, 8))]
        samples = []
        for _ in range(group_size):
            completion = [rng.randrange(256) for _ in range(rng.randint(2, 10))]
            seq = torch.tensor([prompt + completion])
            with torch.no_grad():
                lp = token_logprobs(model(seq[:, :-1]), seq[:, 1:])[0, len(prompt) - 1:]
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=completion,
                                  gen_logprobs=(lp + 0.2 * torch.randn(lp.shape, generator=gen)).tolist(),
                                  reward=rng.random(), group_id=g, policy_version=0))
        out.append(Group(samples))
    return out


def _moe_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every router weight and stacked expert tensor, by name."""
    owners = (Router, GroupedExperts)
    return {f"{name}.{p_name}" if name else p_name: p
            for name, m in model.named_modules() if isinstance(m, owners)
            for p_name, p in m.named_parameters(recurse=False)}


def _step_moves_moe_weights(trainer: GRPOTrainer, groups: list[Group]) -> dict[str, torch.Tensor]:
    """Accumulates the batch's gradient and steps; asserts every router and every expert of every
    stacked tensor got a non-zero gradient and moved. Returns the gradients."""
    model = trainer.model
    assert isinstance(model, Qwen3MoeForCausalLM)
    moe = _moe_params(model)
    assert len(moe) == 4 * len(model.config.sparse_layers)  # gate + 3 stacked projections per layer
    before = {n: p.detach().clone() for n, p in moe.items()}
    batch = pack(groups, pad_id=model.config.eos_token_id or 0, current_version=0)
    stats = trainer.accumulate_gradients(batch)
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    for name, p in moe.items():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        if isinstance(p, torch.nn.Parameter) and p.dim() == 3:
            assert all(torch.count_nonzero(p.grad[e]) > 0 for e in range(p.shape[0])), name  # every expert
        assert torch.count_nonzero(p.grad) > 0, name
    _, _, taken = trainer.optimizer_step(stats)
    assert taken
    for name, p in moe.items():
        assert not torch.equal(p.detach(), before[name]), name
    return grads


def test_one_step_trains_router_and_experts(moe_checkpoint):
    """One GRPOTrainer step on an MoE checkpoint: gradients reach every router (mlp.gate.weight)
    and every expert of the stacked weights, and the step moves them. Router and experts are in
    AdamW's decay group (matrices, like every projection)."""
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(moe_checkpoint)), TRAIN, temperature=1.0, seed=0))
    groups = [g for g in trainer.optimizer.param_groups]
    decayed = {id(p) for g in groups if g[GROUP_NAME] == DECAY for p in g["params"]}
    assert all(id(p) in decayed for p in _moe_params(trainer.model).values())
    _step_moves_moe_weights(trainer, _groups(moe_checkpoint))


@pytest.mark.parametrize("activation_checkpointing", ["none", "full"])
def test_moe_under_mixed_precision_and_activation_checkpointing(moe_checkpoint, activation_checkpointing):
    """float32 masters with bf16 compute: the stacked experts and the router are cast like every
    other parameter (the experts' matmuls run in bf16, the router scores in float32 over its bf16
    weight), and the gradient equals a bf16 copy's upcast bitwise, as for the dense model; with
    activation checkpointing the gradients equal the stored-activation ones bitwise (recomputed
    routing is the same routing)."""
    groups = _groups(moe_checkpoint)
    mixed = dataclasses.replace(TRAIN, compute=ComputeConfig(dtype="bfloat16"),
                                memory=MemoryConfig(activation_checkpointing=activation_checkpointing))
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(moe_checkpoint)), mixed, temperature=1.0, seed=0))
    seen: list[torch.dtype] = []
    for m in trainer.model.modules():
        if isinstance(m, GroupedExperts):
            m.register_forward_pre_hook(lambda mod, args: seen.extend([mod.gate_proj.dtype, args[0].dtype]))
    grads = _step_moves_moe_weights(trainer, groups)
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}

    ref = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=str(moe_checkpoint), dtype="bfloat16"),
            dataclasses.replace(TRAIN, memory=MemoryConfig()),
            temperature=1.0,
            seed=0,
        )
    )
    ref.accumulate_gradients(pack(groups, pad_id=ref.model.config.eos_token_id or 0, current_version=0))
    for name, p in ref.model.named_parameters():
        assert torch.equal(grads[name], p.grad.float()), name


# ----------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def moe_run(moe_checkpoint, tmp_path_factory):
    """A run directory with one real training checkpoint of the MoE policy after one GRPO step;
    returns the run directory and the policy's HF state at that step."""
    from titanrl.rundir.checkpoints import writing_checkpoint

    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(moe_checkpoint)), TRAIN, temperature=1.0, seed=0))
    assert trainer.step(_groups(moe_checkpoint)) is not None
    run_dir = tmp_path_factory.mktemp("moe_run") / "run"
    with writing_checkpoint(run_dir, 1, manifest={"policy_version": 1}) as ckpt:
        trainer.save_state(str(ckpt / "trainer"))
    return run_dir, {k: v.clone() for k, v in hf_state_dict(trainer.model).items()}


@pytest.fixture(scope="module")
def exported(moe_run, tmp_path_factory):
    """`titanrl export RUN --hf OUT` of the MoE run."""
    from titanrl.cli import main

    out = tmp_path_factory.mktemp("moe_export") / "hf"
    assert main(["export", str(moe_run[0]), "--hf", str(out)]) == 0
    return out


def test_export_of_moe_training_checkpoint_loads_in_transformers(moe_run, exported):
    """The export holds the trained policy's tensors exactly, one per expert as transformers names
    them; transformers' Qwen3MoeForCausalLM loads it and its logits equal ours to <= 1e-5."""
    import json

    from transformers import AutoModelForCausalLM

    _, state = moe_run
    written = read_state_dict(exported)
    assert written.keys() == state.keys() and any(".mlp.experts.3.down_proj.weight" in k for k in written)
    for k, v in state.items():
        assert torch.equal(written[k], v), k
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    model, _ = load_model(exported)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() <= 1e-5


@pytest.mark.slow
@pytest.mark.own_vllm_engine
def test_exported_moe_runs_in_vllm_builtin_qwen3_moe(exported, monkeypatch):
    """vLLM's own Qwen3MoeForCausalLM (plain `vllm.LLM(model=OUT)`, in-process, no overrides)
    loads the export: its prompt and sampled-token logprobs equal ours to 2e-5 (measured 1-3e-6) and its greedy tokens equal a greedy
    decode with our model on the same weights."""
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it in this process
    llm = LLM(model=str(exported), tokenizer=str(exported), dtype="float32", max_model_len=64, enforce_eager=True,
              kv_cache_memory_bytes=2**28, max_num_seqs=4, seed=0)
    try:
        arch = llm.collective_rpc(lambda worker: type(worker.get_model()).__name__)[0]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        (result,) = llm.generate(["12+34=56, 7*8="], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        torch.set_num_threads = set_num_threads
    assert arch == "Qwen3MoeForCausalLM"
    prompt, tokens = list(result.prompt_token_ids), list(result.outputs[0].token_ids)
    assert len(tokens) == 8
    model, _ = load_model(exported)
    with torch.no_grad():
        ours = torch.log_softmax(model(torch.tensor([prompt + tokens]))[0].double(), -1)
    theirs = [lp[t].logprob for lp, t in zip(result.prompt_logprobs[1:], prompt[1:], strict=True)]
    theirs += [lp[t].logprob for lp, t in zip(result.outputs[0].logprobs, tokens, strict=True)]
    seq = prompt + tokens
    want = [ours[i - 1, seq[i]].item() for i in range(1, len(seq))]
    assert max(abs(a - b) for a, b in zip(theirs, want, strict=True)) <= 2e-5
    greedy = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            greedy.append(int(model(torch.tensor([greedy]))[0, -1].argmax()))
    assert greedy[len(prompt):] == tokens


def test_trainer_save_writes_the_trained_moe_policy(moe_checkpoint, tmp_path):
    """`GRPOTrainer.save` (the run's final export) of an MoE policy writes one HF tensor per expert
    holding exactly the trained stacked weights: the trainer gathers model-named (stacked) tensors."""
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(moe_checkpoint)), TRAIN, temperature=1.0, seed=0))
    _step_moves_moe_weights(trainer, _groups(moe_checkpoint))
    out = trainer.save(str(tmp_path / "export"))
    saved = read_state_dict(out)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved
    reloaded, _ = load_model(out)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(dict(reloaded.named_parameters())[name], p.detach()), name
