"""The rule that turns an agent episode's recorded calls into training samples (titanrl.agents.calls)."""

from __future__ import annotations

import pytest

from titanrl.agents.calls import CallRecord, assemble


def _call(index: int, prompt: list[int], completion: list[int], version: int = 0) -> CallRecord:
    return CallRecord(call_index=index, prompt_ids=prompt, completion_ids=completion,
                      logprobs=[-0.5 - 0.01 * t for t in completion], version=version, text="", finished=True)


def _decode(ids: list[int]) -> str:
    return "|".join(map(str, ids))


def test_calls_that_extend_each_other_are_one_sample_with_inserted_tokens_masked():
    """Three calls, each prompt = the previous prompt + completion + inserted tokens: one sample whose
    completion is the completions (mask 1, their logprobs and versions) and the inserted tokens (mask 0)."""
    c0 = _call(0, [1, 2, 3], [10, 11])
    c1 = _call(1, [1, 2, 3, 10, 11, 50, 51], [12], version=1)
    c2 = _call(2, [1, 2, 3, 10, 11, 50, 51, 12, 52], [13, 14], version=1)
    result = assemble([c0, c1, c2], _decode)
    assert result.prefix_breaks == 0
    (piece,) = result.pieces
    assert piece.prompt_ids == [1, 2, 3]
    assert piece.completion_ids == [10, 11, 50, 51, 12, 52, 13, 14]
    assert piece.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert piece.logprobs == c0.logprobs + [0.0, 0.0] + c1.logprobs + [0.0] + c2.logprobs
    assert piece.versions == [0, 0, 0, 0, 1, 1, 1, 1]
    assert piece.calls == 3
    assert [t["role"] for t in piece.transcript] == ["model", "env", "model", "env", "model"]
    assert piece.transcript[1]["text"] == "50|51"


def _re_rendered() -> list[CallRecord]:
    """A harness that re-renders history: call 1's prompt holds call 0's completion re-tokenized
    differently (11 became 99), and call 2 summarises the transcript."""
    return [
        _call(0, [1, 2, 3], [10, 11]),
        _call(1, [1, 2, 3, 10, 99, 50], [12]),
        _call(2, [1, 7, 50], [13]),
    ]


def test_a_re_rendered_history_gives_one_sample_per_call_and_counts_the_breaks():
    """No call extends another: every call is its own sample, exactly as the engine consumed and
    sampled it, and the two later calls are counted as prefix breaks."""
    calls = _re_rendered()
    result = assemble(calls, _decode)
    assert result.prefix_breaks == 2
    assert [(p.prompt_ids, p.completion_ids, p.loss_mask) for p in result.pieces] == [
        (c.prompt_ids, c.completion_ids, [1] * len(c.completion_ids)) for c in calls]


def test_with_the_prefix_check_off_the_episode_is_spliced_into_tokens_never_sampled_together():
    """The negative control of the rule: without the prefix check the three calls are spliced into
    one sample whose token sequence is none of the sequences the engine saw (call 0's completion 11
    is followed by tokens of a prompt that had 99 there)."""
    calls = _re_rendered()
    (piece,) = assemble(calls, _decode, check_prefix=False).pieces
    engine_sequences = [c.prompt_ids + c.completion_ids for c in calls]
    assert piece.tokens not in engine_sequences
    assert not any(seq == piece.tokens[: len(seq)] for seq in engine_sequences[1:])


def test_sibling_choices_start_their_own_samples_without_counting_a_break():
    """An n = 2 call: each choice is its own sample (same prompt); a later call continuing choice 1
    extends that one. No prefix break is counted."""
    calls = [
        _call(0, [1, 2], [10]),
        _call(0, [1, 2], [20]),
        _call(1, [1, 2, 20, 5], [21]),
    ]
    result = assemble(calls, _decode)
    assert result.prefix_breaks == 0
    assert [p.completion_ids for p in result.pieces] == [[10], [20, 5, 21]]


def test_the_longest_extended_sample_is_continued():
    """A prompt that extends two samples continues the longer one (the whole history so far)."""
    calls = [
        _call(0, [1], [2]),
        _call(1, [1, 2, 3], [4]),
        _call(2, [1, 2, 3, 4, 5], [6]),
    ]
    (piece,) = assemble(calls, _decode).pieces
    assert piece.tokens == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("check_prefix", [True, False])
def test_no_calls_give_no_samples(check_prefix):
    result = assemble([], _decode, check_prefix=check_prefix)
    assert result.pieces == [] and result.prefix_breaks == 0
