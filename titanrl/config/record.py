"""A RunConfig as JSON: what `config.json` and `config.resolved.json` in a run directory hold."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from titanrl.config.schema import RunConfig


def config_record(config: RunConfig) -> dict[str, Any]:
    """The config as JSON: callables by their 'module:qualname', rows in memory by their count."""

    def name(fn: Any) -> str:
        return fn if isinstance(fn, str) else f"{fn.__module__}:{getattr(fn, '__qualname__', type(fn).__name__)}"

    env = dataclasses.replace(config.env, factory=None)
    agent = dataclasses.replace(config.agent, fn=None)
    data = dataclasses.replace(config.data, train_rows=None, eval_rows=None)
    record = dataclasses.asdict(dataclasses.replace(config, rewards=[], env=env, agent=agent, data=data))
    for split in ("train_rows", "eval_rows"):  # rows in memory: their count, not their contents
        rows = getattr(config.data, split)
        record["data"][split] = None if rows is None else f"{len(rows)} rows in memory"
    record["rewards"] = [name(r) for r in config.rewards]
    record["env"]["factory"] = None if config.env.factory is None else name(config.env.factory)
    record["agent"]["fn"] = None if config.agent.fn is None else name(config.agent.fn)
    return json.loads(json.dumps(record))  # tuples become lists, as they are when read back
