"""validate_parallel's errors name the field and the fix; which layouts batch-invariant mode takes;
context-parallel chunking; no processes spawned."""

import pytest
import torch

from titanrl.config import ConfigError, ParallelConfig, RunConfig, TrainConfig
from titanrl.config.validation import _validate_trainer_layout
from titanrl.models.qwen3.moe import Qwen3MoeConfig
from titanrl.models.tiny import tiny_config
from titanrl.trainer.parallel.ring_attention import ContextLayout
from titanrl.config.parallel import sequence_multiple, validate_parallel

MODEL = tiny_config(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=False)
MOE = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, num_experts=4)


def test_valid_layouts_pass():
    """Layouts that fit the model and the world raise nothing (world size and seq_len optional)."""
    for kw, world in [(dict(), 1), (dict(dp_shard=2, tp=2), 4), (dict(pp=2, pp_schedule="Interleaved1F1B"), 2),
                      (dict(dp_replicate=2, dp_shard=2, cp=2), 8), (dict(tp=2, sequence_parallel=True), None)]:
        assert validate_parallel(ParallelConfig(**kw), MODEL, world, seq_len=64) is None  # no ConfigError


def test_expert_parallel_layouts_pass_and_borrow_ranks():
    """ep borrows its ranks: from dp_shard (ep divides it, HSDP included) or as the tp ranks (ep == tp,
    sequence parallel); the world size counts the other degrees only."""
    for kw, world in [(dict(dp_shard=2, ep=2), 2), (dict(dp_shard=4, ep=2), 4), (dict(dp_shard=4, ep=4), 4),
                      (dict(dp_replicate=2, dp_shard=2, ep=2), 4), (dict(tp=2, sequence_parallel=True, ep=2), 2),
                      (dict(dp_shard=2, tp=2, sequence_parallel=True, ep=2), 4), (dict(tp=2), 2)]:
        assert ParallelConfig(**kw).world_size == world
        assert validate_parallel(ParallelConfig(**kw), MOE, world) is None  # no ConfigError


def test_pipeline_accepts_tied_embeddings():
    """Pipeline layouts (alone, interleaved, with FSDP or TP) accept tie_word_embeddings=True:
    the first and last stages each keep a copy of the tied matrix, kept equal by the step."""
    tied = tiny_config(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=True)
    for kw, world in [(dict(pp=2), 2), (dict(pp=2, pp_schedule="Interleaved1F1B"), 2), (dict(pp=4), 4),
                      (dict(pp=2, dp_shard=2), 4), (dict(pp=2, tp=2), 4)]:
        assert validate_parallel(ParallelConfig(**kw), tied, world) is None  # no ConfigError


@pytest.mark.parametrize(
    "kw, world, seq_len, model, needles",
    [
        (dict(dp_shard=2, tp=2), 2, None, MODEL, ["multiply to 4", "trainer has 2 processes", "product is 2"]),
        (dict(tp=4), 4, None, MODEL, ["tp=4 must divide", "num_key_value_heads (2)", "pick tp from [1, 2]"]),
        (dict(tp=3), 3, None, tiny_config(num_attention_heads=3, num_key_value_heads=3, intermediate_size=128),
         ["intermediate_size (128)"]),
        (dict(pp=3), 3, None, MODEL, ["3 stages", "num_hidden_layers (4)"]),
        (dict(pp=4, pp_schedule="Interleaved1F1B"), 4, None, MODEL, ["8 stages", "pp x 2 divides 4"]),
        (dict(pp=2, pp_schedule="ZeroBubble"), 2, None, MODEL, ["pp_schedule='ZeroBubble'", "'1F1B'", "'GPipe'"]),
        (dict(dp_shard=2, ep=2), 2, None, MODEL, ["expert parallelism", "is dense", "train.parallel.ep=1"]),
        (dict(dp_shard=2, ep=2), 4, None, MOE, ["multiply to 2", "ep borrows ranks", "product is 4"]),
        (dict(dp_shard=6, ep=3), 6, None, MOE, ["ep=3 must divide", "num_experts (4)", "[1, 2, 4]"]),
        (dict(dp_shard=2, ep=4), 2, None, MOE, ["ep=4 must divide train.parallel.dp_shard (2)", "[1, 2]"]),
        (dict(tp=2, ep=2), 2, None, MOE, ["tp ranks", "ep=2 and sequence_parallel=true"]),
        (dict(tp=2, sequence_parallel=True, dp_shard=4, ep=4), 8, None, MOE, ["with tp=2", "ep=2"]),
        (dict(dp_shard=2, cp=2, ep=2), 4, None, MOE, ["cp=2, pp=1", "cp=1 and pp=1, or ep=1"]),
        (dict(dp_shard=2, pp=2, ep=2), 4, None, MOE, ["cp=1, pp=2", "cp=1 and pp=1, or ep=1"]),
        (dict(cp=2), 2, 30, MODEL, ["multiple of 4", "2 x cp=2 chunks", "pad it to 32"]),
        (dict(cp=2, tp=2, sequence_parallel=True), 4, 36, MODEL, ["multiple of 8", "tp=2 sequence-parallel", "40"]),
        (dict(dp_shard=0), 0, None, MODEL, ["train.parallel.dp_shard must be an integer >= 1"]),
    ],
)
def test_errors_say_what_to_change(kw, world, seq_len, model, needles):
    """Each invalid layout raises ConfigError whose message names the field and the fix."""
    with pytest.raises(ConfigError) as err:
        validate_parallel(ParallelConfig(**kw), model, world, seq_len=seq_len)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_sequence_multiple():
    """Padding granularity: 2*cp for load-balanced ring attention, times tp under sequence parallel."""
    assert sequence_multiple(ParallelConfig()) == 1
    assert sequence_multiple(ParallelConfig(tp=2)) == 1
    assert sequence_multiple(ParallelConfig(tp=2, sequence_parallel=True)) == 2
    assert sequence_multiple(ParallelConfig(cp=2)) == 4
    assert sequence_multiple(ParallelConfig(cp=2, tp=2, sequence_parallel=True)) == 8


