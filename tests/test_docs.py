"""The Python in the docs is code: every ```python block of README.md, packages/*/README.md and
docs/**/*.md compiles, names only what the packages export, and runs if it can run here.

Each block is checked three ways, without the model:

- it compiles (top-level `await` allowed, as in a notebook or `python -m asyncio`);
- every `jm.X`, `journeyman.X`, `from journeyman... import X` is public (in `__all__` of a module
  whose path has no `_` part, the rule tests/test_boundaries.py applies to the integrations), every
  `from <anything> import X` resolves, and calls of Journeyman callables and of methods of
  Journeyman objects the block constructs bind to their signatures (a renamed keyword fails here);
- the names it uses but no block of its file defines are exactly the ones listed in READER_NAMES
  (the reader's tools, reward, scenarios): a typo shows up as a new name.

Blocks that need nothing from the reader and no service (EXTERNAL) then run for real, a file's
blocks in order in one namespace, in a subprocess against the embedded model (run_doc_blocks.py).
Inline code in the prose is checked too: `jm.X`, `journeyman.a.b` and `from journeyman.x import Y`
are public, and every repository path the docs mention (examples/, bench/, docs/, packages/) exists.

The shell commands too (```bash blocks; every fence names its language): each one's arguments are
parsed by its own parser, and each is either run here as written (RUN: in one scratch directory, in
order, long runs at small sizes, servers started and asked) or listed in NOT_RUN with the reason
(a GPU, a network service, the reader's own server, minutes of training). Inline `journeyman x
--flag` spans in the prose name commands and flags that exist.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", *ROOT.glob("packages/*/README.md"), *ROOT.glob("docs/**/*.md")],
    key=lambda p: p.relative_to(ROOT).as_posix(),
)
RUNNER = Path(__file__).with_name("run_doc_blocks.py")
RUN_TIMEOUT_S = 420

# A block is named by (file, a piece of its text found in no other block of that file).
# Sketches: block -> the names it uses that the reader supplies (their tools, reward, scenarios).
# Compiled and checked, not run. Names an earlier block of the same file defines are not the reader's.
READER_NAMES: dict[tuple[str, str], set[str]] = {
    ("docs/environments.md", 'env = jm.environments.load("gym:textarena'): {"model"},
    ("README.md", "async def rollout(scenario) -> jm.Trajectory:"): {
        "TOOLS",
        "run_tool",
        "score",
        "scenarios",
    },
    ("README.md", "jm.PipelineTrainer(model, step_rollout"): {"scenarios"},
    ("docs/pipeline.md", "jm.PipelineTrainer(model, rollout"): {"model", "rollout", "scenarios", "held_out"},
    ("README.md", "from journeyman_langgraph import"): {"get_weather", "get_time", "score"},
    ("README.md", "from journeyman_agents import TrainableRunner"): {"score"},
    ("packages/langgraph/README.md", "async def rollout(scenario: Scenario)"): {
        "get_weather",
        "get_time",
        "Scenario",
        "score",
        "scenarios",
    },
    ("packages/langgraph/README.md", "def executor(state):"): {"tools"},
    # the on_error policies side by side: alternatives, not a program
    ("packages/langgraph/README.md", 'strict = trajectory(model, on_error="raise")'): set(),
    ("packages/agents-sdk/README.md", 'TrainableRunner(model, on_error="raise")'): set(),
    # the SDK's guardrail example on a kept run: its agent and runner are the first block's
    (
        "packages/agents-sdk/README.md",
        "if isinstance(run.exception, OutputGuardrailTripwireTriggered)",
    ): set(),
    ("docs/ruler.md", "rollout(model, s)"): {"rollout", "model", "scenarios"},
    ("README.md", "await model.live(jm.LiveConfig(episodes_per_step=16))"): {"run_agent"},
    ("docs/live.md", "await model.report_outcome(episode_id, reward=1.0, metrics="): {"run_agent"},
    # also asks a judge server on 127.0.0.1:8000
    ("docs/ruler.md", "rubric=MY_RUBRIC"): {"MY_RUBRIC"},
    ("docs/ruler.md", "await complete_json("): {"messages", "schema"},
    ("docs/distill.md", "distill=jm.DistillConfig("): {"groups"},
}
# Blocks that need a service this machine lacks: block -> that service. Compiled and checked, not run.
EXTERNAL: dict[tuple[str, str], str] = {
    ("docs/scale.md", "data_parallel_size=8"): "8 GPUs and vLLM in VENV (the mechanism: test_distributed.py)",
    ("docs/scale.md", "shard_base=True"): "8 GPUs and vLLM in VENV (the mechanism: test_sharding.py)",
    ("README.md", 'base_model="/models/Qwen3-8B"'): (
        "a Qwen3 checkpoint on disk (the families themselves: packages/core/tests/chat/test_families.py)"
    ),
    ("README.md", "jm.RemoteBackend("): (
        "a `journeyman serve` server on 127.0.0.1:7800 and its $JOURNEYMAN_TOKEN"
        " (RemoteBackend itself: packages/core/tests/backends/test_server.py)"
    ),
    ("docs/gpu.md", 'base_model="/models/Qwen2.5-7B-Instruct", max_tokens=256'): (
        "a `journeyman serve` on a GPU box with Qwen2.5-7B on its disk"
    ),
    (
        "docs/gpu.md",
        'jm.VLLMConfig(python="/root/vllm/bin/python"',
    ): "a GPU, vLLM in /root/vllm and Qwen2.5-7B on disk",
    ("docs/live.md", 'jm.RemoteBackend("http://gpu-box:7800")'): (
        "a `journeyman serve` server at gpu-box:7800 (live training itself: packages/core/tests/backends/test_live_training.py)"
    ),
    ("README.md", "await fetch_review_set("): (
        "a Langfuse server (LANGFUSE_* keys) holding human-scored traces, and block 1's model"
    ),
    # Not a service: a model that answers within max_tokens. The 135M model's streamed answer
    # sometimes runs past it (the SDK then raises on `response.incomplete`); the same runs, streamed
    # included, are tested in packages/agents-sdk/tests and tests/test_examples.py.
    ("packages/agents-sdk/README.md", "runner.run_streamed("): (
        "a model whose streamed answer fits max_tokens=40 (the embedded 135M one does not always)"
    ),
}


@dataclass(frozen=True)
class Block:
    path: str  # relative to ROOT, posix
    line: int  # the opening fence's line (1-based); the code starts on the next line
    source: str
    index: int  # position among the file's python blocks

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def key_in(self, table: dict[tuple[str, str], Any]) -> tuple[str, str] | None:
        return next((k for k in table if k[0] == self.path and k[1] in self.source), None)

    @property
    def runnable(self) -> bool:
        return self.key_in(READER_NAMES) is None and self.key_in(EXTERNAL) is None

    def tree(self) -> ast.Module:
        """The block's AST with line numbers of the Markdown file."""
        return ast.parse("\n" * self.line + self.source, self.path)


