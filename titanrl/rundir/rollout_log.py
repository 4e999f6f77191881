"""Per-step summaries of rollout groups: reward and env metrics, and the rows of rollouts.jsonl."""

from __future__ import annotations

from typing import Any

from titanrl.types import Group


def summarize_groups(groups: list[Group]) -> dict[str, float]:
    rewards = [s.reward for g in groups for s in g.samples]
    lengths = [len(s.completion_ids) for g in groups for s in g.samples]
    n = len(rewards)
    mean = sum(rewards) / n
    solved = sum(any(r > 0 for r in g.rewards) for g in groups)
    env_stats: dict[str, float] = {}
    stats = [s.stats for g in groups for s in g.samples if s.stats]
    if stats:
        # Per-step totals for counters, a mean for turns: what a dashboard should show.
        env_stats = {
            "env/turns_mean": sum(st.get("turns", 0.0) for st in stats) / len(stats),
            "env/tool_calls": sum(st.get("tool_calls", 0.0) for st in stats),
            "env/errors": sum(st.get("errors", 0.0) for st in stats),
            "env/sandbox_s": sum(st.get("sandbox_s", 0.0) for st in stats),
        }
        total_tests = sum(st.get("tests_total", 0.0) for st in stats)
        if total_tests:
            env_stats["env/tests_pass_rate"] = sum(st.get("tests_passed", 0.0) for st in stats) / total_tests
    return {
        **env_stats,
        **_agent_metrics(stats),
        "reward/mean": mean,
        # Samples whose reward (or environment) failed and got scoring.error_value.
        "reward/errors": sum(s.reward_error is not None for g in groups for s in g.samples),
        "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "reward/group_any_positive_frac": solved / len(groups),
        "completion/len_mean": sum(lengths) / n,
        "completion/truncated_frac": sum(not s.finished for g in groups for s in g.samples) / n,
    }


def _agent_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """agent/* metrics over the step's agent episodes (each counted once: its first sample's stats)."""
    episodes = [st for st in stats if st.get("agent_episode") == 1.0]
    if not episodes:
        return {}
    calls = sum(st["agent_calls"] for st in episodes)
    n = len(episodes)
    return {
        "agent/calls_per_episode": calls / n,
        "agent/prefix_breaks": sum(st["agent_prefix_breaks"] for st in episodes),
        "agent/tokens_per_call": sum(st["agent_completion_tokens"] for st in episodes) / calls if calls else 0.0,
        "agent/versions_spanned_mean": sum(st["agent_versions_spanned"] for st in episodes) / n,
        "agent/samples_per_episode": sum(st["agent_samples"] for st in episodes) / n,
        "agent/resampled_calls": sum(st["agent_resampled_calls"] for st in episodes),
        "agent/episode_s_mean": sum(st["agent_seconds"] for st in episodes) / n,
    }


def rollout_rows(groups: list[Group], first_groups: int) -> list[dict[str, Any]]:
    """Samples of the first `first_groups` groups, plus every sample whose reward failed.

    Episodes also get `turns` (their completion turn by turn) and `stats` (turns, tool_calls,
    errors, ...); single-turn rows have neither key. `titanrl rollouts` prints these rows.
    """
    rows = []
    for index, group in enumerate(groups):
        for s in group.samples:
            if index >= first_groups and s.reward_error is None:
                continue
            row = {
                "group_id": s.group_id,
                "prompt": s.prompt,
                "completion": s.completion,
                "reward": s.reward,
                "policy_version": s.policy_version,
                "num_tokens": len(s.completion_ids),
            }
            if s.policy_version_max != s.policy_version:  # new weights arrived mid-sample
                row["policy_version_max"] = s.policy_version_max
            if s.turns is not None:
                row["turns"] = s.turns
            if s.stats:
                row["stats"] = s.stats
            if s.reward_error is not None:
                row["reward_error"] = s.reward_error
            rows.append(row)
    return rows
