"""Tool calls written as Python calls (`name(city="Paris", days=2)`): Llama 3.1's built-in tools
(`brave_search.call(query="...")`) and Gemma 3's `[f(a=1), g()]`. Read with `ast`, never run: only
keyword arguments with literal values are a call; anything else is text. Values are written as JSON
writes them (`"Paris"`, `true`, `null`), which is what a grammar built from the tool's JSON schema
admits, and read as either JSON's or Python's literals."""

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
            arguments[kw.arg] = ast.literal_eval(_json_names(kw.value))
        except (ValueError, SyntaxError, TypeError):
            return None
    try:
        json.dumps(arguments)
    except (TypeError, ValueError):  # a set, bytes or a complex number: not JSON arguments
        return None
    return name, arguments


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _json_names(node: ast.expr) -> ast.expr:
    """The value with JSON's `true`/`false`/`null` names turned into Python constants."""

    class _Names(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in _JSON_NAMES:
                return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
            return node

    return _Names().visit(node)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def python_call(name: str, arguments: dict[str, Any]) -> str:
    """`name(k=v, ...)` with each value written as compact JSON (the forced-call grammar's form)."""
    return f"{name}(" + ", ".join(f"{k}={_json(v)}" for k, v in arguments.items()) + ")"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