_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def split_markdown(text: str) -> tuple[list[tuple[int, str, str]], str]:
    """(fenced blocks as (fence line, language, source), the prose with the fenced blocks removed)."""
    blocks: list[tuple[int, str, str]] = []
    prose: list[str] = []
    open_at: tuple[int, str] | None = None
    body: list[str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        m = _FENCE.match(line)
        if open_at is None and m:
            open_at, body = (n, m.group(2).lower()), []
        elif open_at is not None and m and not m.group(2):
            blocks.append((open_at[0], open_at[1], textwrap.dedent("\n".join(body)) + "\n"))
            open_at = None
        elif open_at is not None:
            body.append(line)
        else:
            prose.append(line)
    assert open_at is None, f"unclosed code fence at line {open_at[0]}"
    return blocks, "\n".join(prose)


def python_blocks(doc: Path) -> list[Block]:
    rel = doc.relative_to(ROOT).as_posix()
    fenced, _ = split_markdown(doc.read_text())
    found = [(line, src) for line, lang, src in fenced if lang in ("python", "py")]
    return [Block(rel, line, src, i) for i, (line, src) in enumerate(found)]


BLOCKS = [b for doc in DOCS for b in python_blocks(doc)]
BY_FILE: dict[str, list[Block]] = {}
for _b in BLOCKS:
    BY_FILE.setdefault(_b.path, []).append(_b)


# -- names a block binds and uses -------------------------------------------------------------------
def bound_and_used(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound anywhere in the tree, and names read. Scopes are flattened: a sketch-level check."""
    bound: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        match node:
            case ast.Name(id=name, ctx=ast.Load()):
                used.add(name)
            case ast.Name(id=name):
                bound.add(name)
            case ast.FunctionDef(name=name) | ast.AsyncFunctionDef(name=name) | ast.ClassDef(name=name):
                bound.add(name)
            case ast.arg(arg=name):
                bound.add(name)
            case ast.alias(name=name, asname=asname) if name != "*":
                bound.add(asname or name.split(".")[0])
            case ast.ExceptHandler(name=str() as name) | ast.MatchAs(name=str() as name):
                bound.add(name)
            case ast.MatchStar(name=str() as name):
                bound.add(name)
    return bound, used


def undefined_names(block: Block, only_runnable_before: bool = False) -> set[str]:
    """Names the block reads that neither it, an earlier block of its file, nor builtins define."""
    earlier: set[str] = set()
    for b in BY_FILE[block.path][: block.index]:
        if not only_runnable_before or b.runnable:
            earlier |= bound_and_used(b.tree())[0]
    bound, used = bound_and_used(block.tree())
    return used - bound - earlier - set(dir(builtins))


# -- what a block names from the packages -----------------------------------------------------------
@dataclass(frozen=True)
class Instance:
    """A value the block built by calling a class it imported: `model = jm.TrainableModel(...)`."""

    cls: type


def _is_ours(module_name: str) -> bool:
    return module_name.split(".")[0].startswith("journeyman")


def public_attribute(module: types.ModuleType, name: str) -> Any:
    """`module.name` if public; raises LookupError saying why not. Submodules count when public."""
    path = module.__name__
    if _is_ours(path):
        if name.startswith("_") or any(p.startswith("_") for p in path.split(".")):
            raise LookupError(f"{path}.{name} is private")
        try:  # a public submodule (journeyman.integrations, journeyman.engine.vllm_env)
            sub = importlib.import_module(f"{path}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{path}.{name}":
                raise
        else:
            return sub
        if name not in getattr(module, "__all__", ()):
            where = "has no __all__" if not hasattr(module, "__all__") else "does not list it in __all__"
            raise LookupError(f"{path}.{name} is not exported: {path} {where}")
    if not hasattr(module, name):
        raise LookupError(f"{path} has no attribute {name!r}")
    return getattr(module, name)


def import_from(module_name: str, name: str) -> Any:
    """What `from module_name import name` binds, if public; raises ImportError or LookupError."""
    return public_attribute(importlib.import_module(module_name), name)


def _has_member(cls: type, name: str) -> bool:
    fields = getattr(cls, "model_fields", None) or getattr(cls, "__dataclass_fields__", None) or {}
    return name in fields or hasattr(cls, name)


def _checks_fields(cls: type) -> bool:
    """Only pydantic models and dataclasses declare every instance attribute on the class."""
    return hasattr(cls, "model_fields") or hasattr(cls, "__dataclass_fields__")


class ApiChecker:
    """Walks a file's blocks in order and lists what they name that does not exist as written.

    Tracks the names bound to Journeyman modules (`import journeyman as jm`), to objects imported
    from any module, and to instances of imported classes; a name bound to anything else is
    forgotten. Statements are taken in order, and a function's own names shadow the outer ones.
    """

    def __init__(self) -> None:
        self.env: dict[str, Any] = {}
        self.problems: list[str] = []

    def check_block(self, block: Block) -> list[str]:
        self.problems = []
        for stmt in block.tree().body:
            self._stmt(stmt)
        return self.problems

    # statements: check what they read, then update the bindings they make
    def _stmt(self, stmt: ast.stmt) -> None:
        match stmt:
            case ast.Import(names=names):
                for a in names:
                    self._import(stmt, a)
            case ast.ImportFrom(module=str() as module, names=names, level=0):
                self._import_from(stmt, module, names)
            case ast.FunctionDef() | ast.AsyncFunctionDef():
                for d in stmt.decorator_list:
                    self._expr(d)
                self._expr_list([*stmt.args.defaults, *(d for d in stmt.args.kw_defaults if d)])
                saved = dict(self.env)
                for name in bound_and_used(stmt)[0]:
                    self.env.pop(name, None)
                for s in stmt.body:
                    self._stmt(s)
                self.env = saved
                self.env.pop(stmt.name, None)
            case ast.Assign(targets=[ast.Name(id=name)], value=value):
                self._expr(value)
                self.env.pop(name, None)
                if (made := self._made(value)) is not None:
                    self.env[name] = made
                else:
                    self._forget(stmt.targets[0])
            case _:
                for child in ast.iter_child_nodes(stmt):
                    self._child(child)
                for target in self._targets(stmt):
                    self._forget(target)

    def _child(self, node: ast.AST) -> None:
        """Statements and expressions inside a compound statement (handlers, with-items, cases)."""
        if isinstance(node, ast.stmt):
            self._stmt(node)
        elif isinstance(node, ast.expr):
            self._expr(node)
        else:
            for child in ast.iter_child_nodes(node):
                self._child(child)

    @staticmethod
    def _targets(stmt: ast.stmt) -> list[ast.AST]:
        match stmt:
            case ast.Assign(targets=targets):
                return list(targets)
            case (
                ast.AnnAssign(target=t) | ast.AugAssign(target=t) | ast.For(target=t) | ast.AsyncFor(target=t)
            ):
                return [t]
            case ast.With(items=items) | ast.AsyncWith(items=items):
                return [i.optional_vars for i in items if i.optional_vars is not None]
            case ast.ClassDef(name=name):
                return [ast.Name(id=name, ctx=ast.Store())]
        return []

    def _forget(self, target: ast.AST) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.env.pop(node.id, None)

    def _import(self, stmt: ast.stmt, alias: ast.alias) -> None:
        try:
            module = importlib.import_module(alias.name)
        except ImportError as e:
            self.problems.append(f"line {stmt.lineno}: import {alias.name}: {e}")
            return
        if alias.asname:
            self.env[alias.asname] = module
        else:
            top = alias.name.split(".")[0]
            self.env[top] = sys.modules[top]

    def _import_from(self, stmt: ast.stmt, module_name: str, names: list[ast.alias]) -> None:
        for a in names:
            try:
                self.env[a.asname or a.name] = import_from(module_name, a.name)
            except (ImportError, LookupError) as e:
                self.problems.append(f"line {stmt.lineno}: from {module_name} import {a.name}: {e}")
                self.env.pop(a.asname or a.name, None)

    def _made(self, value: ast.expr) -> Instance | None:
        if isinstance(value, ast.Call) and inspect.isclass(cls := self._resolve(value.func, report=False)):
            return Instance(cls)
        return None

    # expressions
    def _expr_list(self, exprs: list[ast.expr]) -> None:
        for e in exprs:
            self._expr(e)

    def _expr(self, expr: ast.expr) -> None:
        """Check every attribute chain and call in `expr` once (outermost first)."""
        seen: set[int] = set()
        for node in ast.walk(expr):
            if id(node) in seen:
                continue
            if isinstance(node, ast.Call):
                self._call(node)
            if isinstance(node, ast.Attribute):
                self._resolve(node, report=True)
                inner = node.value
                while isinstance(inner, ast.Attribute):  # `jm.a.b` checks `jm.a` on the way
                    seen.add(id(inner))
                    inner = inner.value

    def _resolve(self, node: ast.expr, report: bool) -> Any:
        """The object an expression names, if it is a tracked name or an attribute chain on one."""
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if not isinstance(node, ast.Attribute):
            return None
        base = self._resolve(node.value, report)
        text = ast.unparse(node)
        try:
            if isinstance(base, types.ModuleType):
                return public_attribute(base, node.attr)
            if isinstance(base, Instance):
                if _has_member(base.cls, node.attr):
                    static = inspect.getattr_static(base.cls, node.attr, None)
                    methods = types.FunctionType | staticmethod | classmethod
                    return _BoundMember(base.cls, node.attr) if isinstance(static, methods) else None
                if _checks_fields(base.cls):
                    raise LookupError(f"{base.cls.__qualname__} has no attribute {node.attr!r}")
                return None
            if base is not None and not isinstance(base, _BoundMember):
                if not hasattr(base, node.attr):
                    raise LookupError(
                        f"{getattr(base, '__qualname__', base)!r} has no attribute {node.attr!r}"
                    )
                return getattr(base, node.attr)
        except LookupError as e:
            if report:
                self.problems.append(f"line {node.lineno}: {text}: {e}")
        return None

    def _call(self, call: ast.Call) -> None:
        target = self._resolve(call.func, report=False)
        if not (isinstance(target, _BoundMember) or callable(target)):
            return
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            return
        try:
            signature, self_arg = _signature(target)
        except (TypeError, ValueError):
            return  # a builtin or C callable without a signature
        args = [object()] * (self_arg + len(call.args))
        try:
            signature.bind(*args, **{k.arg: object() for k in call.keywords if k.arg})
        except TypeError as e:
            self.problems.append(f"line {call.lineno}: {ast.unparse(call.func)}(...): {e}")


@dataclass(frozen=True)
class _BoundMember:
    """`instance.method`, for checking a call against the method's signature."""

    cls: type
    name: str


def _signature(target: Any) -> tuple[inspect.Signature, int]:
    """The signature to bind a call against, and how many leading `self` arguments to supply."""
    if isinstance(target, _BoundMember):
        static = inspect.getattr_static(target.cls, target.name)
        if isinstance(static, staticmethod | classmethod):
            return inspect.signature(getattr(target.cls, target.name)), 0
        return inspect.signature(static), 1
    return inspect.signature(target), 0


def api_problems(block: Block) -> list[str]:
    checker = ApiChecker()
    for b in BY_FILE[block.path][: block.index]:
        checker.check_block(b)  # earlier blocks only bind names here; their own problems are theirs
    return checker.check_block(block)


# -- tests without the model -------------------------------------------------------------------------
def test_blocks_are_found() -> None:
    """The docs have Python blocks (a broken fence parser would make every other test vacuous)."""
    assert len(BLOCKS) >= 5 and {"README.md", "docs/ruler.md"} <= set(BY_FILE)


def test_tables_name_existing_blocks() -> None:
    """Every entry of READER_NAMES and EXTERNAL matches exactly one block: no stale entries."""
    for table in (READER_NAMES, EXTERNAL):
        for path, text in table:
            matches = [b.id for b in BY_FILE.get(path, []) if text in b.source]
            assert len(matches) == 1, f"the {path} block with {text!r}: matches {matches}"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block_compiles(block: Block) -> None:
    compile("\n" * block.line + block.source, block.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block_names_exist(block: Block) -> None:
    """What the block imports, names on `jm.` and calls on the objects it builds exists as written."""
    problems = api_problems(block)
    assert not problems, f"{block.id}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block_uses_only_listed_reader_names(block: Block) -> None:
    """A runnable block defines everything it uses; a sketch uses exactly its listed reader names."""
    key = block.key_in(READER_NAMES)
    expected = READER_NAMES[key] if key else set()
    assert undefined_names(block) == expected, (
        f"{block.id} uses names that neither it nor an earlier block of {block.path} defines; "
        f"expected exactly READER_NAMES[{key}] = {sorted(expected)}"
    )
    if block.runnable:
        missing = undefined_names(block, only_runnable_before=True)
        assert not missing, f"{block.id} runs, but needs {sorted(missing)} from a block that does not run"


# inline code spans in prose: `jm.X(...)`, `journeyman.a.b`, `from journeyman.x import Y`
_INLINE = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"(?<![\w./-])(jm|journeyman)((?:\.[A-Za-z_]\w*)+)")
_FROM_IMPORT = re.compile(r"\bfrom\s+(journeyman[\w.]*)\s+import\s+([\w\s,]+)")
_REPO_PATH = re.compile(r"(?<![\w./-])((?:examples|bench|docs|packages|tests)/[\w./-]*\w)")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# a test file named alone (`test_store.py`): some test file of the repository has that name
_TEST_FILE = re.compile(r"(?<![\w./-])(test_\w+\.py)")
TEST_FILES = {p.name for p in (*ROOT.glob("tests/**/test_*.py"), *ROOT.glob("packages/*/tests/**/test_*.py"))}


def prose_problems(doc: Path) -> list[str]:
    import journeyman

    text = doc.read_text()
    _, prose = split_markdown(text)
    problems: list[str] = []
    for span in _INLINE.findall(prose):
        for _, chain in _DOTTED.findall(span):
            obj: Any = journeyman
            done = "journeyman"
            for part in chain.strip(".").split("."):
                try:
                    if isinstance(obj, types.ModuleType):
                        obj = public_attribute(obj, part)
                    elif not hasattr(obj, part):
                        raise LookupError(f"{done} has no attribute {part!r}")
                    else:
                        obj = getattr(obj, part)
                except LookupError as e:
                    problems.append(f"`{span}`: {e}")
                    break
                done += f".{part}"
        for module_name, names in _FROM_IMPORT.findall(span):
            for name in (n.strip() for n in names.split(",") if n.strip()):
                try:
                    import_from(module_name, name)
                except (ImportError, LookupError) as e:
                    problems.append(f"`{span}`: {e}")
    for path in sorted(set(_REPO_PATH.findall(text))):
        if not (ROOT / path).exists():
            problems.append(f"{path}: no such file or directory")
    for link in sorted(set(_LINK.findall(prose))):  # [text](relative/path), from the file's folder
        if not re.match(r"[a-z]+:", link) and not (doc.parent / link).exists():
            problems.append(f"]({link}): no such file or directory")
    for name in sorted(set(_TEST_FILE.findall(prose)) - TEST_FILES):
        problems.append(f"{name}: no test file of that name (moved, renamed?)")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_prose_references_exist(doc: Path) -> None:
    """Inline `jm.X`, `journeyman.a.b`, `from journeyman.x import Y` in the prose are public; the
    repository paths the file mentions exist."""
    problems = prose_problems(doc)
    assert not problems, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


# -- running the runnable blocks -----------------------------------------------------------------------
def _subprocess_env() -> dict[str, str]:
    # One torch thread: a thread per core beside any other busy process makes them wait on each
    # other at every op (see test_examples.py). SIGABRT on timeout prints where every thread is.
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
    )
    # The Agents SDK exports traces to OpenAI when a key is set; the Langfuse exporter reads these.
    for var in ("OPENAI_API_KEY", "LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_BASE_URL"):
        env.pop(var, None)
    return env


@pytest.fixture(scope="module")
def run_doc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], dict[str, Any]]]:
    """Runs a file's runnable blocks once (in a subprocess); returns {block id: result}."""
    done: dict[str, dict[str, Any]] = {}

    def run(path: str) -> dict[str, Any]:
        if path not in done:
            work = tmp_path_factory.mktemp("doc-blocks")
            blocks = [
                {"id": b.id, "path": str(ROOT / b.path), "line": b.line, "source": b.source}
                for b in BY_FILE[path]
                if b.runnable
            ]
            (work / "blocks.json").write_text(json.dumps(blocks))
            results = work / "results.json"
            proc = subprocess.Popen(
                [sys.executable, str(RUNNER), str(work / "blocks.json"), str(results)],
                cwd=work,
                env=_subprocess_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                out, err = proc.communicate()
                out = f"timed out after {RUN_TIMEOUT_S} s\n{out}"
            output = out + err
            done[path] = {
                "results": json.loads(results.read_text()) if results.exists() else {},
                "output": output[-4000:],
            }
        return done[path]

    yield run


@pytest.mark.integration
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.runnable], ids=lambda b: b.id)
def test_block_runs(block: Block, run_doc: Callable[[str], dict[str, Any]]) -> None:
    """The block runs as written against the embedded model, after the runnable blocks before it."""
    ran = run_doc(block.path)
    result = ran["results"].get(block.id)
    assert result is not None, f"{block.id} did not run (an earlier block failed?); output:\n{ran['output']}"
    assert result["ok"], f"{block.id} failed after {result['seconds']:.0f} s:\n{result['error']}"


