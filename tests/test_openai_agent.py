"""The openai_agent example: its config, what its agent file imports, and its chat template
writing the tool agent's exact prompts (the warm start was trained on those bytes)."""

from __future__ import annotations

import ast
import asyncio
import json
import sys
from pathlib import Path

import pytest

import titanrl
from titanrl.cli import forget_shadowed_modules, load_config_file
from titanrl.config import ConfigError, validate

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"
TOOL_AGENT = EXAMPLE.parent / "tool_agent"


@pytest.fixture(scope="module")
def modules():
    """The example's agent.py and the tool agent's env.py and task.py, as their runs import them."""
    sys.path[:0] = [str(EXAMPLE), str(TOOL_AGENT)]
    forget_shadowed_modules(EXAMPLE)
    forget_shadowed_modules(TOOL_AGENT)
    import agent
    import env
    import task

    yield agent, env, task
    for folder in (EXAMPLE, TOOL_AGENT):
        sys.path.remove(str(folder))


def test_config_validates_and_trains_the_agent_on_the_tool_agent_task():
    config = load_config_file(str(EXAMPLE / "config.py"))
    validate(config)
    assert config.agent.fn is not None and config.env.factory is None and config.rewards == []
    assert Path(config.model.checkpoint) == TOOL_AGENT / "warm_start"
    assert config.agent.sandbox_pool_size >= 1


def test_the_agent_file_takes_nothing_from_titanrl_but_the_sandbox():
    tree = ast.parse((EXAMPLE / "agent.py").read_text())
    imported = [(node.module, [a.name for a in node.names]) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titanrl")]
    imported += [(a.name, []) for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
                 if a.name.startswith("titanrl")]
    assert imported == [("titanrl.agents", ["episode_sandbox"])]


def test_the_chat_template_writes_the_tool_agents_prompt_and_turns_byte_for_byte(modules):
    """The endpoint renders the harness's messages with the example's template: the first prompt is
    the tool agent environment's, and an assistant tool call plus its tool message render as the
    call the warm start samples followed by the environment's observation."""
    from transformers import AutoTokenizer

    from titanrl.chat import render_chat

    agent, env, task = modules
    tokenizer = AutoTokenizer.from_pretrained(TOOL_AGENT / "warm_start")
    template = (EXAMPLE / "chat_template.jinja").read_text()
    row = task.eval_rows()[0]
    messages = [{"role": "user", "content": row["prompt"]}]
    prompt = render_chat(tokenizer, messages, tools=agent.TOOLS, encoded_with_specials=False, chat_template=template)
    environment = env.ToolAgentEnv(pool=object())
    assert prompt == asyncio.run(environment.reset(row))

    output = f"stdout:\n{row['answer']}\n\nexit code: 0"
    call = {"role": "assistant", "tool_calls": [{"id": "c0", "type": "function", "function": {
        "name": "python", "arguments": json.dumps({"code": f"print({row['expression']})"})}}]}
    after = render_chat(tokenizer, [*messages, call, {"role": "tool", "tool_call_id": "c0", "content": output}],
                        tools=agent.TOOLS, encoded_with_specials=False, chat_template=template)
    from titanrl.envs.tools import ToolOutcome, format_response

    observation = environment._tool_turn(task.tool_call(row["expression"]),
                                         [ToolOutcome(format_response(output), content=output)])
    assert after == prompt + task.tool_call(row["expression"]) + observation


def _agent(base_url, api_key, row):
    return 1.0


@pytest.mark.parametrize(("change", "message"), [
    (dict(env=titanrl.EnvConfig(factory="examples.tool_agent.env:make_env")), "agent.fn and env.factory are both set"),
    (dict(rewards=["titanrl.rewards:exact_match"]), "agent.fn returns each episode's reward"),
    (dict(agent=titanrl.AgentConfig(fn=lambda row: 1.0)), "cannot be called as agent(base_url, api_key, row)"),
    (dict(agent=titanrl.AgentConfig(fn=_agent, chat_template="/nonexistent.jinja")), "agent.chat_template"),
    (dict(agent=titanrl.AgentConfig(fn=_agent, max_calls=0)), "agent.max_calls must be > 0"),
    (dict(agent=titanrl.AgentConfig(fn="no_such_module:agent")), "agent.fn='no_such_module:agent' cannot be imported"),
])
def test_bad_agent_settings_are_refused_before_start(tiny_run, change, message):
    config = titanrl.RunConfig(model=titanrl.ModelConfig(checkpoint=str(tiny_run.checkpoint)),
                               data=titanrl.DataConfig(train_file=str(tiny_run.train_file)),
                               agent=titanrl.AgentConfig(fn=_agent))
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(config)


def test_an_agent_run_needs_no_rewards(tiny_run):
    config = titanrl.RunConfig(model=titanrl.ModelConfig(checkpoint=str(tiny_run.checkpoint)),
                               data=titanrl.DataConfig(train_file=str(tiny_run.train_file)),
                               agent=titanrl.AgentConfig(fn=_agent))
    validate(config)
    assert config.runs_episodes and config.calls_per_episode == config.agent.max_calls
