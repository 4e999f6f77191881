"""vLLM's CPU kernels swapped into our modules (`titanrl.models.common.vllm_kernels`): same
function, same parameter names, packed copies that follow the weights only through a repack, and
batch-invariant mode untouched; inside the engine, parity with vLLM's built-in Qwen3."""

import copy

import pytest
import torch

pytest.importorskip("vllm")

from titanrl.models.tiny import tiny_config  # noqa: E402
from titanrl.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from titanrl.models.common.vllm_kernels import (  # noqa: E402
    VllmAttention,
    VllmCpuLinear,
    VllmMLP,
    apply_vllm_kernels,
    repack_vllm_kernels,
)

TOKENS = torch.tensor([[(5 * t + 3) % 250 for t in range(40)], [(11 * t + 1) % 250 for t in range(40)]])


def _pair(seed: int = 0) -> tuple[Qwen3ForCausalLM, Qwen3ForCausalLM]:
    """A tiny model on torch's kernels and a deep copy of it on vLLM's, packed."""
    torch_model = Qwen3ForCausalLM(tiny_config())
    torch_model.init_weights(seed=seed, std=0.1)
    vllm_model = apply_vllm_kernels(copy.deepcopy(torch_model))
    # per layer: packed q/k/v, packed gate/up, o_proj, down_proj; then the LM head
    assert repack_vllm_kernels(vllm_model) == 4 * torch_model.config.num_hidden_layers + 1
    return torch_model, vllm_model


@torch.no_grad()
def test_overrides_compute_the_same_function_under_the_same_names():
    """Logits of the overridden model are within 2e-5 of torch's kernels (float32, std-0.1 weights:
    logits of order 1); every parameter keeps its name and shape, the tied head stays tied, and the
    modules really are the overrides."""
    torch_model, vllm_model = _pair()
    assert [(n, p.shape) for n, p in vllm_model.named_parameters()] == \
        [(n, p.shape) for n, p in torch_model.named_parameters()]
    assert vllm_model.lm_head.weight is vllm_model.model.embed_tokens.weight
    kinds = {type(m) for m in vllm_model.modules()}
    assert {VllmAttention, VllmMLP, VllmCpuLinear} <= kinds
    diff = (vllm_model(TOKENS) - torch_model(TOKENS)).abs().max().item()
    assert diff <= 2e-5


@torch.no_grad()
def test_a_weight_write_reaches_the_kernels_through_repack():
    """Writing new values into the Parameters in place (as every push does) leaves the packed
    copies stale until `repack_vllm_kernels`; after it the logits follow the new weights."""
    torch_model, vllm_model = _pair()
    before = vllm_model(TOKENS)
    new_model, _ = _pair(seed=1)
    for (_, dest), (_, src) in zip(vllm_model.named_parameters(), new_model.named_parameters()):
        dest.copy_(src)
    stale = vllm_model(TOKENS)
    assert not torch.equal(stale, before)  # the embedding and norms read the Parameters
    assert (stale - new_model(TOKENS)).abs().max().item() > 1e-2  # still (partly) the old weights
    repack_vllm_kernels(vllm_model)
    assert (vllm_model(TOKENS) - new_model(TOKENS)).abs().max().item() <= 2e-5


@torch.no_grad()
def test_batch_invariant_mode_keeps_its_own_kernels():
    """With batch-invariant mode switched on, the overridden model's logits equal the plain
    model's in that mode bit for bit: every override hands back to titanrl.kernels."""
    torch_model, vllm_model = _pair()
    torch_model.set_batch_invariant(True)
    vllm_model.set_batch_invariant(True)
    assert torch.equal(vllm_model(TOKENS), torch_model(TOKENS))


