"""LoRA (lora.rank > 0): adapter gradients, frozen base, merged pushes, exact resume, the PEFT
export, and the refusals of what is not built yet (docs/lora.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import weakref

import pytest
import torch
from support.config_cases import checkpoint_dir, fails_validation, good_config  # noqa: F401  (fixtures)
from support.sections import merged
from test_trainer_state import TRAIN, _assert_same_optimizer, _batches

from titanrl.config import ComputeConfig, ConfigError, LoraConfig, ModelConfig, ParallelConfig, TrainConfig, apply_overrides, validate
from titanrl.models.common.lora import LoraLinear, adapter_parameters, add_adapters, lora_modules
from titanrl.models.hf_checkpoint import CheckpointError, load_model
from titanrl.models.spec import DECODER_LORA_TARGETS
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer

LORA = LoraConfig(rank=4, alpha=8.0, sync="merged")
ADAPTER_SYNC = LoraConfig(rank=4, alpha=8.0)  # lora.sync='adapter', the default


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny untied Llama with biases on every projection (bias and untied head both exercised)."""
    from titanrl.models.tiny import tiny_config, write_checkpoint

    config = tiny_config("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    return write_checkpoint(tmp_path_factory.mktemp("lora") / "llama", config, seed=7, std=0.1)


def _trainer(path, lora: LoraConfig = LORA, batch_invariant: bool = False, **train) -> GRPOTrainer:
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(path)), merged(TrainConfig(**TRAIN), **train),
                                    temperature=0.9, seed=0, batch_invariant=batch_invariant, lora=lora))


