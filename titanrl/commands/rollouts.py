"""`titanrl rollouts RUN_DIR [--step N]`: a few episodes of a step, turn by turn.

Reads `rollouts.jsonl` (rows from `titanrl.rundir.rollout_log.rollout_rows`) and prints each selected
episode as a transcript: a header (step, group, reward, policy version, tool calls, errors),
the prompt (its last user turn unless `full_prompt`), then every turn labelled `[model]`,
`[tool]` (an observation holding a `<tool_response>`) or `[env]`. Rows written before turns were
recorded, and single-turn rows, have no `turns`: their completion prints as one model turn.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrl.commands import CommandError
from titanrl.jsonl import read_json_lines

ROLLOUTS_FILE = "rollouts.jsonl"
DEFAULT_EPISODES = 4
PROMPT_TAIL_CHARS = 600
"""Prompt characters shown when the prompt has no chat user turn to start from."""
_USER_TURN = "<|im_start|>user"
_TOOL_CALL_RE = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_INDENT = "    "

# ANSI styles, used only when the caller asks for colour (stdout is a terminal).
_STYLES = {"header": "1", "model": "32", "tool": "36", "env": "36", "call": "33", "error": "31", "dim": "2"}


@dataclass
class Selection:
    """The rows `titanrl rollouts` prints, and where they sit in the file."""

    step: int
    """The step shown."""
    rows: list[dict[str, Any]]
    """The episodes to print, in file order (at most the number asked for)."""
    matched: int
    """Episodes of `step` that pass the filters (group, failed)."""
    logged: int
    """Episodes of `step` in the file."""
    steps: list[int]
    """Every step in the file, ascending."""


def read_rollouts(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/rollouts.jsonl; every row must be a JSON object with an integer `step`."""
    run = Path(run_dir)
    if not run.is_dir():
        raise CommandError(f"run directory {str(run)!r} does not exist")
    path = run / ROLLOUTS_FILE
    if not path.is_file():
        raise CommandError(f"{str(run)!r} has no {ROLLOUTS_FILE}: is it a run directory (output.dir of a run)?")
    rows = []
    for line in read_json_lines(path, error=CommandError).lines:
        if not isinstance(line.value, dict) or not isinstance(line.value.get("step"), int):
            raise CommandError(f"{str(path)!r} line {line.number} is not a rollout row (a JSON object with an integer step)")
        rows.append(line.value)
    if not rows:
        raise CommandError(f"{str(path)!r} is empty: the run has not logged a step yet")
    return rows


