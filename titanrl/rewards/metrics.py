"""Per-reward metrics of a step: each reward function's mean value, errors and time.

From the `RewardTerms` every scored sample carries (`titanrl.types`), for each reward name:

- `reward/<name>/mean`: mean of its unweighted value over the samples where it returned one
  (absent in a step where it returned none);
- `reward/<name>/errors`: samples on which it failed (raised, timed out, returned a non-number);
- `reward/<name>/seconds`: wall time of its calls summed over the step's samples (calls of
  different samples overlap, so this is a cost, and can exceed `time/reward_s`).

Shaping terms that are not called (`overlong_penalty`) get only `reward/<name>/mean`.
"""

from __future__ import annotations

from titanrl.types import Group, RewardTerms

MEAN, ERRORS, SECONDS = "mean", "errors", "seconds"


def reward_metric(name: str, what: str) -> str:
    """`reward/<name>/<what>`."""
    return f"reward/{name}/{what}"


def reward_term_metrics(groups: list[Group]) -> dict[str, float]:
    """`reward/<name>/{mean,errors,seconds}` of every reward named in the step's samples."""
    terms = [s.reward_terms for g in groups for s in g.samples if s.reward_terms is not None]
    names = list(dict.fromkeys(name for t in terms for name in _names(t)))
    metrics: dict[str, float] = {}
    for name in names:
        values = [t.values[name] for t in terms if name in t.values]
        if values:
            metrics[reward_metric(name, MEAN)] = sum(values) / len(values)
        if any(name in t.seconds or t.failed == name for t in terms):  # a called reward, not a shaping term
            metrics[reward_metric(name, ERRORS)] = float(sum(t.failed == name for t in terms))
            metrics[reward_metric(name, SECONDS)] = sum(t.seconds.get(name, 0.0) for t in terms)
    return metrics


def _names(terms: RewardTerms) -> list[str]:
    return [*terms.values, *terms.seconds, *([terms.failed] if terms.failed is not None else [])]