# -- the shell commands -------------------------------------------------------------------------------
# Every fenced block names its language, so a command cannot hide in an unlabelled block: ```bash
# blocks hold commands, ```text blocks what a command prints. Each command of a ```bash block (a
# line, `\` continuations joined, split at `&&`) is either run here as written (RUN below, in one
# scratch directory, in order) or listed in NOT_RUN with the reason; either way its arguments are
# parsed by the command's own parser first (`journeyman` and `mcp-rl` in process, by click, without
# running; a Python script or module by its `--help`, which must name every flag the line passes),
# so a renamed flag fails here even where the command cannot run.
FENCE_LANGUAGES = {"python", "py", "bash", "text", "json", "ts", "diff", "yaml"}
SHELL_LANGUAGES = {"bash"}


@dataclass(frozen=True)
class Command:
    path: str  # the Markdown file, relative to ROOT
    line: int  # the line the command starts on
    text: str  # as written (continuations joined, comment dropped)
    argv: tuple[str, ...]  # the program and its arguments: env, `cd`, `nice`, `uv run`, `./dev` taken off
    env: tuple[tuple[str, str], ...]  # VAR=value written before it
    cwd: str  # the directory an earlier `cd` of the same block moved to, relative to the reader's start

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def entries(self) -> list[tuple[str, str]]:
        """The RUN and NOT_RUN entries naming this command: one of its whole text, else those
        holding a piece of it (a test wants exactly one)."""
        keys = [k for k in (*RUN, *NOT_RUN) if k[0] == self.path]
        exact = [k for k in keys if k[1] == self.text]
        return exact or [k for k in keys if k[1] in self.text]


