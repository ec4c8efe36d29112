"""Tools a model can call: the built-ins (`calculator`, the sandboxed `python`) and users' Python functions
named as `module:function` or `path/to/file.py:function`, each with an OpenAI function schema whose
parameters validate the arguments of every call (jsonschema)."""

from __future__ import annotations

import ast
import inspect
import json
import operator
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from posttrain.environments.sandbox import SandboxLimits, run_python
from posttrain.utils.imports import import_attribute

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_BINARY |= {ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 100
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**1000


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        value = _BINARY[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("the result is too large")
        return value
    raise ValueError(f"unsupported expression element {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


CALCULATOR_PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "e.g. 123 * (45 + 6)"}},
    "required": ["expression"],
    "additionalProperties": False,
}


def python_tool(timeout_s: float, memory_mb: int, max_output_chars: int) -> Callable[[str], str]:
    """The `python` tool: run code in the bubblewrap sandbox (`sandbox.py`) and return what it printed (an
    environment that offers it checks `sandbox_mode()` first)."""
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_chars)

    def python(code: str) -> str:
        """Run Python code in a sandbox (no network, no files) and return what it printed."""
        result = run_python(code, limits)
        if result.timed_out:
            return f"{result.stdout}\n[killed: exceeded {limits.timeout_s}s]"
        if result.output_truncated:
            return f"{result.stdout}\n[killed: output exceeded {limits.max_output_bytes} bytes]"
        return result.stdout + (f"\n[stderr]\n{result.stderr}" if result.returncode else "")

    return python


PYTHON_PARAMETERS = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "a Python program; print what you need"}},
    "required": ["code"],
    "additionalProperties": False,
}

BUILTIN_TOOLS = ("calculator", "python")


@dataclass(frozen=True)
class Tool:
    """A callable with its OpenAI function schema (`{"type": "function", "function": {name, description,
    parameters}}`)."""

    schema: dict[str, Any]
    function: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


@dataclass
class ToolResult:
    """What one call returned (or why it failed: `is_error`), and how long it took."""

    content: str
    is_error: bool
    seconds: float = 0.0


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def parameters_from_signature(function: Callable[..., Any]) -> dict[str, Any]:
    """A JSON schema of `function`'s keyword parameters from its type hints (str, int, float, bool, list,
    dict; others unconstrained); parameters without a default are required."""
    hints = typing.get_type_hints(function)
    properties, required = {}, []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        json_type = _JSON_TYPES.get(hints.get(name))
        properties[name] = {"type": json_type} if json_type else {}
        if parameter.default is parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def make_tool(name: str, function: Callable[..., Any], parameters: dict[str, Any] | None = None) -> Tool:
    """A tool named `name`: its description is the function's docstring's first line; its parameters
    `parameters` (a JSON schema, checked here) or else inferred from the signature."""
    parameters = parameters_from_signature(function) if parameters is None else parameters
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as error:
        raise ValueError(
            f"tool {name!r}: its parameters are not a valid JSON schema: {error.message}"
        ) from None
    description = (inspect.getdoc(function) or name).strip().splitlines()[0]
    function_schema = {"name": name, "description": description, "parameters": parameters}
    return Tool({"type": "function", "function": function_schema}, function)


def resolve_tool(spec: str, parameters: dict[str, Any] | None, python_limits: dict[str, Any]) -> Tool:
    """A built-in by name, or a user's function as `module:function` / `file.py:function` (named after
    the function)."""
    if spec == "calculator":
        return make_tool("calculator", calculator, parameters or CALCULATOR_PARAMETERS)
    if spec == "python":
        return make_tool("python", python_tool(**python_limits), parameters or PYTHON_PARAMETERS)
    if ":" not in spec:
        raise KeyError(f"unknown tool {spec!r}; built-in: {list(BUILTIN_TOOLS)} (or module:function)")
    function = import_attribute(spec, kind="tool")
    if not callable(function):
        raise TypeError(f"tool {spec!r} is not callable")
    return make_tool(spec.rpartition(":")[2], function, parameters)


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """None when `arguments` fit the tool's parameters, else the first problem in words."""
    validator = jsonschema.Draft202012Validator(tool.schema["function"]["parameters"])
    error = next(iter(sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.path)
    return f"invalid arguments for {tool.name!r}" + (f" at {where!r}" if where else "") + f": {error.message}"


def call_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
    """Validate and run one call in a thread; an exception or running past `timeout_s` is an error
    result (a function that overruns keeps its thread until it returns: bound slow tools yourself)."""
    problem = check_arguments(tool, arguments)
    if problem is not None:
        return ToolResult(problem, is_error=True)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = tool.function(**arguments)
        except Exception as error:  # noqa: BLE001 - the model sees the tool's failure
            outcome["error"] = f"{type(error).__name__}: {error}"

    start = time.perf_counter()
    thread = threading.Thread(target=run, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(max(timeout_s, 0.0))
    seconds = time.perf_counter() - start
    if thread.is_alive():
        return ToolResult(f"tool {tool.name!r} timed out after {timeout_s:.3g}s", True, seconds)
    if "error" in outcome:
        return ToolResult(f"tool {tool.name!r} failed: {outcome['error']}", True, seconds)
    value = outcome.get("value")
    return ToolResult(value if isinstance(value, str) else json.dumps(value), False, seconds)
