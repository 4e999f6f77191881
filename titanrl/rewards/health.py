"""Reward health: is there a learning signal, do rewards that should agree agree, is a reward being gamed?

Cheap per-step metrics from the step's groups and each sample's `RewardTerms`:

- `reward/zero_variance_groups`: the fraction of groups whose samples' rewards are all equal
  (`rewards_all_equal`): GRPO's advantage is zero for all of them, so they teach nothing.
- `reward/agreement/<a>_vs_<b>` for each configured pair 'a:b' (`scoring.health.agreement_pairs`):
  the fraction of samples scored by both rewards where both are > 0 or both are <= 0 (sign
  agreement: scale-free, and meaningful for 0/1 rewards, where a correlation is undefined
  whenever one of them is constant in a step). Absent in a step without such samples.

And one check across evaluations (`RewardHackingWatch`), a sign of reward hacking: a reward's
mean rises while held-out accuracy does not. At evaluation k (the run's evaluations in order,
the step-0 one included), R_k(name) is the mean of `reward/<name>/mean` over the training steps
since evaluation k-1, and A_k is `eval/accuracy`. With w = `scoring.health.hacking_window`, the
flag `reward/<name>/hacking_suspected` (logged at every evaluation from the (w+1)-th on, for every
reward with both R_k and R_{k-w}) is 1 when

    R_k - R_{k-w} >= hacking_reward_rise   and   A_k - A_{k-w} < hacking_accuracy_rise

and a warning names the reward and the numbers when a reward's flag turns on (not again while it
stays on). The watch's history is not checkpointed: after a resume it starts again.
"""

from __future__ import annotations

import logging

from titanrl.types import Group

log = logging.getLogger("titanrl")

EQUAL_TOLERANCE = 1e-6
"""Rewards of a group within this of each other (relative to max(1, |reward|)) count as equal."""

ZERO_VARIANCE_GROUPS = "reward/zero_variance_groups"


def rewards_all_equal(rewards: list[float]) -> bool:
    """Whether a group's rewards are all equal up to `EQUAL_TOLERANCE` (its GRPO advantages are all 0)."""
    hi, lo = max(rewards), min(rewards)
    return hi - lo <= EQUAL_TOLERANCE * max(1.0, abs(hi), abs(lo))


def zero_variance_fraction(groups: list[Group]) -> float:
    """The fraction of `groups` whose rewards are all equal."""
    return sum(rewards_all_equal(g.rewards) for g in groups) / len(groups)


def agreement_metric(pair: str) -> str:
    a, b = pair.split(":")
    return f"reward/agreement/{a}_vs_{b}"


def agreement(groups: list[Group], pairs: list[str]) -> dict[str, float]:
    """`reward/agreement/<a>_vs_<b>` of each pair 'a:b' (see the module docstring)."""
    metrics: dict[str, float] = {}
    terms = [s.reward_terms for g in groups for s in g.samples if s.reward_terms is not None]
    for pair in pairs:
        a, b = pair.split(":")
        both = [(t.values[a], t.values[b]) for t in terms if a in t.values and b in t.values]
        if both:
            metrics[agreement_metric(pair)] = sum((x > 0) == (y > 0) for x, y in both) / len(both)
    return metrics


def reward_health(groups: list[Group], pairs: list[str]) -> dict[str, float]:
    """The per-step reward-health metrics of the step's groups."""
    return {ZERO_VARIANCE_GROUPS: zero_variance_fraction(groups), **agreement(groups, pairs)}


class RewardHackingWatch:
    """The reward-hacking check across evaluations (see the module docstring)."""

    def __init__(self, window: int, reward_rise: float, accuracy_rise: float) -> None:
        self.window, self.reward_rise, self.accuracy_rise = window, reward_rise, accuracy_rise
        self._since_eval: dict[str, list[float]] = {}
        """reward name -> its reward/<name>/mean of each training step since the last evaluation."""
        self._evals: list[tuple[dict[str, float], float]] = []
        """(R_k by reward name, A_k) of every evaluation so far."""
        self._flagged: set[str] = set()

    def step(self, reward_means: dict[str, float]) -> None:
        """One training step's reward name -> reward/<name>/mean."""
        for name, mean in reward_means.items():
            self._since_eval.setdefault(name, []).append(mean)

    def evaluation(self, accuracy: float) -> dict[str, float]:
        """Records evaluation k's accuracy; returns `reward/<name>/hacking_suspected` for each reward
        it can judge (none before the (window+1)-th evaluation, or when the check is off)."""
        means = {name: sum(v) / len(v) for name, v in self._since_eval.items() if v}
        self._since_eval = {}
        self._evals.append((means, accuracy))
        k = len(self._evals) - 1
        if self.reward_rise <= 0 or k - self.window < 0:
            return {}
        before, accuracy_before = self._evals[k - self.window]
        flags: dict[str, float] = {}
        for name, mean in means.items():
            if name not in before:
                continue
            rise, gain = mean - before[name], accuracy - accuracy_before
            suspect = rise >= self.reward_rise and gain < self.accuracy_rise
            flags[f"reward/{name}/hacking_suspected"] = float(suspect)
            if suspect and name not in self._flagged:
                log.warning(f"reward {name!r} rose by {rise:.3f} (to {mean:.3f}) over the last {self.window} "
                            f"evaluation(s) while eval/accuracy changed by {gain:+.3f} (to {accuracy:.3f}): "
                            "a sign of reward hacking; read the rollouts (`titanrl rollouts`)")
            (self._flagged.add if suspect else self._flagged.discard)(name)
        return flags
