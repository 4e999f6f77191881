"""The tool agent's environment: one `python` tool in the sandbox, exact-match reward.

An episode (ChatML, as `titanrl.envs.ToolEnv` builds it):

    <|im_start|>system
    {SYSTEM_PROMPT}<|im_end|>
    <|im_start|>user
    What is 347 * 829?<|im_end|>
    <|im_start|>assistant
    <tool_call>{"name": "python", "arguments": {"code": "print(347 * 829)"}}</tool_call>   <- model
    <|im_end|>                                                                                  <- env
    <|im_start|>tool
    <tool_response>
    stdout:
    287663

    exit code: 0
    </tool_response><|im_end|>
    <|im_start|>assistant
    287663<|im_end|>                                                                            <- model

The call really runs: `PythonTool` sends the code to the worker's pre-started bubblewrap
`SandboxPool`. The final turn (the first one without a call) earns 1.0 when it is exactly
the answer and at least one well-formed `python` call ran earlier in the episode; an answer
without a call, a malformed call, a call to a tool that does not exist, or a wrong number
earns 0.
"""

from __future__ import annotations

from typing import Any

from task import TOOL_NAME  # the example's task.py (its folder is on sys.path)

from titanrl.envs import EnvContext, PythonTool, Tool, ToolEnv

TOOL_TIMEOUT_S = 5.0
"""Wall-clock limit of one program; `print(a * b)` takes ~30 ms in a warm sandbox."""

# Compact on purpose: the byte tokenizer spends one token per character, and this prefix is
# in every sequence the trainer processes. (ToolEnv's default lists the full JSON schema.)
SYSTEM_PROMPT = f'Tool: <tool_call>{{"name": "{TOOL_NAME}", "arguments": {{"code": ...}}}}</tool_call> runs code.'



class ToolAgentEnv(ToolEnv):
    """`python` tool + exact-match scoring of the final answer."""

    def __init__(self, pool: Any) -> None:
        if pool is None:
            raise ValueError("ToolAgentEnv needs a SandboxPool: set env.sandbox_pool_size >= 1 in the config")
        self.python = PythonTool(pool, timeout_s=TOOL_TIMEOUT_S)
        super().__init__([Tool.from_function(self.python.run_python, name=TOOL_NAME)], tool_timeout_s=2 * TOOL_TIMEOUT_S)
        self.python.stats = self.stats  # sandbox time counts toward the episode's sandbox_s

    def system_prompt(self, row: dict[str, Any]) -> str:
        return SYSTEM_PROMPT

    async def score(self, row: dict[str, Any], answer: str) -> float:
        # Every call either ran or produced an error response, so this means "a call ran".
        called = self.stats.tool_calls > self.stats.errors
        return 1.0 if called and answer.strip() == row["answer"] else 0.0


def make_env(context: EnvContext) -> ToolAgentEnv:
    """One fresh environment per episode, sharing the rollout worker's sandbox pool."""
    return ToolAgentEnv(context.sandbox_pool)
