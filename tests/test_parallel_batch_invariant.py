"""Pipeline stages in batch-invariant mode compute the full batch-invariant model's bits (one process).

The gloo-world checks (the pipelined GRPOStep's logprobs and loss against GRPOTrainer)
are in test_parallel_layouts.py and test_parallel_layouts_4.py; this checks the stage modules
themselves, and the chunked LM head the step applies to the last stage's hidden states (a plain
matmul gives a 1-3 row call other bits on CPU).
"""

import pytest
import torch

from titanrl import kernels
from titanrl.models.hf_checkpoint import load_model
from titanrl.models.tiny import write_tiny_checkpoint
from titanrl.trainer.chunked_logprobs import chunked_token_logprobs
from support.layout_check import TINY_MODEL
from titanrl.trainer.parallel.pipeline import PipelineStageModel


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The layout checks' tiny 4-layer policy, tied embeddings (the last stage's head is the embedding)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("bi_stages") / "ckpt", seed=0, tie_word_embeddings=True,
                                 **TINY_MODEL)


def _run(stages: list[PipelineStageModel], ids: torch.Tensor) -> torch.Tensor:
    h = ids
    for stage in stages:
        h = stage(h)
    return h


@pytest.mark.parametrize("n_stages", [2, 4])
def test_stages_give_the_batch_invariant_models_bits(checkpoint, n_stages):
    """Stages cut from a model after set_batch_invariant(True) carry the mode (every submodule),
    and stages cut from a plain model switched with the stage's set_batch_invariant(True) (what
    GRPOStep does) match them: chained over 2 or 4 stages, the last stage's final-norm
    hidden states of a 1x1, 1x3, 2x5 and 3x7 call are torch.equal to the full batch-invariant
    model's on the whole 3x7 batch, and the step's chunked batch-invariant head (3-token chunks,
    the last stage's tied head weight) turns them into exactly the logprobs `kernels.token_logprobs`
    gives on the full model's logits (rows and prefixes computed in other calls keep their bits)."""
    torch.set_num_threads(1)
    ids = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    full, _ = load_model(checkpoint)
    full.set_batch_invariant(True)
    carried = [PipelineStageModel(full, s, n_stages, None) for s in range(n_stages)]
    assert all(m.batch_invariant for st in carried for m in st.modules() if hasattr(m, "batch_invariant"))
    plain, _ = load_model(checkpoint)
    switched = [PipelineStageModel(plain, s, n_stages, None) for s in range(n_stages)]
    assert not any(m.batch_invariant for m in switched[-1].modules() if hasattr(m, "batch_invariant"))
    for stage in switched:
        stage.set_batch_invariant(True)
    targets = ids.roll(-1, 1)
    with torch.no_grad():
        want = full.hidden_states(ids)
        want_lp = kernels.token_logprobs(full(ids), targets, 0.7)
        for stages in (carried, switched):
            for B, T in [(1, 1), (1, 3), (2, 5), (3, 7)]:
                got = _run(stages, ids[:B, :T])
                assert torch.equal(got, want[:B, :T]), (n_stages, B, T, (got - want[:B, :T]).abs().max())
                lp, _ = chunked_token_logprobs(got.reshape(B * T, -1), stages[-1].lm_head.weight,
                                               targets[:B, :T].reshape(-1), 0.7, 3, batch_invariant=True)
                assert torch.equal(lp.view(B, T), want_lp[:B, :T]), (n_stages, B, T)
