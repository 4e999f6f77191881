"""Tools: typed Python functions the model calls from its output.

A tool is a plain Python function (sync or `async`) with type hints on every parameter and a
Google-style docstring (a description, then `Args:` with a line per parameter);
`Tool.from_function` turns it into a name, a description and a JSON-schema parameter spec through
`transformers.utils.get_json_schema`, the schema chat templates take as `tools=` (parameter types:
str, int, float, bool, list[...], dict[str, ...], Optional[...] / `X | None`, Any).
`Tool.schema()` is that schema; `tools_prompt(tools)` renders the list and the call format for a
system prompt, for chat templates that do not render tools themselves.

Call format (Hermes / Qwen style). The model writes one JSON object inside tags:

    <tool_call>{"name": "run_python", "arguments": {"code": "print(1 + 1)"}}</tool_call>

`arguments` is an object (a JSON string holding an object is accepted too, as some models
stringify it); it may be omitted when the tool takes no arguments. Several calls in one turn
run in order.

Response format. Each call's result comes back as

    <tool_response>
    2
    </tool_response>

where a `str` result is inserted as is and anything else as JSON. A malformed call (bad JSON,
no closing tag, not an object, no name), an unknown tool, missing / unknown / wrongly typed
arguments, a tool that raises or runs past its timeout: each gives a response that starts
with `error:` and says what to fix. Such errors are data for the model, never exceptions out
of the environment; `ToolCall.error` / `ToolOutcome.error` let the environment count them.
Chat-control tokens (`<|im_start|>` ...) inside results are defused so a tool's output cannot
forge a turn boundary.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)
_CONTROL_TOKEN_RE = re.compile(r"<\|(im_start|im_end|endoftext)\|>")

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


# --- supported parameter types ------------------------------------------------------------
def check_supported(annotation: Any, where: str) -> None:
    """Raises TypeError for a parameter type `check_value` cannot validate a call's argument against.

    `transformers.utils.get_json_schema` writes the schema of more types than these (tuples,
    Literal, several-member unions, and any class as "object"); a tool taking one would receive
    unchecked arguments, so it is refused when the tool is defined."""
    if annotation is Any or annotation in _SCALARS:
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is list or origin is list:
        if args:
            check_supported(args[0], where)
        return
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str (JSON object keys), got {annotation!r}")
        if args:
            check_supported(args[1], where)
        return
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) != 1 or len(args) != 2:
            raise TypeError(f"{where}: only Optional[X] unions are supported, got {annotation!r}")
        check_supported(members[0], where)
        return
    raise TypeError(f"{where}: unsupported tool parameter type {annotation!r}; use str, int, float, bool, list, "
                    "dict, Optional")


def check_value(value: Any, annotation: Any, where: str) -> tuple[Any, str | None]:
    """(value, None) when `value` (decoded JSON) fits `annotation`, else (value, error text).

    The only coercion is int -> float, because JSON writes 2.0 as 2.
    """
    if annotation is Any:
        return value, None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None, None
        return check_value(value, next(a for a in args if a is not type(None)), where)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value), None
    if annotation in _SCALARS:
        # bool is an int subclass in Python; in JSON they are different things.
        ok = isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
        return value, None if ok else f"{where} must be {_SCALARS[annotation]}, got {_json_type(value)}"
    if annotation is list or origin is list:
        if not isinstance(value, list):
            return value, f"{where} must be array, got {_json_type(value)}"
        if not args:
            return value, None
        out = []
        for i, item in enumerate(value):
            item, err = check_value(item, args[0], f"{where}[{i}]")
            if err:
                return value, err
            out.append(item)
        return out, None
    if annotation is dict or origin is dict:
        if not isinstance(value, dict):
            return value, f"{where} must be object, got {_json_type(value)}"
        if not args:
            return value, None
        checked = {}
        for k, v in value.items():
            v, err = check_value(v, args[1], f"{where}[{k!r}]")
            if err:
                return value, err
            checked[k] = v
        return checked, None
    return value, f"{where} has an unsupported type {annotation!r}"


def _json_type(value: Any) -> str:
    for py, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                     (list, "array"), (dict, "object"), (type(None), "null")):
        if isinstance(value, py):
            return name
    return type(value).__name__


# --- tools -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tool:
    """A callable the model may invoke, with what the prompt shows about it."""

    name: str
    """Name the model writes in `"name"`; the function's name unless overridden."""
    description: str
    """One paragraph for the prompt: the docstring's first paragraph."""
    parameters: dict[str, Any]
    """JSON schema of the arguments object: {"type": "object", "properties", "required"}."""
    fn: Callable[..., Any]
    """The function itself (sync or async)."""
    hints: dict[str, Any] = field(repr=False)
    """Parameter name -> type hint, used to validate arguments before calling."""

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None,
                      description: str | None = None) -> Tool:
        """Builds a Tool from a typed function documented in Google style (a description, then an
        `Args:` block describing every parameter), its schema from `transformers.utils.get_json_schema`
        (as chat templates take tools); raises TypeError for an untyped, undocumented or unsupported
        parameter."""
        from transformers.utils import get_json_schema
        from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

        fn_name = getattr(fn, "__name__", type(fn).__name__)
        hints = typing.get_type_hints(fn)
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                raise TypeError(f"tool {fn_name}: parameter {p.name!r} must be a plain named parameter")
            if p.name not in hints:
                raise TypeError(f"tool {fn_name}: parameter {p.name!r} needs a type hint")
            check_supported(hints[p.name], f"tool {fn_name}: parameter {p.name!r}")
        try:
            schema = get_json_schema(fn)["function"]
        except (DocstringParsingException, TypeHintParsingException) as e:
            raise TypeError(f"tool {fn_name}: {e} (write a docstring with a description and an 'Args:' block "
                            "with one 'name: description' line per parameter)") from e
        params = {"type": "object", "properties": schema["parameters"]["properties"],
                  "required": schema["parameters"].get("required", [])}
        arg_hints = {k: v for k, v in hints.items() if k in params["properties"]}
        return cls(name or fn_name, description if description is not None else schema["description"],
                   params, fn, arg_hints)

    def spec(self) -> dict[str, Any]:
        """What the prompt lists: name, description, parameters."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`apply_chat_template(..., tools=[...])`)."""
        return {"type": "function", "function": self.spec()}

    def validate(self, arguments: Any) -> tuple[dict[str, Any], str | None]:
        """(checked arguments, None) or ({}, error text naming what is wrong)."""
        if not isinstance(arguments, dict):
            return {}, f'"arguments" must be a JSON object, got {_json_type(arguments)}'
        unknown = sorted(set(arguments) - set(self.parameters["properties"]))
        if unknown:
            return {}, (f"unknown argument(s) {', '.join(unknown)} for {self.name}; "
                        f"it takes: {', '.join(self.parameters['properties']) or 'no arguments'}")
        missing = [k for k in self.parameters["required"] if k not in arguments]
        if missing:
            return {}, f"missing required argument(s) {', '.join(missing)} for {self.name}"
        checked = {}
        for key, value in arguments.items():
            checked[key], err = check_value(value, self.hints[key], f"argument {key!r}")
            if err:
                return {}, err
        return checked, None


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator form of `Tool.from_function`: `@tool def add(a: int, b: int) -> int: ...`."""
    if fn is None:
        return lambda f: Tool.from_function(f, name=name)
    return Tool.from_function(fn, name=name)


@dataclass
class ToolCall:
    """One parsed `<tool_call>` block; `error` is set when it could not be parsed."""

    name: str
    """Tool name as written ("" when unparseable)."""
    arguments: Any
    """Decoded `arguments` (normally a dict; validated later against the tool)."""
    raw: str
    """The text between the tags, for logs."""
    error: str | None = None
    """Why the block is malformed, or None."""


@dataclass
class ToolOutcome:
    """The result of one call, ready to be shown to the model."""

    text: str
    """`<tool_response>...</tool_response>` block."""
    error: str | None = None
    """Error message when the call failed (malformed, unknown tool, bad args, raised, timeout)."""
    content: str = ""
    """What `text` wraps: the result, or `error: ...` (a chat template's tool turn adds its own tags)."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block in `text`, in order; malformed ones carry `.error`.

    An opening tag without a closing one (generation cut off) is a malformed call too.
    """
    calls = []
    for match in _CALL_RE.finditer(text):
        raw, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall("", None, raw, f"unterminated {TOOL_CALL_OPEN}: close it with {TOOL_CALL_CLOSE}"))
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", None, raw, f"tool call is not valid JSON ({e.msg} at char {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", None, raw, 'tool call must be a JSON object with a string "name"'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # Some models stringify the arguments object.
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # Reported by validation as "must be a JSON object".
        calls.append(ToolCall(obj["name"], args, raw))
    return calls


def defuse_control_tokens(text: str) -> str:
    """`<|im_end|>` -> `<| im_end |>`: tool output must not tokenize into chat-control tokens."""
    return _CONTROL_TOKEN_RE.sub(lambda m: f"<| {m.group(1)} |>", text)


def truncate_middle(text: str, max_chars: int) -> str:
    """Keeps the head and the tail (where tracebacks end) and says how much was cut."""
    if len(text) <= max_chars:
        return text
    half = max(max_chars // 2, 1)
    return f"{text[:half]}\n...[{len(text) - 2 * half} characters truncated]...\n{text[-half:]}"


def format_response(content: str) -> str:
    """The block a tool result is shown in."""
    return f"<tool_response>\n{content}\n</tool_response>"


class ToolRegistry:
    """Tools by name: renders the prompt section and runs parsed calls safely."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]], *, timeout_s: float = 60.0,
                 max_response_chars: int = 4000) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            t = t if isinstance(t, Tool) else Tool.from_function(t)
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        self.timeout_s = timeout_s
        """Wall-clock limit per call; a slower tool gives an error response."""
        self.max_response_chars = max_response_chars
        """Longest result text shown to the model (the middle is cut)."""

    def prompt(self) -> str:
        """System-prompt section: the tools and the call format."""
        return tools_prompt(self.tools.values())

    async def call(self, call: ToolCall) -> ToolOutcome:
        """Validates and runs one call; every failure becomes an `error:` response, never an exception."""
        error = call.error
        tool_ = self.tools.get(call.name)
        if error is None and tool_ is None:
            error = f"unknown tool {call.name!r}; available: {', '.join(self.tools) or 'none'}"
        if error is None and tool_ is not None:
            args, error = tool_.validate(call.arguments)
            if error is None:
                try:
                    result = await asyncio.wait_for(self._invoke(tool_, args), self.timeout_s)
                    # Formatting can fail too (e.g. a circular structure): same error path.
                    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
                except asyncio.TimeoutError:
                    error = f"{call.name} did not finish within {self.timeout_s:g} s"
                except Exception as e:  # noqa: BLE001 - a failing tool is information for the model
                    error = f"{call.name} raised {type(e).__name__}: {e}"
                else:
                    content = defuse_control_tokens(truncate_middle(text, self.max_response_chars))
                    return ToolOutcome(format_response(content), content=content)
        error = defuse_control_tokens(truncate_middle(str(error), self.max_response_chars))
        return ToolOutcome(format_response(f"error: {error}"), error, content=f"error: {error}")

    async def _invoke(self, tool_: Tool, args: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(tool_.fn):
            return await tool_.fn(**args)
        # Sync tools run in a thread so a slow one does not stall every other episode's loop.
        result = await asyncio.to_thread(tool_.fn, **args)
        return await result if inspect.isawaitable(result) else result


def tools_prompt(tools: Sequence[Tool] | Iterable[Tool]) -> str:
    """Renders the tool list (one JSON spec per line) and the call/response format."""
    specs = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in tools)
    return (
        "You can call tools. They are described by these JSON schemas:\n"
        f"<tools>\n{specs}\n</tools>\n"
        "To call a tool, write a JSON object with its name and arguments between tags, then stop:\n"
        f'{TOOL_CALL_OPEN}{{"name": "<tool name>", "arguments": {{"<argument>": <value>}}}}{TOOL_CALL_CLOSE}\n'
        "The result comes back as <tool_response>...</tool_response>. "
        "When you are done, reply without a tool call: that reply is your final answer."
    )