def test_engine_runs_the_overrides_and_matches_vllm_builtin_qwen3(vllm_engine, vllm_tiny_checkpoint):
    """The session engine (our model, vLLM kernels on by default) and vLLM's own Qwen3ForCausalLM on
    the same checkpoint run the same kernels: identical greedy tokens, and the prompt and sampled
    logprobs of the same requests are equal bit for bit (on torch's kernels they differ by ~3e-6)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    classes = vllm_engine.llm.collective_rpc(lambda w: sorted({type(m).__name__ for m in w.get_model().modules()}))[0]
    assert {"VllmAttention", "VllmCpuLinear", "VllmMLP", "VllmRotaryEmbedding"} <= set(classes)

    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 13 * j + 1) % 250 for j in range(24 + 9 * i)]) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, prompt_logprobs=0)
    vllm_engine.llm.reset_prefix_cache()  # no cache hits from earlier tests: the same shapes in both
    ours = vllm_engine.llm.generate(prompts, params, use_tqdm=False)
    builtin = LLM(model=str(vllm_tiny_checkpoint), tokenizer=str(vllm_tiny_checkpoint), dtype="float32",
                  max_model_len=256, max_num_seqs=32, kv_cache_memory_bytes=2**28, enforce_eager=True, seed=0)
    try:
        theirs = builtin.generate(prompts, params, use_tqdm=False)
    finally:
        builtin.llm_engine.engine_core.shutdown()
    diffs = []
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:]):
            diffs.append(abs(pa[t].logprob - pb[t].logprob))
        for pa, pb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            diffs.append(abs(pa[t].logprob - pb[t].logprob))
    assert max(diffs) == 0.0


def _adapted_pair() -> tuple[Qwen3ForCausalLM, Qwen3ForCausalLM]:
    """`_pair`'s models with the same unmerged LoRA adapters (lora.sync='adapter'), B non-zero."""
    from titanrl.models.common.lora import add_adapters, lora_modules
    from titanrl.models.spec import DECODER_LORA_TARGETS

    torch_model = Qwen3ForCausalLM(tiny_config())
    torch_model.init_weights(seed=0, std=0.1)
    add_adapters(torch_model, DECODER_LORA_TARGETS, rank=4, alpha=8.0, seed=1, unmerged=True)
    g = torch.Generator().manual_seed(2)
    for m in lora_modules(torch_model).values():
        m.lora_B.weight.data.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    vllm_model = apply_vllm_kernels(copy.deepcopy(torch_model))
    assert repack_vllm_kernels(vllm_model) == 4 * torch_model.config.num_hidden_layers + 1
    return torch_model, vllm_model


def _packed_gemms(model: torch.nn.Module) -> list:
    return [getattr(m, name) for m in model.modules() for name in ("gemm", "qkv_gemm", "gate_up_gemm")
            if getattr(m, name, None) is not None]


@torch.no_grad()
def test_adapted_projections_run_on_the_packed_base_plus_their_lora_term():
    """LoRA's unmerged form under the overrides: the packed GEMMs hold the frozen base and each
    adapted projection adds its s (x A^T) B^T, so the logits are within 2e-5 of torch's kernels
    (and far from the base model's: the adapters count). A push of new adapters lands without a
    repack (the packed base is not rebuilt: the GEMMs are the same objects), and a base weight
    written in place is repacked."""
    from titanrl.models.common.lora import adapter_parameters

    torch_model, vllm_model = _adapted_pair()
    kinds = {type(m).__name__ for m in vllm_model.modules()}
    assert {"VllmAttention", "VllmMLP", "VllmCpuLoraLinear"} <= kinds
    want = torch_model(TOKENS)
    assert (vllm_model(TOKENS) - want).abs().max().item() <= 2e-5

    gemms = _packed_gemms(vllm_model)
    for model in (torch_model, vllm_model):
        for p in adapter_parameters(model).values():
            p.mul_(-2.0)  # a push writes A and B in place
    repack_vllm_kernels(vllm_model)
    assert _packed_gemms(vllm_model) == gemms  # nothing repacked
    moved = torch_model(TOKENS)
    assert (moved - want).abs().max().item() > 1e-2
    assert (vllm_model(TOKENS) - moved).abs().max().item() <= 2e-5

    layer = vllm_model.model.layers[0]
    before = layer.mlp.down_proj.gemm
    layer.mlp.down_proj.weight.mul_(0.5)  # the base written in place (a full push would)
    repack_vllm_kernels(vllm_model)
    assert layer.mlp.down_proj.gemm is not before


@torch.no_grad()
def test_adapted_model_in_batch_invariant_mode_keeps_its_own_kernels():
    """With adapters too, batch-invariant mode hands every module back to titanrl.kernels: the
    overridden model's logits equal the plain one's bit for bit."""
    torch_model, vllm_model = _adapted_pair()
    torch_model.set_batch_invariant(True)
    vllm_model.set_batch_invariant(True)
    assert torch.equal(vllm_model(TOKENS), torch_model(TOKENS))
