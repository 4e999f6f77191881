"""Agentic environments: the protocol, the code-execution sandbox, tools, and tool-using envs."""

from titanrl.envs.base import EnvContext, EnvFactory, Environment, StepResult
from titanrl.envs.code_exec import CodeTestsEnv, PythonTool, extract_code
from titanrl.envs.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    run_python,
    run_python_async,
)
from titanrl.envs.sandbox_pool import SandboxPool
from titanrl.envs.tool_env import EpisodeStats, ToolEnv
from titanrl.envs.tools import Tool, ToolCall, ToolRegistry, parse_tool_calls, tool, tools_prompt

__all__ = [
    "CodeTestsEnv",
    "EnvContext",
    "EnvFactory",
    "Environment",
    "EpisodeStats",
    "PythonTool",
    "Sandbox",
    "SandboxConfig",
    "SandboxPool",
    "SandboxResult",
    "SandboxUnavailableError",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolRegistry",
    "extract_code",
    "parse_tool_calls",
    "run_python",
    "run_python_async",
    "tool",
    "tools_prompt",
]
