"""lora.sync='adapter' against a real vLLM engine running our model: a push carries the adapters
alone, the engine computes with them beside its frozen base (nothing merged), and its sampled
logprobs equal the trainer's bit for bit (batch-invariant mode)."""

from __future__ import annotations

import pytest
import torch

from titanrl.config import EngineConfig, LoraConfig, MemoryConfig, ModelConfig, TrainConfig
from titanrl.models.common.lora import lora_modules
from titanrl.models.tiny import write_tiny_checkpoint
from titanrl.trainer.batch import pack
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, Sample

LORA = LoraConfig(rank=4, alpha=8.0, sync="adapter")


def _groups(prompts: list[str], outputs: list, version: int) -> list[Group]:
    return [Group([Sample(text, c.text, c.prompt_token_ids, c.token_ids, c.logprobs, float(i % 2), j, version)
                   for i, c in enumerate(grp)]) for j, (text, grp) in enumerate(zip(prompts, outputs))]


@pytest.mark.own_vllm_engine
def test_an_adapter_push_reaches_vllm_and_keeps_parity_exact(tmp_path):
    """The trainer's adapters (B made non-zero) pushed as adapters alone: the engine then holds
    exactly those factors and its base weights unchanged (torch.equal), and every token it samples
    has the trainer's logprob to the bit. Before the push the engine runs the base model, which
    the same parity check tells apart from the adapted policy (the control)."""
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig, adapter_sync

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", seed=11, std=0.1)
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(ckpt)), TrainConfig(memory=MemoryConfig(micro_batch_size=4)),
                                       1.0, 0, batch_invariant=True, lora=LORA))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in lora_modules(trainer.model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.2)
    engine = VllmEngine(VllmEngineConfig(checkpoint=str(ckpt), batch_invariant=True, lora=adapter_sync(LORA),
                                         settings=EngineConfig(max_model_len=512, max_num_seqs=16)))
    prompts = ["12+34=", "hello", "a longer prompt about numbers: 98765 - 4321 ="]
    try:
        before = engine.generate(prompts, n=2, temperature=1.0, max_tokens=12, seed=3)
        base_state = engine.worker_state_dict()
        pushed = dict(trainer.state_dict_for_push().items())
        engine.update_weights(pushed, version=trainer.version)
        after = engine.generate(prompts, n=2, temperature=1.0, max_tokens=12, seed=3)
        state = engine.worker_state_dict()
    finally:
        engine.close()

    adapters = {n for n in state if ".lora_" in n}
    assert adapters == set(pushed) and all(torch.equal(state[n], pushed[n]) for n in adapters)
    assert all(torch.equal(state[n], base_state[n]) for n in state if n not in adapters)

    parity = trainer.measure_parity(pack(_groups(prompts, after, trainer.version), trainer.pad_id,
                                         current_version=trainer.version))
    assert parity.checked == sum(len(c.token_ids) for grp in after for c in grp) > 0
    assert parity.diff_max == 0.0 and parity.different == 0
    control = trainer.measure_parity(pack(_groups(prompts, before, trainer.version), trainer.pad_id,
                                          current_version=trainer.version))
    assert control.diff_max > 0.0