def test_context_layout_chunks_cover_the_sequence_once():
    """Load-balanced: rank r holds chunks r and 2cp-1-r; over all ranks the shards and positions
    cover every position exactly once, and shard() picks exactly those positions' values."""
    T, cp = 24, 3
    x = torch.arange(T).repeat(2, 1)
    for balanced in (True, False):
        seen = []
        for r in range(cp):
            layout = ContextLayout(cp, r, balanced)
            pos = layout.positions(T // cp)
            assert torch.equal(layout.shard(x, 1), pos.expand(2, -1))
            seen += pos.tolist()
        assert sorted(seen) == list(range(T))
    assert ContextLayout(3, 0).chunk_ids() == (0, 5) and ContextLayout(3, 2).chunk_ids() == (2, 3)
    with pytest.raises(ValueError, match="not a multiple of the 6 context-parallel chunks"):
        ContextLayout(3, 0).shard(torch.zeros(1, 20), 1)


def test_batch_invariant_accepts_data_parallel_and_pipeline():
    """batch_invariant=True passes with dp_shard, dp_replicate and pp (every schedule, and pp x
    dp_shard), both in validate_parallel and in RunConfig's trainer-layout check: these layouts only
    change which rows share a kernel call, not a row's arithmetic."""
    for kw, world in [(dict(dp_shard=2), 2), (dict(dp_replicate=2), 2), (dict(pp=2), 2),
                      (dict(pp=2, pp_schedule="GPipe"), 2), (dict(pp=2, pp_schedule="Interleaved1F1B"), 2),
                      (dict(pp=2, dp_shard=2), 4), (dict(pp=4, dp_replicate=2), 8)]:
        parallel = ParallelConfig(**kw)
        assert validate_parallel(parallel, MODEL, world, batch_invariant=True) is None  # no ConfigError
        run = RunConfig(batch_invariant=True, train=TrainConfig(parallel=parallel))
        assert _validate_trainer_layout(run, MODEL) is None


@pytest.mark.parametrize("kw", [dict(tp=2), dict(cp=2), dict(pp=2, tp=2), dict(dp_shard=2, cp=2)])
def test_batch_invariant_refuses_tensor_and_context_parallel(kw):
    """batch_invariant=True with tp or cp raises ConfigError (from validate_parallel and from
    RunConfig validation) that says why (row-parallel partial sums, ring attention: another
    reduction order than the generator's, so vLLM's bits cannot be matched) and what to use
    instead (dp_shard / dp_replicate / pp); the same layouts pass without batch_invariant."""
    parallel = ParallelConfig(**kw)
    assert validate_parallel(parallel, MODEL, parallel.world_size) is None
    run = RunConfig(batch_invariant=True, train=TrainConfig(parallel=parallel))
    for call in (lambda: validate_parallel(parallel, MODEL, parallel.world_size, batch_invariant=True),
                 lambda: _validate_trainer_layout(run, MODEL)):
        with pytest.raises(ConfigError) as err:
            call()
        msg = str(err.value)
        for needle in (f"tp={parallel.tp}, cp={parallel.cp}", "row-parallel partial", "ring attention",
                       "vLLM's bits", "dp_shard / dp_replicate / pp", "batch_invariant=False"):
            assert needle in msg, (needle, msg)