def _logical_lines(source: str, first_line: int) -> Iterator[tuple[int, str]]:
    start, pending = first_line, ""
    for n, line in enumerate(source.splitlines(), start=first_line):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def shell_commands(doc: Path) -> list[Command]:
    import shlex

    rel = doc.relative_to(ROOT).as_posix()
    fenced, _ = split_markdown(doc.read_text())
    found: list[Command] = []
    for fence_line, lang, source in fenced:
        if lang not in SHELL_LANGUAGES:
            continue
        cwd = "."
        for line, text in _logical_lines(source, fence_line + 1):
            words = shlex.split(text, comments=True)
            while words:
                part = words[: words.index("&&")] if "&&" in words else words
                words, text = words[len(part) + 1 :], shlex.join(part)
                env: list[tuple[str, str]] = []
                while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", part[0]):
                    name, _, value = part.pop(0).partition("=")
                    env.append((name, value))
                if part[:1] == ["nice"]:
                    part = part[3:] if part[1:2] == ["-n"] else part[1:]
                if part[:2] == ["uv", "run"]:
                    part = part[2:]
                if part[:1] == [
                    "./dev"
                ]:  # `./dev demo` runs `journeyman demo`, `./dev test` pytest, `./dev X` X
                    known = {"demo": ["journeyman", "demo"], "test": ["pytest"]}
                    part = [*known[part[1]], *part[2:]] if part[1] in known else part[1:]
                if part and os.path.basename(part[0]) in ("journeyman", "mcp-rl"):  # ~/venv/bin/journeyman
                    part = [os.path.basename(part[0]), *part[1:]]
                if part[:1] == ["cd"]:
                    cwd = os.path.normpath(os.path.join(cwd, part[1]))
                    continue
                found.append(Command(rel, line, text, tuple(part), tuple(env), cwd))
    return found


