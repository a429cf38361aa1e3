"""docs/limits.md lists every bound the server enforces: each row's constant exists in its file with
the value the row states, and each bound-like constant of the modules that serve requests has a
row, so the page goes stale neither way: a changed value, a renamed constant or a new bound fails
here until the page says so."""

from __future__ import annotations

import ast
import importlib
import inspect
import operator
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "limits.md"
# | bound | `value` ... | `CONSTANT` | `file` | what a client gets |
ROW = re.compile(r"^\| [^|]+ \| `(?P<value>[^`]+)`[^|]* \| `(?P<const>[^`]+)` \| `(?P<file>[^`]+)` \|", re.M)
# the modules a request goes through, and the names there that read as a bound
SERVING = [
    "serving/guard.py",
    "serving/openai_http.py",
    "serving/endpoint.py",
    "serving/api_tokens.py",
    "serving/drain.py",
    "serving/responses_api.py",
    "serving/messages_api.py",
    "serving/model_limits.py",
    "engine/base.py",
    "engine/grammar.py",
    "chat/messages.py",
    "backends/server.py",
    "backends/live_training.py",
    "data/live_types.py",
    "rollout/capture.py",
    "app/view/api.py",
]
BOUND_NAME = re.compile(r"(MAX|MIN)_\w+|[A-Z]\w*_(S|BYTES|CHARS|DEPTH|LIMIT|TOKENS)")  # private names skipped
NOT_A_BOUND = {
    "MAX_SAFE_INT",  # the viewer writes larger integers as strings: a display rule, nothing refused
    "MAX_TOKEN_ID",  # the viewer shows a larger id as no token: a display rule
    "OFF_LOOP_BYTES",  # bodies past it are parsed on a worker thread: how, not whether
    "PREVIEW_CHARS",  # the viewer's list shows this much of a message: a display rule
    "TICK_S",  # how often the live loop looks for work: how, not whether
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: operator.pow}


def _number(expr: str) -> float:
    """The value of an arithmetic expression of number literals (`64 * 2**20`, `2**63 - 1`)."""

    def ev(node: ast.expr) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise AssertionError(f"docs/limits.md: {expr!r} is not a number")

    return ev(ast.parse(expr, mode="eval").body)


def _module(file: str) -> ModuleType:
    return importlib.import_module("journeyman." + file.removesuffix(".py").replace("/", "."))


def _values(module: ModuleType, const: str) -> list[Any]:
    """What `const` holds: a module constant's value, a pydantic field's default and bounds, or a
    default argument (`Class(parameter)`)."""
    if m := re.fullmatch(r"(\w+)\((\w+)\)", const):
        return [inspect.signature(getattr(module, m[1])).parameters[m[2]].default]
    if "." in const:
        cls_name, field = const.split(".")
        cls = getattr(module, cls_name)
        assert issubclass(cls, BaseModel), const
        info = cls.model_fields[field]
        bounds = [
            getattr(c, a)
            for c in info.metadata
            for a in ("ge", "gt", "le", "lt", "max_length")
            if hasattr(c, a)
        ]
        return [info.default, *bounds]
    return [getattr(module, const)]


def _rows() -> list[tuple[str, str, str]]:
    return [(m["value"], m["const"], m["file"]) for m in ROW.finditer(PAGE.read_text())]


def test_every_constant_on_the_limits_page_holds_the_value_it_states() -> None:
    rows = _rows()
    assert len(rows) >= 30, "the table rows of docs/limits.md no longer parse"
    for value, const, file in rows:
        module = _module(file)
        found = _values(module, const)
        assert any(isinstance(v, int | float) and v == _number(value) for v in found), (
            f"docs/limits.md says {const} in {file} is {value}; it holds {found}"
        )


def test_every_bound_of_the_serving_modules_is_on_the_limits_page() -> None:
    listed = {(file, const.split("(")[0].split(".")[0]) for _, const, file in _rows()}
    missing = []
    for file in SERVING:
        module = _module(file)
        for name, value in vars(module).items():
            if (
                BOUND_NAME.fullmatch(name)
                and isinstance(value, int | float)
                and not isinstance(value, bool)
                and name not in NOT_A_BOUND
                and (file, name) not in listed
                and _defined_in(module, name)
            ):
                missing.append(f"{file} {name} = {value}")
    assert not missing, f"bounds with no row in docs/limits.md: {missing}"


def _defined_in(module: ModuleType, name: str) -> bool:
    """`name` is assigned in `module`'s own source, not imported into it."""
    source = inspect.getsource(module)
    return re.search(rf"^{name}\s*(:[^=]+)?=", source, re.M) is not None
