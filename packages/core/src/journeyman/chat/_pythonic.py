"""Tool calls written as Python calls (`name(city="Paris", days=2)`): Llama 3.1's built-in tools
(`brave_search.call(query="...")`) and Gemma 3's `tool_code` blocks. Read with `ast`, never run:
only keyword arguments with literal values are a call; anything else is text."""

from __future__ import annotations

import ast
import json
from typing import Any


def parse_python_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call `name(k=literal, ...)` (a dotted name's last part dropped when it
    is `call`: `brave_search.call(...)` calls brave_search), or None when the text is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    node = tree.body
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    if name.endswith(".call"):
        name = name.removesuffix(".call")
    arguments: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:  # **kwargs
            return None
        try:
            arguments[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError):
            return None
    try:
        json.dumps(arguments)
    except (TypeError, ValueError):  # a set, bytes or a complex number: not JSON arguments
        return None
    return name, arguments


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def python_call(name: str, arguments: dict[str, Any]) -> str:
    """`name(k=v, ...)` with each value as Python writes its literal."""
    return f"{name}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in arguments.items()) + ")"


def python_literal(value: Any) -> str:
    """A JSON value as a Python literal (True/False/None; strings double-quoted as JSON quotes them)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {python_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)