COMMANDS = [c for doc in DOCS for c in shell_commands(doc)]

# Run here, as written, in this order, in one scratch directory (the reader's shell), and how each
# is changed to run in a test: a server is started, asked, stopped; a long run gets small sizes
# (flags appended: the last one wins). command -> (extra arguments, how it is run).
RUN: dict[tuple[str, str], tuple[str, str]] = {
    ("docs/scale.md", "journeyman plan --preset qwen2.5-7b-instruct"): ("", "exit 0"),
    ("docs/gpu.md", "journeyman plan --preset qwen2.5-7b-instruct"): ("", "exit 0"),
    ("docs/gpu.md", "journeyman plan --preset qwen3-32b --lora-r 16"): (
        "",
        "exit 1: it does not fit, and says what to change",
    ),
    ("docs/gpu.md", "journeyman plan --preset qwen3-32b --gpus 8"): ("", "exit 0"),
    ("README.md", "journeyman serve --host 127.0.0.1 --port 7800 --path ./runs"): (
        "--port {port}",
        "server: prints its URL and an API token, then the commands below use it",
    ),
    (
        "docs/protocol.md",
        "curl -H 'Authorization: Bearer $JOURNEYMAN_TOKEN' http://127.0.0.1:7800/openapi.json",
    ): (
        "",
        "exit 0 and the OpenAPI document, from README's server (its port for 7800)",
    ),
    ("README.md", "journeyman token add ci-trainer --scope train --path ./runs"): ("", "exit 0"),
    ("README.md", "journeyman token revoke ci-trainer --path ./runs"): ("", "exit 0"),
    ("README.md", "./dev demo"): (
        "--steps 1 --groups-per-step 1 --group-size 2 --eval-prompts 1",
        "exit 0: one small step instead of ten",
    ),
    ("docs/viewer.md", "journeyman view"): ("--port {port}", "server: serves its page"),
    ("README.md", "journeyman view"): ("--port {port}", "server: serves its page"),
}
# Not run here: command -> why. Their arguments are still parsed (see above).
NOT_RUN: dict[tuple[str, str], str] = {
    ("docs/distill.md", "uv run python bench/distill.py"): (
        "half an hour of training (the mechanism: packages/core/tests/rewards/test_distill.py)"
    ),
    ("docs/environments.md", "journeyman train --env gym:textarena"): (
        "minutes of training (packages/core/tests/environments runs a step of it small)"
    ),
    ("docs/environments.md", "journeyman eval --env gym:textarena"): (
        "the trained model of the command above (packages/core/tests/environments evaluates steps 0 and latest)"
    ),
    ("docs/environments.md", "uv venv .venv-vf"): (
        "installs verifiers into a new interpreter; the tests build the same pinned one (tests/_support.py: pinned_venv)"
    ),
    ("docs/environments.md", "uv pip install --python .venv-vf/bin/python"): (
        "installs verifiers; packages/core/tests/environments/test_verifiers.py builds the pinned interpreter"
    ),
    ("docs/environments.md", "journeyman eval --env verifiers:verifiers.ReasoningGymEnv"): (
        "the .venv-vf interpreter of the commands above; test_verifiers.py evaluates ReasoningGymEnv through it"
    ),
    ("README.md", "./dev test"): "the whole test suite, which this test is part of",
    ("docs/metrics.md", "journeyman serve --otel-endpoint"): (
        "an OpenTelemetry collector at collector:4318 (yours); packages/core/tests/backends/test_otel.py "
        "starts `journeyman serve --otel-endpoint` against an OTLP receiver"
    ),
    ("README.md", "mcp-rl train http://127.0.0.1:8000/mcp"): "an MCP server on port 8000 (yours)",
    ("README.md", "mcp-rl train -- mcp-server-time"): (
        "minutes of training; mcp-server-time from PyPI is started by packages/mcp/tests"
    ),
    ("README.md", "mcp-rl scenarios"): "my_server.py is the reader's MCP server",
    ("README.md", "mcp-rl train --scenarios-file scenarios.json"): "my_server.py is the reader's MCP server",
    ("README.md", "mcp-rl eval --step 3"): "my_server.py is the reader's MCP server",
    ("README.md", "mcp-rl train --scenarios-file examples/mcp_todo_scenarios.json"): (
        "10-16 minutes of training (examples/sft_warmup_todo.py and packages/mcp/tests run it small)"
    ),
    ("packages/mcp/README.md", "mcp-rl train --scenarios-file examples/mcp_todo_scenarios.json"): (
        "10-16 minutes of training (the same command as README's)"
    ),
    ("packages/mcp/README.md", "mcp-rl eval --scenarios-file"): "the step-10 checkpoint of the run above",
    ("packages/mcp/README.md", "pip install journeyman-mcp"): "installs from PyPI",
    (
        "packages/core/README.md",
        "pip install 'journeyman[backend]'",
    ): "installs from PyPI (CI installs the workspace)",
    (
        "packages/core/README.md",
        "pip install journeyman",
    ): "installs from PyPI (tests/test_light_client.py: the light install)",
    (
        "packages/mcp/README.md",
        "mcp-rl train http://127.0.0.1:8000/mcp",
    ): "an MCP server on port 8000 (yours)",
    (
        "packages/mcp/README.md",
        "mcp-rl train http://127.0.0.1:8000/sse",
    ): "an MCP server on port 8000 (yours)",
    ("packages/mcp/README.md", "mcp-rl train -- mcp-server-time"): "minutes of training (as README's)",
    ("README.md", "journeyman sft good.jsonl"): "good.jsonl is the reader's (packages/core/tests run `sft`)",
    ("README.md", "journeyman langfuse pull"): "a Langfuse server (network)",
    ("README.md", "journeyman sft review.jsonl"): "review.jsonl comes from the Langfuse pull before it",
    ("README.md", "mcp-rl train --sft-warmup good.jsonl"): "my_server.py is the reader's MCP server",
    ("README.md", "journeyman serve --port 7800 --path ./runs"): (
        "the server README's first `journeyman serve` line starts; tests/test_typescript.py starts one"
    ),
    ("README.md", "npm ci"): "npm: tests/test_typescript.py runs this line in a fresh checkout",
    ("README.md", "npm run build"): "npm: tests/test_typescript.py runs this line in a fresh checkout",
    ("README.md", "npm start"): "npm: tests/test_typescript.py runs it with small sizes against a server",
    ("docs/protocol.md", "journeyman serve --host 127.0.0.1"): "the same server as README's, started there",
    (
        "docs/live.md",
        "x-journeyman-capture: ticket-4711",
    ): "a server with live training on (test_live_training.py)",
    ("docs/live.md", "episode_id"): "a server with live training on (test_live_training.py)",
    ("docs/live.md", "journeyman live langfuse"): "a Langfuse server (network) and a live server",
    (
        "docs/live.md",
        "live_todo.py --users 6",
    ): "16 minutes (measured runs); tests/test_examples.py runs it small",
    (
        "docs/live.md",
        "live_todo.py --users 8",
    ): "12 minutes (measured runs); tests/test_examples.py runs it small",
    ("docs/live.md", "--max-minutes 20"): "20 minutes (a measured run)",
    ("docs/live.md", "--max-minutes 17"): "17 minutes (a measured run)",
    ("docs/live.md", "--name live-long"): "35 minutes (a measured run)",
    ("docs/live.md", "--name live-best"): "35 minutes (a measured run)",
    ("docs/gpu.md", "python3 -m venv"): "GPU box: the environment the next command installs into",
    ("docs/gpu.md", "install 'journeyman[backend]' vllm"): "GPU: installs vLLM's CUDA build from PyPI",
    ("docs/gpu.md", "serve --engine vllm"): "GPU: vLLM on CUDA (vLLM's CPU build: test_vllm.py)",
    ("docs/scale.md", "./dev journeyman demo"): "GPU: the demo on one GPU (README's `./dev demo` runs here)",
    (
        "docs/scale.md",
        "--node-rank 0",
    ): "several nodes; train.py is the reader's (test_distributed.py runs two agents)",
    (
        "docs/scale.md",
        "--node-rank 1",
    ): "several nodes and a 7B on disk (test_distributed.py runs two agents)",
    ("docs/scale.md", "--model-config /models/Qwen3-32B"): "Qwen3-32B's config.json on disk",
    ("docs/soak.md", "bench/soak.py"): "65 minutes (tests/test_soak.py runs it for a quarter minute)",
    ("docs/viewer.md", "journeyman view .journeyman/journeyman-demo/models/demo other-runs/"): (
        "a demo run and a folder of other runs (the viewer's tests build both)"
    ),
    ("docs/viewer.md", "mcp-rl train --path /tmp/mcpshots"): "minutes of training, for the screenshots",
    ("docs/viewer.md", "docs/viewer/screenshots.py"): "a browser, for the screenshots",
}