def _nonzero_b(model: torch.nn.Module, seed: int = 1) -> None:
    """Fresh adapters have B = 0 (the update B @ A is 0 and A gets no gradient); give B values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)


def _independent_merge(state: dict[str, torch.Tensor], name: str, scale: float) -> torch.Tensor:
    """W + (scale * B) @ A (LoraLinear.merged_weight's definition) from the tensors of a state dict,
    written out here."""
    w, a, b = state[f"{name}.weight"], state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
    return torch.addmm(w, b * scale, a)


@pytest.mark.parametrize("unmerged", [False, True])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_adapter_gradients_match_float64_reference(ckpt, batch_invariant, unmerged):
    """The gradients of every A and B (B non-zero) equal those of a float64 reference: the base model
    run through torch.func.functional_call with each target weight replaced by W + s * B @ A built
    from float64 leaves, no LoraLinear involved, for both forms the module computes in. The base
    weights get no gradient."""
    model, _ = load_model(str(ckpt), dtype=torch.float32)
    ref_model, _ = load_model(str(ckpt), dtype=torch.float64)
    add_adapters(model, DECODER_LORA_TARGETS, rank=4, alpha=8.0, seed=3, unmerged=unmerged)
    _nonzero_b(model)
    model.set_batch_invariant(batch_invariant)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    probe = torch.randn(2, 9, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    (model(ids) * probe).sum().backward()

    leaves, params = {}, dict(ref_model.named_parameters())
    for name, m in lora_modules(model).items():
        a = m.lora_A.weight.detach().double().requires_grad_()
        b = m.lora_B.weight.detach().double().requires_grad_()
        leaves[name] = (a, b)
        params[f"{name}.weight"] = params[f"{name}.weight"].detach() + (8.0 / 4) * (b @ a)
    logits = torch.func.functional_call(ref_model, params, (ids,))
    (logits * probe.double()).sum().backward()

    assert len(leaves) == 7 * model.config.num_hidden_layers
    for name, (a, b) in leaves.items():
        m = lora_modules(model)[name]
        for got, ref in ((m.lora_A.weight.grad, a.grad), (m.lora_B.weight.grad, b.grad)):
            # float32 against float64: equal to float32's accumulated rounding, relative to the gradient's size
            assert ref.norm() > 0 and (got.double() - ref).norm() / ref.norm() < 1e-5, name
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_backward_merges_again_instead_of_keeping_merged_weights(ckpt, monkeypatch, batch_invariant, compute_dtype):
    """After the forward autograd holds none of the merged weights it made (each is merged again in
    the backward), and the adapter gradients are bit for bit those of a forward that keeps them
    (the recompute switched off, which is also the control: then every merged weight stays alive)."""
    from titanrl.models.common import decoder
    from titanrl.trainer.parallel.mixed_precision import apply_compute_dtype

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))

    def run(recompute: bool) -> tuple[int, int, dict[str, torch.Tensor]]:
        model, _ = load_model(str(ckpt), dtype=torch.float32)
        add_adapters(model, DECODER_LORA_TARGETS, rank=4, alpha=8.0, seed=3)
        _nonzero_b(model)
        model.set_batch_invariant(batch_invariant)
        if compute_dtype != torch.float32:
            apply_compute_dtype(model, compute_dtype)
        made: list[weakref.ref] = []
        merge = LoraLinear.merged_weight
        with monkeypatch.context() as patch:
            def spy(self, dtype=None, out=None):
                merged = merge(self, dtype, out)
                made.append(weakref.ref(merged))
                return merged

            patch.setattr(LoraLinear, "merged_weight", spy)
            if not recompute:
                patch.setattr(decoder, "recompute_merged_weights", lambda module: contextlib.nullcontext())
            logits = model(ids)
            gc.collect()
            alive, count = sum(r() is not None for r in made), len(made)
            probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
            (logits.float() * probe).sum().backward()
        return alive, count, {n: p.grad for n, p in adapter_parameters(model).items()}

    alive, made, grads = run(recompute=True)
    kept, made_off, reference = run(recompute=False)
    adapted = 7 * 2  # seven projections in each of the tiny model's two blocks
    assert made == made_off == adapted and alive == 0
    # Without the recompute autograd keeps them (all 14, or 11 where F.linear saves no weight for
    # layer 0's q, k, v: their input comes from the frozen embedding and needs no gradient).
    assert kept >= adapted - 3
    assert grads.keys() == reference.keys() and len(grads) == 2 * adapted
    for name, grad in reference.items():
        assert torch.equal(grads[name], grad), name


def test_optimizer_holds_adapters_only_and_base_stays(ckpt):
    """The AdamW holds exactly the lora_A / lora_B parameters; after two steps every base tensor
    (embedding, norms, head, projections and their biases) is bitwise the checkpoint's, and the
    adapters moved."""
    tr = _trainer(ckpt)
    base, _ = load_model(str(ckpt), dtype=torch.float32)
    held = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    adapters = {n: p for n, p in tr.model.named_parameters() if ".lora_" in n}
    assert held == {id(p) for p in adapters.values()} and len(adapters) == 2 * 7 * 2
    before = {n: p.detach().clone() for n, p in adapters.items()}
    for groups in _batches(2):
        tr.step(groups)
    state = tr.model.state_dict()
    for name, tensor in base.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert all(not torch.equal(before[n], p) for n, p in adapters.items() if n.endswith("lora_B.weight"))


def test_pushed_weights_are_the_merged_weights(ckpt):
    """After a step, the push (state_dict_for_push and the transports' source) holds, under the base
    model's HF names only, W + (alpha/r) * B @ A computed here from the trainer's tensors (torch.equal),
    and the base tensor elsewhere. A plain model loaded with the pushed weights gives the trainer's
    batch-invariant logits bit for bit: what a batch-invariant generator computes."""
    tr = _trainer(ckpt, batch_invariant=True)
    tr.step(_batches(1)[0])
    state = {k: v.detach() for k, v in tr.model.state_dict().items()}
    pushed = dict(tr.state_dict_for_push().items())
    base, _ = load_model(str(ckpt), dtype=torch.float32)
    assert set(pushed) == set(base.state_dict())
    targets = lora_modules(tr.model)
    for name in pushed:
        module = name.removesuffix(".weight")
        want = _independent_merge(state, module, 8.0 / 4) if module in targets else state[name]
        assert torch.equal(pushed[name], want), name
    assert any(not torch.equal(pushed[f"{m}.weight"], state[f"{m}.weight"]) for m in targets)
    source = dict(tr._weight_source().tensors())
    assert source.keys() == pushed.keys() and all(torch.equal(source[k], pushed[k]) for k in pushed)

    plain, _ = load_model(str(ckpt), dtype=torch.float32)
    plain.load_state_dict(pushed)
    plain.set_batch_invariant(True)
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(plain(ids), tr.model(ids))


def test_adapter_push_carries_the_adapters_and_a_generator_merges_them_bit_for_bit(ckpt):
    """lora.sync='adapter': the trainer computes in the unmerged form, and a push (state_dict_for_push
    and the transports' source) holds the trainer's adapter factors alone, equal to them (torch.equal).
    A generator-side model (the base plus unmerged adapters of another initialisation, as the vLLM
    model builds them) takes that push through the engine's `ParameterTarget` and gives the trainer's
    batch-invariant logits bit for bit; the target refuses merged full weights, which would apply the
    adapters twice."""
    from titanrl.weight_sync.layout import WeightSyncError, layout_of
    from titanrl.weight_sync.target import ParameterTarget

    tr = _trainer(ckpt, lora=ADAPTER_SYNC, batch_invariant=True)
    assert all(m.unmerged for m in lora_modules(tr.model).values())
    _nonzero_b(tr.model)
    tr.step(_batches(1)[0])
    adapters = {n: p.detach() for n, p in tr.model.named_parameters() if ".lora_" in n}
    pushed = dict(tr.state_dict_for_push().items())
    assert pushed.keys() == adapters.keys() and all(torch.equal(pushed[n], adapters[n]) for n in adapters)
    source = dict(tr._weight_source().tensors())
    assert source.keys() == pushed.keys() and all(torch.equal(source[k], pushed[k]) for k in pushed)

    generator, _ = load_model(str(ckpt), dtype=torch.float32)
    add_adapters(generator, DECODER_LORA_TARGETS, rank=4, alpha=8.0, seed=99, unmerged=True)
    generator.set_batch_invariant(True)
    target = ParameterTarget(generator)
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = tr.model(ids)
        assert not torch.equal(generator(ids), want)  # before the push: the base model
        for dest, (name, tensor) in zip(target.check(layout_of(pushed.items())), pushed.items(), strict=True):
            dest.copy_(tensor)
        assert torch.equal(generator(ids), want)
    merged_push = {f"{m}.weight": w for m, w in ((m, mod.merged_weight()) for m, mod in lora_modules(tr.model).items())}
    with pytest.raises(WeightSyncError, match="matches no parameter"):
        target.check(layout_of(merged_push.items()))


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_mixed_precision_pushes_what_the_forward_computes(ckpt, batch_invariant):
    """float32 master weights computing in bfloat16: the push is W, A and B each cast to bfloat16,
    then merged (what the forward's casts compute with), and a bfloat16 model loaded with it gives
    the trainer's logits bit for bit."""
    tr = _trainer(ckpt, batch_invariant=batch_invariant, compute=ComputeConfig(dtype="bfloat16"))
    _nonzero_b(tr.model)
    tr.step(_batches(1)[0])
    pushed = dict(tr.state_dict_for_push().items())
    state = {k: v.detach().to(torch.bfloat16) for k, v in tr.model.state_dict().items()}
    for module in lora_modules(tr.model):
        assert torch.equal(pushed[f"{module}.weight"], _independent_merge(state, module, 8.0 / 4)), module
    plain, _ = load_model(str(ckpt), dtype=torch.bfloat16)
    plain.load_state_dict(pushed)
    plain.set_batch_invariant(batch_invariant)
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(plain(ids), tr.model(ids))


def test_resume_continues_bit_for_bit(ckpt, tmp_path):
    """Train 2 steps, save_state, train 2 more; a fresh LoRA trainer that load_state()s and trains the
    same 2 steps ends with bitwise-equal base, adapters and optimizer state, and equal metrics.
    The checkpoint holds the adapters and records rank, alpha and targets."""
    batches = _batches(4)
    a = _trainer(ckpt)
    for groups in batches[:2]:
        a.step(groups)
    a.save_state(str(tmp_path / "state"))
    ref = [a.step(groups) for groups in batches[2:]]

    b = _trainer(ckpt)
    assert b.load_state(str(tmp_path / "state")) == 2
    got = [b.step(groups) for groups in batches[2:]]
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and any(k.endswith("lora_A.weight") for k in sa)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    _assert_same_optimizer(a, b)
    assert [r["loss"] for r in ref] == [g["loss"] for g in got]
    recorded = torch.load(tmp_path / "state" / "trainer_state.pt", weights_only=True)["lora"]
    assert recorded["rank"] == 4 and recorded["alpha"] == 8.0 and recorded["base_model"] == str(ckpt.absolute())

    with pytest.raises(CheckpointError, match="lora.rank=4"):
        _trainer(ckpt, lora=LoraConfig(rank=2)).load_state(str(tmp_path / "state"))


def test_peft_loads_the_export_with_equal_logits(ckpt, tmp_path):
    """`titanrl export` of a LoRA run writes a PEFT adapter (from final/ and from a training
    checkpoint) that peft's PeftModel puts on transformers' model of the base checkpoint with
    logits equal to the trainer's (float32, 1e-5); --merge writes the full checkpoint, whose
    logits match too."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from titanrl.commands.export import export_run

    tr = _trainer(ckpt)
    _nonzero_b(tr.model)  # a trained-looking update on every target
    tr.step(_batches(1)[0])
    run = tmp_path / "run"
    tr.save(str(run / "final"))
    tr.save_state(str(tmp_path / "state"))
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = tr.model(ids)

    export_run(run, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and set(config["target_modules"]) == set(DECODER_LORA_TARGETS)
    from titanrl.trainer.checkpoint import export_peft_adapter

    export_peft_adapter(tmp_path / "state", tmp_path / "adapter_from_state")
    for adapter in ("adapter", "adapter_from_state"):
        base = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, str(tmp_path / adapter)).eval()
        with torch.no_grad():
            got = model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    from titanrl.cli import main

    assert main(["export", str(run), "--merge", "--hf", str(tmp_path / "merged")]) == 0
    assert not (tmp_path / "merged" / "adapter").exists()
    full = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(full(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-3)  # the adapters matter


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["lora.sync=merged"], ["lora.sync='merged'", "lora.rank=0"]),
        (["lora.alpha=32"], ["lora.alpha=32.0", "lora.rank=0"]),
        (["lora.rank=8", "lora.dropout=0.1"], ["lora.dropout=0.1", "set lora.dropout=0"]),
        (["lora.rank=-1"], ["lora.rank must be >= 0"]),
        (["lora.rank=8", "lora.alpha=0"], ["lora.alpha must be"]),
        (["lora.rank=8", "lora.target_modules=q_proj,qkv_proj"],
         ["lora.target_modules", "'qkv_proj'", "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"]),
        (["lora.rank=8", "train.parallel.pp=2"], ["lora with train.parallel.pp=2 is not supported yet",
                                                   "train.parallel.pp=1"]),
        (["lora.rank=8", "train.parallel.cp=2"], ["lora with train.parallel.cp=2 is not supported yet"]),
        (["lora.rank=8", "train.parallel.dp_shard=2", "train.parallel.pp=2", "train.parallel.cp=2"],
         ["lora with train.parallel.pp=2, train.parallel.cp=2 is not supported yet"]),
        (["lora.rank=8", "train.compute.device=xla"], ["lora with train.compute.device='xla'"]),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_field(good_config, overrides, needles):
    """Each refusal happens in validate, before any actor starts, and names the field."""
    fails_validation(apply_overrides(good_config, overrides), *needles)


def test_lora_config_validates_and_picks_targets(good_config):
    """--lora.rank=8 validates (either sync; in one process, under FSDP2 / HSDP and TP); the trainer's
    targets are the family spec's, or the ones named."""
    from titanrl.config.validation import lora_targets
    from titanrl.models.hf_checkpoint import read_config

    model_config = read_config(good_config.model.checkpoint)
    every = apply_overrides(good_config, ["lora.rank=8", "lora.alpha=16"])
    validate(every)
    validate(apply_overrides(good_config, ["lora.rank=8", "lora.sync=merged"]))
    named = apply_overrides(good_config, ["lora.rank=8", "lora.target_modules=v_proj,q_proj"])
    validate(named)
    for layout in (["train.parallel.dp_shard=2"], ["train.parallel.dp_replicate=2", "train.parallel.dp_shard=2"],
                   ["train.parallel.tp=2"], ["train.parallel.dp_shard=2", "train.parallel.tp=2"]):
        validate(apply_overrides(good_config, ["lora.rank=8", *layout]))  # FSDP2, HSDP, TP (test_lora_parallel.py)
    assert lora_targets(every.lora, model_config) == DECODER_LORA_TARGETS
    assert lora_targets(named.lora, model_config) == ("q_proj", "v_proj")


def test_lora_on_moe_family_is_refused(good_config, tmp_path):
    """A mixture-of-experts checkpoint: refused by family name (adapters on experts are not built)."""
    from titanrl.models.tiny import write_tiny_moe_checkpoint

    moe = write_tiny_moe_checkpoint(tmp_path / "moe")
    config = dataclasses.replace(good_config, model=ModelConfig(checkpoint=str(moe)))
    fails_validation(apply_overrides(config, ["lora.rank=8"]), "mixture-of-experts", "qwen3_moe")


def test_trainer_refuses_a_parallel_layout_before_joining(ckpt):
    """A trainer built by hand checks the layout before anything starts (no process group needed)."""
    with pytest.raises(ConfigError, match=r"lora with train.parallel.pp=2"):
        _trainer(ckpt, parallel=ParallelConfig(pp=2))


def test_wrapped_module_reads_like_a_linear():
    """LoraLinear keeps the base's parameter names (`weight`, `bias` frozen), adds lora_A / lora_B, and
    with B = 0 computes exactly the base linear."""
    base = torch.nn.Linear(6, 5)
    x = torch.randn(3, 6)
    want = base(x)
    m = LoraLinear(base, rank=2, alpha=4.0)
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias", "lora_A.weight", "lora_B.weight"]
    assert [p.requires_grad for p in m.parameters()] == [False, False, True, True]
    assert torch.equal(m(x), want)


def test_the_driver_hands_the_trainer_the_lora_section(good_config):
    """The run's `lora` section reaches the trainer actor's TrainerSetup (else --lora.rank would
    validate and then train every weight)."""
    from titanrl.config.resolve import resolve
    from titanrl.driver.actors import trainer_setup

    config = apply_overrides(good_config, ["lora.rank=8"])
    assert trainer_setup(resolve(config)).lora == config.lora