def _steps_text(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"only step {steps[0]}"
    return f"{len(steps)} steps, first {steps[0]}, last {steps[-1]}"


def _filters_text(group: int | None, failed: bool) -> str:
    parts = ([f"--group {group}"] if group is not None else []) + (["--failed"] if failed else [])
    return " ".join(parts)


def select_episodes(rows: list[dict[str, Any]], step: int | None = None, episodes: int = DEFAULT_EPISODES,
                    group: int | None = None, failed: bool = False) -> Selection:
    """The first `episodes` rows of `step` (default: the last step with a matching row).

    `group` keeps one prompt group; `failed` keeps rows whose reward or environment failed
    (`reward_error`). A step or filter with nothing to show is a CommandError saying what exists.
    """
    if episodes < 1:
        raise CommandError(f"--episodes must be at least 1, got {episodes}")
    steps = sorted({r["step"] for r in rows})
    if step is not None and step not in steps:
        raise CommandError(f"step {step} is not in {ROLLOUTS_FILE}: it has {_steps_text(steps)}")

    def keep(row: dict[str, Any]) -> bool:
        return (group is None or row.get("group_id") == group) and (not failed or "reward_error" in row)

    matching = [r for r in rows if keep(r)]
    if step is None:
        if not matching:
            raise CommandError(f"no episode in {ROLLOUTS_FILE} matches {_filters_text(group, failed)} "
                               f"({_steps_text(steps)})")
        step = max(r["step"] for r in matching)
    at_step = [r for r in rows if r["step"] == step]
    chosen = [r for r in at_step if keep(r)]
    if not chosen:
        hints = []
        if group is not None:
            groups = sorted({r.get("group_id") for r in at_step if isinstance(r.get("group_id"), int)})
            hints.append(f"its groups: {', '.join(map(str, groups)) or 'none'}")
        if failed:
            failed_steps = sorted({r["step"] for r in rows if "reward_error" in r})
            hints.append("steps with failed episodes: "
                         + (", ".join(map(str, failed_steps[-10:])) if failed_steps else "none"))
        raise CommandError(f"step {step} has no episode matching {_filters_text(group, failed)} ({'; '.join(hints)})")
    return Selection(step=step, rows=chosen[:episodes], matched=len(chosen), logged=len(at_step), steps=steps)


def _style(text: str, style: str, color: bool) -> str:
    return f"\x1b[{_STYLES[style]}m{text}\x1b[0m" if color else text


def _indented(text: str) -> str:
    """`text` indented as a block, without its leading and trailing newlines; an empty text says so."""
    text = text.strip("\n")
    if not text.strip():
        return _INDENT + "(empty)"
    return "\n".join(_INDENT + line if line.strip() else "" for line in text.split("\n"))


def _prompt_view(prompt: str, full: bool) -> tuple[str, str]:
    """The part of the prompt to show, and a note on what was left out."""
    if full:
        return prompt, ""
    start = prompt.rfind(_USER_TURN)
    if start > 0:
        return prompt[start:], f" ({start} chars before the last user turn hidden; --full-prompt shows them)"
    if start < 0 and len(prompt) > PROMPT_TAIL_CHARS:
        hidden = len(prompt) - PROMPT_TAIL_CHARS
        return "..." + prompt[hidden:], f" (first {hidden} chars hidden; --full-prompt shows them)"
    return prompt, ""


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _count(value: Any, noun: str) -> str:
    return f"{_number(value)} {noun}" + ("" if value == 1 else "s")


def episode_header(row: dict[str, Any], index: int) -> str:
    """One line: episode index, step, group, reward, policy version, tokens, and env counters if any."""
    parts = [f"episode {index}", f"step {row.get('step')}", f"group {row.get('group_id')}",
             f"reward {_number(row.get('reward'))}", f"policy v{row.get('policy_version')}",
             f"{row.get('num_tokens')} tokens"]
    stats = row.get("stats") or {}
    for key, label in (("turns", "turn"), ("tool_calls", "tool call"), ("errors", "error")):
        if key in stats:
            parts.append(_count(stats[key], label))
    return " | ".join(parts)


def _turn_label(turn: dict[str, str]) -> str:
    if turn.get("role") == "model":
        return "model"
    return "tool" if "<tool_response>" in turn.get("text", "") else "env"


def _highlight_calls(text: str, color: bool) -> str:
    """Model text with each `<tool_call>...</tool_call>` span in the call style (line by line)."""
    if not color:
        return text

    def paint(match: re.Match[str]) -> str:
        return "\n".join(_style(line, "call", True) if line else "" for line in match.group(0).split("\n"))

    return _TOOL_CALL_RE.sub(paint, text)


def format_episode(row: dict[str, Any], index: int = 1, *, full_prompt: bool = False, color: bool = False) -> str:
    """A readable transcript of one rollouts.jsonl row: header, prompt, each turn, reward and error."""
    lines = [_style("=" * 8 + " " + episode_header(row, index), "header", color)]
    prompt, note = _prompt_view(str(row.get("prompt", "")), full_prompt)
    lines += [_style("[prompt]", "dim", color) + _style(note, "dim", color), _indented(prompt)]
    turns = row.get("turns")
    if turns is None:  # single-turn run, or a run from before turns were recorded
        turns = [{"role": "model", "text": str(row.get("completion", ""))}]
    if not turns:
        lines.append(_style("(no turns: the environment failed before the model's first turn)", "dim", color))
    for turn in turns:
        label = _turn_label(turn)
        text = str(turn.get("text", ""))
        calls = len(_TOOL_CALL_RE.findall(text)) if label == "model" else 0
        suffix = f" ({_count(calls, 'tool call')})" if calls else ""
        lines.append(_style(f"[{label}]", label, color) + suffix)
        lines.append(_indented(_highlight_calls(text, color) if calls else text))
    lines.append(f"[reward] {_number(row.get('reward'))}")
    if "reward_error" in row:
        lines.append(_style(f"[error] {row['reward_error']}", "error", color))
    return "\n".join(lines)


def rollouts_command(run_dir: str | os.PathLike, *, step: int | None = None, episodes: int = DEFAULT_EPISODES,
                     group: int | None = None, failed: bool = False, full_prompt: bool = False,
                     as_json: bool = False, color: bool = False) -> str:
    """What `titanrl rollouts` prints: transcripts of the selected episodes, or their rows as JSON lines."""
    selection = select_episodes(read_rollouts(run_dir), step, episodes, group, failed)
    if as_json:
        return "\n".join(json.dumps(row) for row in selection.rows)
    filters = _filters_text(group, failed)
    summary = (f"{Path(run_dir) / ROLLOUTS_FILE}: step {selection.step}, {len(selection.rows)} of "
               f"{selection.matched} episodes" + (f" matching {filters}" if filters else "")
               + f" ({selection.logged} logged at this step; the file has {_steps_text(selection.steps)})")
    blocks = [format_episode(row, i, full_prompt=full_prompt, color=color)
              for i, row in enumerate(selection.rows, start=1)]
    return "\n\n".join([summary, *blocks])