def test_fences_name_their_language() -> None:
    """A block's language says what it is: commands (```bash) are run or listed, output is ```text."""
    problems = [
        f"{doc.relative_to(ROOT)}:{line}: ```{lang}"
        for doc in DOCS
        for line, lang, _ in split_markdown(doc.read_text())[0]
        if lang not in FENCE_LANGUAGES
    ]
    assert not problems, "fences with no or an unknown language:\n  " + "\n  ".join(problems)


def test_yaml_blocks_parse() -> None:
    """A YAML block (a Prometheus scrape job, alert rules) is YAML a reader can paste."""
    import yaml

    blocks = [
        (doc, line, body)
        for doc in DOCS
        for line, lang, body in split_markdown(doc.read_text())[0]
        if lang == "yaml"
    ]
    assert blocks
    for doc, line, body in blocks:
        assert isinstance(yaml.safe_load(body), dict), f"{doc.relative_to(ROOT)}:{line}"


def test_every_command_is_run_or_listed() -> None:
    """Each command of the docs is in RUN or in NOT_RUN, not both; each entry names one command."""
    assert len(COMMANDS) >= 30
    for command in COMMANDS:
        listed = command.entries()
        assert listed, f"{command.id} `{command.text}`: add it to RUN, or to NOT_RUN with the reason"
        assert len(listed) == 1, f"{command.id} `{command.text}` matches several entries: {listed}"
    for key in (*RUN, *NOT_RUN):
        assert any(c.entries() == [key] for c in COMMANDS), f"no command of {key[0]} holds {key[1]!r}"


