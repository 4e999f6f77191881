"""HumanEval rows (`titanrl.data_sources.human_eval`) scored through the bubblewrap sandbox.

A completion that passes the problem's tests scores 1; one that fails, hangs, or tries to escape
(write outside the sandbox, or exit before the tests can fail) scores 0. Every canonical solution
in the package passes under our harness and a stub fails, so the rows are assembled right.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from titanrl.data_sources.human_eval import HUMAN_EVAL_SIZE, human_eval_problems, human_eval_rows, problem_row
from titanrl.envs import CodeTestsEnv, EnvContext, SandboxPool
from titanrl.envs.code_exec import answer_program
from titanrl.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "code_exec"


@pytest.fixture(scope="module")
def sandbox():
    """(event loop, started SandboxPool) shared by this module's tests."""
    loop = asyncio.new_event_loop()
    pool = SandboxPool(size=2)
    loop.run_until_complete(pool.start())
    yield loop, pool
    loop.run_until_complete(pool.close())
    loop.close()


@pytest.fixture(scope="module")
def problems() -> dict[str, dict[str, Any]]:
    return {p["task_id"]: p for p in human_eval_problems()}


def score(loop: Any, pool: Any, row: dict[str, Any], answer: str, timeout_s: float = 3.0) -> tuple[float, dict]:
    env = CodeTestsEnv(pool, test_timeout_s=timeout_s, use_tool=False)
    loop.run_until_complete(env.reset(row))
    result = loop.run_until_complete(env.step(answer))
    assert result.done
    return result.reward, result.info


def test_rows_split_is_seeded_disjoint_and_complete():
    """164 problems; the same seed gives the same split, another seed another; no problem is in both."""
    train, held = human_eval_rows(held_out=40, seed=0)
    again_train, again_held = human_eval_rows(held_out=40, seed=0)
    other_train, _ = human_eval_rows(held_out=40, seed=1)
    assert (len(train), len(held)) == (124, 40)
    assert train == again_train and held == again_held
    assert [r["task_id"] for r in other_train] != [r["task_id"] for r in train]
    ids = {r["task_id"] for r in train} | {r["task_id"] for r in held}
    assert len(ids) == HUMAN_EVAL_SIZE and not {r["task_id"] for r in train} & {r["task_id"] for r in held}
    every_train, every_held = human_eval_rows(held_out=HUMAN_EVAL_SIZE)
    assert every_train == [] and len(every_held) == HUMAN_EVAL_SIZE
    row = held[0]
    assert row["code_prefix"].strip() in row["prompt"] and f"check({row['entry_point']})" in row["tests"][0]


@pytest.mark.parametrize("bad", [-1, 165, "40", True])
def test_bad_split_is_refused_naming_the_argument(bad):
    with pytest.raises(ConfigError, match="held_out"):
        human_eval_rows(held_out=bad)


def test_answer_program_joins_prefix_and_answer():
    """A full function follows the stub; a bare body completes it; rows without a prefix are unchanged."""
    row = {"code_prefix": "import math\n\ndef f(x):\n    \"\"\"doc\"\"\"\n", "entry_point": "f"}
    full = answer_program(row, "```python\ndef f(x):\n    return math.sqrt(x)\n```")
    assert full.startswith("import math") and full.rstrip().endswith("return math.sqrt(x)")
    body = answer_program(row, "    return x + 1\n")
    assert body == row["code_prefix"] + "    return x + 1\n"
    assert answer_program({}, "```python\nA = 1\n```") == "A = 1\n"


def test_pass_fail_hang_escape_score_1_0_0_0(sandbox, problems, tmp_path):
    """HumanEval/0 (has_close_elements) through CodeTestsEnv and the real sandbox."""
    loop, pool = sandbox
    row = problem_row(problems["HumanEval/0"])
    solution = problems["HumanEval/0"]["canonical_solution"]
    marker = tmp_path / "escaped"
    cases = {
        "pass": (f"```python\n{row['code_prefix']}{solution}```", 1.0),
        "pass_body_only": (solution, 1.0),
        "fail": ("```python\ndef has_close_elements(numbers, threshold):\n    return False\n```", 0.0),
        "hang": ("```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```", 0.0),
        # Writes a file on the host's path and exits "successfully" before check() can fail.
        "escape": (f"```python\nimport os\ndef has_close_elements(numbers, threshold):\n"
                   f"    open({str(marker)!r}, 'w').write('out')\n    os._exit(0)\n```", 0.0),
    }
    for name, (answer, expected) in cases.items():
        reward, info = score(loop, pool, row, answer, timeout_s=1.0 if name == "hang" else 3.0)
        assert reward == expected, (name, info)
        assert info["tests_total"] == 1 and info["tests_passed"] == int(expected)
    assert not marker.exists()  # the sandbox's filesystem is not the host's


def test_every_canonical_solution_passes_and_a_stub_fails(sandbox, problems):
    """All 164 problems assembled as rows: the package's canonical solution passes its check() in our
    harness, and a function returning None does not (so the tests really run)."""
    from titanrl.rewards.code_tests import fraction_of_tests_passed

    loop, pool = sandbox
    rows = [problem_row(p) for p in problems.values()]

    async def check(row: dict[str, Any]) -> tuple[float, float]:
        good_code = answer_program(row, problems[row["task_id"]]["canonical_solution"])
        stub_code = answer_program(row, f"```python\ndef {row['entry_point']}(*args, **kwargs):\n    return None\n```")
        good, _ = await fraction_of_tests_passed(pool, good_code, row["tests"], 10.0)
        stub, _ = await fraction_of_tests_passed(pool, stub_code, row["tests"], 10.0)
        return good, stub

    async def check_all() -> list[tuple[float, float]]:
        return await asyncio.gather(*(check(r) for r in rows))

    scores = loop.run_until_complete(check_all())
    assert [r["task_id"] for r, (good, _) in zip(rows, scores) if good != 1.0] == []
    assert [r["task_id"] for r, (_, stub) in zip(rows, scores) if stub != 0.0] == []


def test_example_humaneval_config_builds(monkeypatch, tmp_path):
    """examples/code_exec/humaneval.py: every problem held out by default (for `titanrl eval`), a
    training split on request, single-turn CodeTestsEnv without the tool."""
    from titanrl.models.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("HUMANEVAL_CHECKPOINT", str(tmp_path / "ckpt"))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    sys.modules.pop("env", None)
    spec = importlib.util.spec_from_file_location("humaneval_config", EXAMPLE / "humaneval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.make_config()
    assert config.data.train_rows is None and len(config.data.eval_rows) == HUMAN_EVAL_SIZE
    monkeypatch.setenv("HUMANEVAL_HELD_OUT", "40")
    config = module.make_config()
    assert len(config.data.train_rows) == 124 and len(config.data.eval_rows) == 40
    env = config.env.factory(EnvContext(sandbox_pool=object(), worker_id=0))
    assert isinstance(env, CodeTestsEnv) and not env.registry.tools and config.env.max_turns == 1
    sys.modules.pop("env", None)
