"""`titanrl rollouts RUN_DIR`: episodes printed turn by turn, and the turns that make it possible.

Unit tests format hand-written rollouts.jsonl rows (with and without `turns`, failed ones) and
check the selection and its errors; CLI tests go through `titanrl.cli.main`. The last tests run
real episodes on the session's vLLM engine: `Episode.transcript` alternates model and env turns
and joins to the completion text, and an EnvRunner batch written by the run's own logger prints.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from titanrl.cli import main
from titanrl.commands import CommandError
from titanrl.commands.rollouts import format_episode, read_rollouts, rollouts_command, select_episodes
from titanrl.envs.base import Environment, StepResult
from titanrl.rundir.rollout_log import rollout_rows
from titanrl.types import Group, Sample

SYSTEM = "<|im_start|>system\nYou can call tools. " + "x" * 200 + "<|im_end|>\n"
USER = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
RESPONSE = "<|im_end|>\n<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def _episode_row(step: int = 1, group_id: int = 0, reward: float = 1.0, **extra) -> dict:
    turns = [{"role": "model", "text": "Let me add.\n" + CALL}, {"role": "env", "text": RESPONSE},
             {"role": "model", "text": "The answer is 5."}]
    row = {"step": step, "group_id": group_id, "prompt": SYSTEM + USER, "completion": "".join(t["text"] for t in turns),
           "reward": reward, "policy_version": step - 1, "num_tokens": 57, "turns": turns,
           "stats": {"turns": 2.0, "tool_calls": 1.0, "errors": 0.0, "env_s": 0.01}}
    row.update(extra)
    return row


def _plain_row(step: int = 1, group_id: int = 0, reward: float = 0.0, **extra) -> dict:
    row = {"step": step, "group_id": group_id, "prompt": "2+3=", "completion": "5", "reward": reward,
           "policy_version": step - 1, "num_tokens": 2}
    row.update(extra)
    return row


def _write_run(run: Path, rows: list[dict]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


# ----------------------------------------------------------------------------- formatting
def test_format_episode_with_turns_is_the_exact_transcript():
    """An episode row prints as header, the prompt from its last user turn (the system part hidden
    and counted), each turn labelled in order ([model] with its tool-call count, [tool] for the
    observation holding the tool response), then the reward; no ANSI codes without colour."""
    text = format_episode(_episode_row(step=3), 2)
    expected = "\n".join([
        "======== episode 2 | step 3 | group 0 | reward 1 | policy v2 | 57 tokens | 2 turns | 1 tool call | 0 errors",
        f"[prompt] ({len(SYSTEM)} chars before the last user turn hidden; --full-prompt shows them)",
        "    <|im_start|>user",
        "    What is 2+3?<|im_end|>",
        "    <|im_start|>assistant",
        "[model] (1 tool call)",
        "    Let me add.",
        "    " + CALL,
        "[tool]",
        "    <|im_end|>",
        "    <|im_start|>tool",
        "    <tool_response>",
        "    5",
        "    </tool_response><|im_end|>",
        "    <|im_start|>assistant",
        "[model]",
        "    The answer is 5.",
        "[reward] 1",
    ])
    assert text == expected
    assert "\x1b[" not in text


def test_format_episode_full_prompt_and_long_prompt_tail():
    """--full-prompt shows the system part; a long prompt with no chat user turn shows only its tail
    and says how many characters were hidden."""
    assert "You can call tools." in format_episode(_episode_row(), full_prompt=True)
    assert "You can call tools." not in format_episode(_episode_row())
    long = _plain_row(prompt="a" * 1000 + "THE END")
    text = format_episode(long)
    assert "(first 407 chars hidden; --full-prompt shows them)" in text
    assert "    ..." + "a" * 593 + "THE END" in text


def test_format_episode_without_turns_prints_completion_as_one_model_turn():
    """Old and single-turn rows (no "turns" key) print the completion as one [model] turn; the header
    has no env counters."""
    text = format_episode(_plain_row(reward=0.25), 1)
    assert text == "\n".join([
        "======== episode 1 | step 1 | group 0 | reward 0.25 | policy v0 | 2 tokens",
        "[prompt]",
        "    2+3=",
        "[model]",
        "    5",
        "[reward] 0.25",
    ])


def test_format_failed_episodes_show_the_error():
    """A failed episode shows its reward_error after the reward; one whose environment never started
    (empty turns) says so; an env error note inside the turns is an [env] turn."""
    never = _episode_row(reward=0.0, turns=[], completion="", num_tokens=0,
                         stats={"turns": 0.0, "tool_calls": 0.0, "errors": 1.0},
                         reward_error="environment reset raised RuntimeError: no sandbox")
    text = format_episode(never)
    assert "| 0 turns | 0 tool calls | 1 error" in text.splitlines()[0]
    assert "(no turns: the environment failed before the model's first turn)" in text
    assert text.endswith("[reward] 0\n[error] environment reset raised RuntimeError: no sandbox")
    note = "\n[environment step raised ConnectionError: gone]"
    broken = _episode_row(reward=0.0, turns=[{"role": "model", "text": CALL}, {"role": "env", "text": note}],
                          reward_error="environment step raised ConnectionError: gone")
    lines = format_episode(broken).splitlines()
    assert lines[-4:] == ["[env]", "    [environment step raised ConnectionError: gone]", "[reward] 0",
                          "[error] environment step raised ConnectionError: gone"]


def test_colour_only_when_asked():
    """color=True wraps labels and each tool-call span in ANSI codes (the text in between intact);
    color=False (pipes, files) has none."""
    coloured = format_episode(_episode_row(), color=True)
    assert "\x1b[33m" + CALL + "\x1b[0m" in coloured
    assert "\x1b[32m[model]\x1b[0m" in coloured and "\x1b[36m[tool]\x1b[0m" in coloured
    assert "\x1b[" not in format_episode(_episode_row(), color=False)


# ----------------------------------------------------------------------------- selection
def test_select_defaults_to_last_step_and_filters():
    """Without --step the last step is shown; --episodes caps the count (file order kept); --group and
    --failed filter, and without --step pick the last step that has a match."""
    rows = [_plain_row(1, g) for g in range(3)] + [_plain_row(2, g) for g in (3, 4)]
    rows.insert(1, _plain_row(1, 9, reward_error="reward raised"))
    sel = select_episodes(rows, episodes=1)
    assert (sel.step, sel.rows, sel.matched, sel.logged, sel.steps) == (2, [rows[4]], 2, 2, [1, 2])
    assert select_episodes(rows, step=1, episodes=10).rows == rows[:4]
    assert select_episodes(rows, failed=True).rows == [rows[1]]
    assert select_episodes(rows, group=2).rows == [rows[3]]
    assert select_episodes(rows, step=1, group=9, failed=True).step == 1


def test_selection_errors_say_what_exists():
    """A missing step names the file's step count, first and last; a filter with no match at the
    step lists its groups or the steps with failures; --episodes 0 is refused."""
    rows = [_plain_row(s, s) for s in (1, 2, 5)] + [_plain_row(2, 7, reward_error="x")]
    with pytest.raises(CommandError, match=r"step 4 is not in rollouts.jsonl: it has 3 steps, first 1, last 5"):
        select_episodes(rows, step=4)
    with pytest.raises(CommandError, match=r"step 5 has no episode matching --group 2 \(its groups: 5\)"):
        select_episodes(rows, step=5, group=2)
    with pytest.raises(CommandError, match=r"step 1 has no episode matching --failed .*failed episodes: 2"):
        select_episodes(rows, step=1, failed=True)
    with pytest.raises(CommandError, match=r"no episode in rollouts.jsonl matches --group 3 \(3 steps"):
        select_episodes(rows, group=3)
    with pytest.raises(CommandError, match="--episodes must be at least 1"):
        select_episodes(rows, episodes=0)


def test_read_rollouts_errors(tmp_path):
    """Missing run dir, missing or empty rollouts.jsonl, a non-JSON line and a row without an integer
    step are CommandErrors that name the path (and line)."""
    with pytest.raises(CommandError, match="run directory .* does not exist"):
        read_rollouts(tmp_path / "nope")
    with pytest.raises(CommandError, match="has no rollouts.jsonl"):
        read_rollouts(tmp_path)
    (tmp_path / "rollouts.jsonl").write_text("\n")
    with pytest.raises(CommandError, match="is empty"):
        read_rollouts(tmp_path)
    (tmp_path / "rollouts.jsonl").write_text(json.dumps(_plain_row()) + "\n{oops\n")
    with pytest.raises(CommandError, match=r"rollouts.jsonl:2 is not valid JSON"):
        read_rollouts(tmp_path)
    (tmp_path / "rollouts.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(CommandError, match="line 1 is not a rollout row"):
        read_rollouts(tmp_path)


def test_rollout_rows_carry_turns_and_stats_only_for_episodes():
    """rollout_rows writes `turns` and `stats` for an episode sample; a single-turn sample's row has
    neither key (unchanged from before)."""
    turns = [{"role": "model", "text": "a"}, {"role": "env", "text": "b"}]
    episode = Sample(prompt="p", completion="ab", prompt_ids=[1], completion_ids=[2, 3], gen_logprobs=[0.0, 0.0],
                     reward=1.0, group_id=0, policy_version=0, loss_mask=[1, 0],
                     stats={"turns": 1.0, "tool_calls": 1.0}, turns=turns)
    single = Sample(prompt="p", completion="a", prompt_ids=[1], completion_ids=[2], gen_logprobs=[0.0],
                    reward=0.0, group_id=1, policy_version=0)
    rows = rollout_rows([Group([episode]), Group([single])], first_groups=2)
    assert rows[0]["turns"] == turns and rows[0]["stats"] == {"turns": 1.0, "tool_calls": 1.0}
    assert rows[1] == {"group_id": 1, "prompt": "p", "completion": "a", "reward": 0.0, "policy_version": 0,
                       "num_tokens": 1}


# ----------------------------------------------------------------------------- CLI
def test_cli_prints_transcripts_and_json(tmp_path, capsys):
    """`titanrl rollouts RUN --step 1 --episodes 1` prints a summary line and one transcript (exit 0);
    --json prints the selected rows exactly as stored; the default step is the last."""
    rows = [_episode_row(1, 0), _plain_row(1, 1), _episode_row(2, 2, reward=0.5)]
    run = _write_run(tmp_path / "run", rows)
    assert main(["rollouts", str(run), "--step", "1", "--episodes", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run / 'rollouts.jsonl'}: step 1, 1 of 2 episodes (2 logged at this step; "
                          "the file has 2 steps, first 1, last 2)\n\n======== episode 1 | step 1 | group 0")
    assert out.count("======== episode") == 1 and "[tool]" in out and "\x1b[" not in out
    assert main(["rollouts", str(run), "--json"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [rows[2]]
    assert main(["rollouts", str(run), "--failed"]) == 2
    assert "titanrl rollouts: no episode in rollouts.jsonl matches --failed" in capsys.readouterr().err


def test_cli_errors_exit_2(tmp_path, capsys):
    """A missing run dir, a dir without rollouts.jsonl and an absent step exit with status 2 and a
    one-line reason on stderr; --help lists the options and exits 0."""
    assert main(["rollouts", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["rollouts", str(tmp_path)]) == 2
    assert "has no rollouts.jsonl" in capsys.readouterr().err
    run = _write_run(tmp_path / "run", [_plain_row(s) for s in (3, 4)])
    assert main(["rollouts", str(run), "--step", "9"]) == 2
    assert capsys.readouterr().err == (
        "titanrl rollouts: step 9 is not in rollouts.jsonl: it has 2 steps, first 3, last 4\n")
    assert main(["rollouts", "--help"]) == 0
    help_text = capsys.readouterr().out
    flags = ("--step N", "--episodes K", "--group G", "--failed", "--full-prompt", "--json")
    assert all(flag in help_text for flag in flags)
    assert main(["--help"]) == 0
    assert "rollouts" in capsys.readouterr().out


# ----------------------------------------------------------------------------- real episodes
TOOL_RESPONSE = "<|im_end|>\n<|im_start|>tool\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class ToolLikeEnv(Environment):
    """Answers each model turn with a fixed tool response; done after `turns` turns (reward 1), or
    raises on turn `fail_at` (a tool server going away)."""

    def __init__(self, turns: int = 3, fail_at: int | None = None) -> None:
        self.turns, self.fail_at, self.seen = turns, fail_at, 0

    async def reset(self, row):
        return row["prompt"]

    async def step(self, action):
        self.seen += 1
        if self.seen == self.fail_at:
            raise ConnectionError("tool server gone")
        if self.seen >= self.turns:
            return StepResult(observation="", reward=1.0, done=True, info={})  # the answer, no call
        return StepResult(observation=TOOL_RESPONSE, reward=0.0, done=False, info={"tool_calls": 1})


def test_run_episode_transcript_alternates_and_joins_to_completion(vllm_engine):
    """On the real engine, Episode.transcript alternates model/env turns starting with the model, its
    model texts are the generated turns (3 of them), its env texts the inserted observations, and the
    texts joined equal completion_text; a failing step ends with the error note as the last env entry."""
    from titanrl.rollout.episode import EpisodeBudget, run_episode
    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    budget = EpisodeBudget(max_turns=8, max_total_tokens=200, max_tokens_per_turn=6, max_model_len=256)

    async def run():
        tokenizer = vllm_engine.llm.get_tokenizer()
        async with AsyncGenerator(vllm_engine) as gen:
            return await asyncio.gather(*(
                run_episode(env, {"prompt": f"q{i}:"}, gen, tokenizer, budget, 1.0, 1.0, seed=7 + 10 * i,
                            stop_token_ids=None)
                for i, env in enumerate([ToolLikeEnv(turns=3), ToolLikeEnv(fail_at=2)])
            ))

    ok, broken = asyncio.run(run())
    assert [t["role"] for t in ok.transcript] == ["model", "env", "model", "env", "model"]
    assert ok.turns == 3 and ok.finished
    assert [t["text"] for t in ok.transcript if t["role"] == "env"] == [TOOL_RESPONSE, TOOL_RESPONSE]
    assert "".join(t["text"] for t in ok.transcript) == ok.completion_text
    assert all(t["text"] for t in ok.transcript if t["role"] == "model")
    assert [t["role"] for t in broken.transcript] == ["model", "env", "model", "env"]
    assert broken.transcript[-1]["text"] == "\n[environment step raised ConnectionError: tool server gone]"
    assert broken.transcript[1]["text"] == TOOL_RESPONSE
    assert "".join(t["text"] for t in broken.transcript) == broken.completion_text


def test_env_runner_rows_print_turn_by_turn(vllm_engine, tmp_path, capsys):
    """An EnvRunner batch becomes Samples with turns, rollout_rows and the run's MetricsLogger write
    them with stats, and `titanrl rollouts` prints each episode's turns in order: model, tool, model,
    tool, model, with 2 tool calls in the header and the reward of 1."""
    from titanrl.config import EngineConfig, EnvConfig, RolloutConfig, RunConfig, SamplingConfig
    from titanrl.rollout.env_runner import EnvRunner
    from titanrl.rundir.metrics import MetricsLogger

    rc = RolloutConfig(group_size=2, sampling=SamplingConfig(max_new_tokens=4, temperature=1.0),
                       engine=EngineConfig(max_model_len=256))
    config = RunConfig(rollout=rc, env=EnvConfig(max_turns=3, max_total_tokens=128, sandbox_pool_size=0))
    runner = EnvRunner(vllm_engine, lambda context: ToolLikeEnv(turns=3), config, [], 0)
    try:
        batch = runner.generate([{"prompt": "go:"}], seed=11, first_group_id=5)
    finally:
        runner.close()
    samples = batch.groups[0].samples
    assert all(s.turns is not None and "".join(t["text"] for t in s.turns) == s.completion for s in samples)
    logger = MetricsLogger(tmp_path / "run", tensorboard=False)
    logger.log_rollouts(4, rollout_rows(batch.groups, first_groups=1))
    logger.close()
    out = rollouts_command(tmp_path / "run")
    assert out.count("======== episode") == 2
    labels = [line for line in out.splitlines() if line in ("[model]", "[tool]", "[env]")]
    assert labels == ["[model]", "[tool]", "[model]", "[tool]", "[model]"] * 2
    assert "| step 4 | group 5 | reward 1 | policy v0 |" in out and "| 3 turns | 2 tool calls | 0 errors" in out