_CLICK_APPS = {"journeyman": "journeyman.app.cli", "mcp-rl": "journeyman_mcp.cli"}


def click_parse(argv: tuple[str, ...]) -> None:
    """Parses argv with the command's own (typer's click) parser, subcommands included, without
    running it; a refused argument raises typer.TyperException (click's UsageError)."""
    import typer.main

    command: Any = typer.main.get_command(importlib.import_module(_CLICK_APPS[argv[0]]).app)
    ctx = command.make_context(argv[0], list(argv[1:]))
    while hasattr(command, "resolve_command"):  # a group: the rest names a subcommand
        name, sub, rest = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        assert sub is not None and name is not None, f"{argv}: no subcommand {rest[:1]}"
        command, ctx = sub, sub.make_context(name, rest, parent=ctx)


_HELP: dict[tuple[str, ...], str] = {}


def help_text(program: tuple[str, ...], cwd: Path) -> str:
    if program not in _HELP:
        done = subprocess.run(
            [*program, "--help"], cwd=cwd, env=_subprocess_env(), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{' '.join(program)} --help:\n{done.stderr[-2000:]}"
        _HELP[program] = done.stdout
    return _HELP[program]


def _flags(args: tuple[str, ...]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def argument_problems(command: Command) -> list[str]:
    """What the command's own parser says of the line's arguments ([] when it accepts them)."""
    import typer

    argv = command.argv
    if argv[0] in _CLICK_APPS:
        try:
            click_parse(argv)
        except typer.TyperException as e:
            return [f"{' '.join(argv)}: {e.format_message()}"]
        return []
    cwd = ROOT / command.cwd
    checks: list[tuple[tuple[str, ...], tuple[str, ...]]] = []  # (program, its arguments)
    if argv[0] == "torchrun":
        module = argv.index("-m") if "-m" in argv else None
        script = next(i for i, a in enumerate(argv) if a.endswith(".py")) if module is None else None
        end = module if module is not None else script
        checks.append(((sys.executable, "-m", "torch.distributed.run"), argv[1:end]))
        if module is not None:
            checks.append(((sys.executable, "-m", argv[module + 1]), argv[module + 2 :]))
    elif argv[0] == "python" and argv[1] == "-m":
        checks.append(((sys.executable, "-m", argv[2]), argv[3:]))
    elif argv[0] == "python":
        checks.append(((sys.executable, argv[1]), argv[2:]))
    else:
        return []  # curl, pip, npm: not ours to parse
    problems = []
    for program, args in checks:
        text = help_text(program, cwd)
        problems += [
            f"{' '.join(program[1:])}: no {flag} in its --help"
            for flag in _flags(args)
            if not re.search(rf"{re.escape(flag)}(?![\w-])", text)
        ]
    return problems


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_command_arguments_parse(command: Command) -> None:
    """The command's own parser accepts its arguments as written: a renamed flag fails here."""
    problems = argument_problems(command)
    assert not problems, f"{command.id} `{command.text}`:\n  " + "\n  ".join(problems)


# -- running them -------------------------------------------------------------------------------------
@dataclass
class Shell:
    """The reader's shell: one scratch directory, the variables a server printed, the servers."""

    root: Path
    env: dict[str, str]
    port_of: dict[str, str]  # a port the docs write -> the free port its server got here
    servers: list[subprocess.Popen[str]]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shell]:
    env = _subprocess_env()
    env.pop("JOURNEYMAN_TOKEN", None)  # `journeyman serve` then prints a new one, as README says
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # journeyman, mcp-rl
    state = Shell(tmp_path_factory.mktemp("reader"), env, {}, [])
    yield state
    for server in state.servers:
        server.kill()
        server.wait()


def _server_started(proc: subprocess.Popen[str], until: str, timeout_s: float) -> list[str]:
    """The server's stderr lines up to the one starting with `until`. A thread reads every line
    (and keeps reading after it), so a server that logs a lot never blocks on a full pipe."""
    import threading
    import time

    lines: list[str] = []
    assert proc.stderr is not None
    stderr = proc.stderr

    def read() -> None:
        for line in stderr:
            lines.append(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        seen = next((n for n, line in enumerate(list(lines)) if line.startswith(until)), None)
        if seen is not None:
            return lines[: seen + 1]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no line starting {until!r} within {timeout_s:.0f} s:\n" + "\n".join(lines[-40:]))


@pytest.mark.integration
@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c.entries()[:1] in ([k] for k in RUN)], ids=lambda c: c.id
)
def test_command_runs(command: Command, shell: Shell) -> None:
    """The command runs as written (RUN says how: sizes made small, a server started and asked)."""
    import urllib.request

    extra, how = RUN[command.entries()[0]]
    port = str(_free_port())
    env = {**shell.env, **dict(command.env)}

    def resolved(arg: str) -> str:
        for written, actual in shell.port_of.items():
            arg = arg.replace(f"127.0.0.1:{written}", f"127.0.0.1:{actual}")
        return re.sub(r"\$(\w+)", lambda m: env[m.group(1)], arg)

    argv = [resolved(a) for a in command.argv] + extra.format(port=port).split()
    if argv[0] == "curl" and shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    cwd = shell.root / command.cwd
    if argv[:2] == ["journeyman", "view"] and not (cwd / ".journeyman").exists():
        pytest.skip("shows the runs README's `./dev demo` made: run it first (it comes first in file order)")
    if how.startswith("server"):
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        shell.servers.append(proc)
        if argv[1] == "serve":
            lines = _server_started(proc, "ready", timeout_s=180)
            argv_port = command.argv.index("--port") + 1 if "--port" in command.argv else None
            shell.port_of[command.argv[argv_port] if argv_port else "7800"] = port  # the default port
            token = next(line.split(": ", 1)[1] for line in lines if line.startswith("token: "))
            shell.env["JOURNEYMAN_TOKEN"] = token
        else:
            lines = _server_started(proc, "journeyman view: http", timeout_s=120)
            url = lines[-1].split(": ", 1)[1].split()[0]
            with urllib.request.urlopen(url, timeout=30) as page:
                assert page.status == 200 and b"<html" in page.read().lower()
            proc.kill()
            proc.wait()
        return
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    expected = 1 if how.startswith("exit 1") else 0
    assert done.returncode == expected, (
        f"{' '.join(argv)} (in {cwd}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    if argv[0] == "curl":
        assert json.loads(done.stdout)["openapi"], done.stdout[:500]


# `journeyman ...` and `mcp-rl ...` written inline in the prose: the (sub)command exists and has
# every --flag the span names (the span may hold placeholders: `<model>`, `...`, `[--step N]`).
_INLINE_COMMAND = re.compile(r"^(?:\./dev |uv run )?(journeyman|mcp-rl)((?: [a-z][\w-]*)*)(.*)$")


def inline_command_problems(doc: Path) -> list[str]:
    import typer.main

    _, prose = split_markdown(doc.read_text())
    problems: list[str] = []
    for span in _INLINE.findall(prose.replace("\n", " ")):
        m = _INLINE_COMMAND.match(span)
        if not m:
            continue
        command: Any = typer.main.get_command(importlib.import_module(_CLICK_APPS[m.group(1)]).app)
        for word in m.group(2).split():
            if not hasattr(command, "commands") or word not in command.commands:
                break  # an argument: the words after it are too
            command = command.commands[word]
        known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2) + m.group(3)):
            if flag not in known:
                problems.append(f"`{span}`: {command.name} has no {flag}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_inline_commands_exist(doc: Path) -> None:
    """`journeyman x --flag` in the prose names a command and flags that exist."""
    problems = inline_command_problems(doc)
    assert not problems, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(problems)
