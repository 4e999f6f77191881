"""The one single-turn path (`titanrl.rollout.single_turn.SingleTurn`) every worker variant uses."""

from titanrl.rollout.single_turn import SingleTurn, scored_summary
from titanrl.rollout.vllm.engine import Completion


def _completion(text: str, version: int, finish: str | None = "stop") -> Completion:
    return Completion(prompt_token_ids=[1, 2], token_ids=[3, 4], text=text, logprobs=[-0.1, -0.2],
                      finish_reason=finish, policy_version=version, token_versions=[version, version + 1])


def test_rows_and_completions_become_reward_inputs_and_samples_in_row_order():
    """Rewards see (prompt, completion, the row minus its prompt) in row order; each row's scored
    completions form one Group with consecutive group ids, and every Sample carries the
    completion's tokens, logprobs, versions, finish state and its own (reward, error)."""
    turn = SingleTurn(prompt_field="q", stop_token_ids=[7])
    rows = [{"q": "1+1=", "answer": "2"}, {"q": "2+2=", "answer": "4"}]
    outputs = [[_completion("2", 0), _completion("3", 0, "length")], [_completion("4", 1)]]
    inputs = turn.to_score(rows, outputs)
    assert [(i.prompt, i.completion, i.fields) for i in inputs] == [
        ("1+1=", "2", {"answer": "2"}), ("1+1=", "3", {"answer": "2"}), ("2+2=", "4", {"answer": "4"})]
    groups = turn.groups(rows, outputs, [(1.0, None), (0.0, None), (0.5, "reward r raised")], first_group_id=5)
    assert [[s.group_id for s in g.samples] for g in groups] == [[5, 5], [6]]
    first, second = groups[0].samples
    assert (first.prompt, first.completion, first.reward, first.finished) == ("1+1=", "2", 1.0, True)
    assert second.finished is False and second.fields == {"answer": "2"}
    (third,) = groups[1].samples
    assert (third.reward, third.reward_error, third.policy_version, third.token_versions) == \
        (0.5, "reward r raised", 1, [1, 2])
    assert (third.prompt_ids, third.completion_ids, third.gen_logprobs) == ([1, 2], [3, 4], [-0.1, -0.2])


def test_sampling_arguments_and_eval_summary():
    """Training sampling takes the rollout config's temperature/top_p/top_k/max_new_tokens and the stop
    tokens; greedy evaluation is temperature 0; an errored completion is never correct."""
    from titanrl.config import RolloutConfig, SamplingConfig

    turn = SingleTurn(prompt_field="prompt", stop_token_ids=None)
    rc = RolloutConfig(sampling=SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5))
    assert turn.sampling(rc) == dict(temperature=0.7, top_p=0.9, top_k=20, max_tokens=5, stop_token_ids=None)
    assert turn.greedy(3) == dict(temperature=0.0, max_tokens=3, stop_token_ids=None)
    out = scored_summary([(1.0, None), (1.0, "timed out"), (0.0, None)], 0.5, policy_version=4)
    assert out == {"rewards": [1.0, 1.0, 0.0], "correct": 1, "reward_errors": 1, "policy_version": 4}
