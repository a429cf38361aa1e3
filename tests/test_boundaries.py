"""Import boundaries of the workspace, read from the source trees with `ast` (nothing is imported).

- Integrations (the framework packages: LangGraph, MCP, the Agents SDK) use only core's two faces:
  names in the `__all__` of `journeyman` or of `journeyman.integrations` (the seam made for them).
  Core's layer modules may move; those names do not.
- Core never imports an integration; integrations never import each other.
- No package's modules form an import cycle, counting imports under `if TYPE_CHECKING:` and inside
  functions: such a cycle works today only because of where the import sits, and turns into an
  ImportError (or a half-initialised module) the day someone moves it.

A module's parent packages are not counted as its imports (Python runs them first, but every module
would then "import" `journeyman/__init__.py`); an explicit `from journeyman import X` inside core is.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = "journeyman"
SOURCES = {
    "journeyman": ROOT / "packages" / "core" / "src" / "journeyman",
    "journeyman_langgraph": ROOT / "packages" / "langgraph" / "src" / "journeyman_langgraph",
    "journeyman_mcp": ROOT / "packages" / "mcp" / "src" / "journeyman_mcp",
    "journeyman_agents": ROOT / "packages" / "agents-sdk" / "src" / "journeyman_agents",
}
INTEGRATIONS = sorted(set(SOURCES) - {CORE})
INTEGRATION_FACES = ("journeyman", "journeyman.integrations")  # all an integration may import from core


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module

    def where(self, line: int) -> str:
        return f"{self.path.relative_to(ROOT)}:{line}"


@dataclass(frozen=True)
class Import:
    """One imported module: `import M [as alias]` (names == ()) or `from M import names`."""

    module: str  # absolute, relative imports resolved
    names: tuple[str, ...]
    alias: str | None  # the local name `import M as alias` binds
    line: int
    context: str  # "top" | "function" | "TYPE_CHECKING"


@cache
def modules(top: str) -> dict[str, Module]:
    root = SOURCES[top]
    assert (root / "__init__.py").is_file(), f"source tree moved: {root}"
    found: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        if name in found and found[name].is_package:
            continue  # `x/__init__.py` wins over `x.py`, as Python's finder does
        found[name] = Module(name, path, is_package, ast.parse(path.read_text(), str(path)))
    return found


def all_modules() -> dict[str, Module]:
    return {name: mod for top in SOURCES for name, mod in modules(top).items()}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(mod: Module) -> Iterator[Import]:
    """Every import statement in the module, wherever it sits."""

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def visit(node: ast.AST, context: str) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield Import(a.name, (), a.asname, child.lineno, context)
            elif isinstance(child, ast.ImportFrom):
                names = tuple(a.name for a in child.names)
                yield Import(resolve(child), names, None, child.lineno, context)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "TYPE_CHECKING")
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), context)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from visit(child, "function" if context == "top" else context)
            else:
                yield from visit(child, context)

    yield from visit(mod.tree, "top")


def public_names(module: str) -> frozenset[str] | None:
    """The module's `__all__` as written at its top level; None when it declares none."""
    mod = all_modules().get(module)
    if mod is None:
        return None
    names: list[str] | None = None
    for stmt in mod.tree.body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign | ast.AugAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        written = list(ast.literal_eval(value))
        names = [*(names or []), *written] if isinstance(stmt, ast.AugAssign) else written
    return None if names is None else frozenset(names)


def _top(module: str) -> str:
    return module.split(".")[0]


def _private_part(module: str) -> str | None:
    return next((p for p in module.split(".") if p.startswith("_")), None)


def _not_a_face(module: str) -> str | None:
    if module in INTEGRATION_FACES:
        return None
    private = _private_part(module)
    if private:
        return f"{module} is private ({private!r})"
    return f"{module} is not one of {' or '.join(INTEGRATION_FACES)}"


def _check_public(module: str, name: str) -> str | None:
    """Why `module.name` is not core's surface for integrations, or None when it is."""
    why = _not_a_face(module)
    if why:
        return why
    exported = public_names(module)
    if exported is None:
        return f"{module} has no __all__ (a module without one exports nothing)"
    if name not in exported:
        return f"{name!r} is not in {module}.__all__"
    return None


def _attribute_chains(tree: ast.AST) -> Iterator[tuple[list[str], int]]:
    """`a.b.c` as (["a", "b", "c"], line), outermost attribute access only."""
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain: list[str] = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name):
            yield [cur.id, *reversed(chain)], node.lineno


def public_surface_violations(top: str) -> list[str]:
    return [v for mod in modules(top).values() for v in module_surface_violations(mod)]


def module_surface_violations(mod: Module) -> list[str]:
    """Where one integration module reaches past core's faces (imports and `jm.x.y` attribute chains)."""
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> core module it stands for
    explicit: set[str] = set()  # modules `import a.b.c` made reachable as attributes
    for imp in imports(mod):
        if _top(imp.module) != CORE:
            continue
        if not imp.names:  # import journeyman[.x] [as y]
            why = _not_a_face(imp.module)
            if why:
                found.append(f"{mod.where(imp.line)}: import {imp.module}: {why}")
            if imp.alias:
                bound[imp.alias] = imp.module
            else:
                bound[CORE] = CORE
                parts = imp.module.split(".")
                explicit.update(".".join(parts[: i + 1]) for i in range(1, len(parts)))
            continue
        for name in imp.names:
            why = "star import" if name == "*" else _check_public(imp.module, name)
            if why:
                found.append(f"{mod.where(imp.line)}: from {imp.module} import {name}: {why}")
    for chain, line in _attribute_chains(mod.tree):
        if chain[0] not in bound:
            continue
        module, rest = bound[chain[0]], chain[1:]
        while rest and f"{module}.{rest[0]}" in explicit:
            module, rest = f"{module}.{rest[0]}", rest[1:]
        if rest:
            why = _check_public(module, rest[0])
            if why:
                used = ".".join(chain[: len(chain) - len(rest) + 1])
                found.append(f"{mod.where(line)}: {used}: {why}")
    return found


def test_integrations_import_only_public_core_names() -> None:
    found = [v for top in INTEGRATIONS for v in public_surface_violations(top)]
    assert not found, "integrations reach past core's public surface:\n" + "\n".join(found)


def test_the_surface_check_catches_layer_imports_planted_in_an_integration() -> None:
    planted = (
        "import journeyman as jm\n"
        "from journeyman.integrations import Episode, join_calls\n"
        "from journeyman.rollout.histories import join_calls\n"
        "import journeyman.data.failures\n"
        "jm.rollout.histories.join_calls\n"
    )
    path = SOURCES["journeyman_mcp"] / "rollout.py"
    mod = Module("journeyman_mcp.rollout", path, False, ast.parse(planted))
    where = "packages/mcp/src/journeyman_mcp/rollout.py"
    faces = "journeyman or journeyman.integrations"
    assert sorted(module_surface_violations(mod)) == [
        f"{where}:2: from journeyman.integrations import join_calls: 'join_calls' is not in journeyman.integrations.__all__",
        f"{where}:3: from journeyman.rollout.histories import join_calls: journeyman.rollout.histories is not one of {faces}",
        f"{where}:4: import journeyman.data.failures: journeyman.data.failures is not one of {faces}",
        f"{where}:5: jm.rollout: 'rollout' is not in journeyman.__all__",
    ]


def test_core_imports_no_integration_and_integrations_not_each_other() -> None:
    found: list[str] = []
    for top in SOURCES:
        forbidden = set(INTEGRATIONS) - {top}
        for mod in modules(top).values():
            for imp in imports(mod):
                exempt = (
                    mod.name,
                    _top(imp.module),
                ) in COMPAT_INTEGRATION_IMPORTS and imp.context == "function"
                if _top(imp.module) in forbidden and not exempt:
                    found.append(f"{mod.where(imp.line)}: {mod.name} imports {imp.module}")
    assert not found, "imports across package boundaries:\n" + "\n".join(found)


def package_graph(top: str) -> dict[str, dict[str, Import]]:
    """module -> {imported module of the same package: the first import statement that makes the edge}."""
    known = modules(top)
    graph: dict[str, dict[str, Import]] = {name: {} for name in known}
    for mod in known.values():
        for imp in imports(mod):
            if _top(imp.module) != top:
                continue
            targets = [imp.module] if not imp.names else []
            for name in imp.names:  # `from pkg import submodule` imports the submodule
                sub = f"{imp.module}.{name}"
                targets.append(sub if sub in known else imp.module)
            for target in targets:
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != mod.name:
                    graph[mod.name].setdefault(target, imp)
    return graph


def core_graph() -> dict[str, dict[str, Import]]:
    return package_graph(CORE)


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm; components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def shortest_cycle(graph: dict[str, dict[str, Import]], start: str, within: set[str]) -> list[str]:
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w not in within:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if w not in previous:
                previous[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is in a component but on no cycle")


def describe_cycle(graph: dict[str, dict[str, Import]], cycle: list[str]) -> str:
    known = modules(_top(cycle[0]))
    steps = [cycle[0]]
    for a, b in itertools.pairwise(cycle):
        imp = graph[a][b]
        steps.append(f"  -> {b}   ({known[a].where(imp.line)}, {imp.context})")
    return "\n".join(steps)


def cycles(graph: dict[str, dict[str, Import]]) -> list[str]:
    """Each distinct shortest cycle of the graph, described edge by edge (where, in what context)."""
    reports: list[str] = []
    for component in strongly_connected(graph):
        seen: set[frozenset[str]] = set()
        for start in component:
            cycle = shortest_cycle(graph, start, set(component))
            if frozenset(cycle) in seen:
                continue
            seen.add(frozenset(cycle))
            reports.append(describe_cycle(graph, cycle))
    return reports


@pytest.mark.parametrize("top", sorted(SOURCES))
def test_no_package_has_an_import_cycle(top: str) -> None:
    graph = package_graph(top)
    # the package's own face imports its modules: an empty graph would mean the resolver lost them
    assert graph[top], f"the graph lost {top}'s own imports"
    assert top != CORE or "journeyman.data.types" in graph[CORE], "the graph lost core's own imports"
    reports = cycles(graph)
    assert not reports, f"import cycles between {top} modules:\n" + "\n\n".join(reports)


def test_the_cycle_check_catches_an_import_inside_a_function_planted_in_an_integration() -> None:
    """The cycle journeyman_langgraph had: `_chat` imports `_capture` at its top, and `_capture`
    imported `_chat` back inside a method."""
    graph = {name: dict(edges) for name, edges in package_graph("journeyman_langgraph").items()}
    capture, chat = "journeyman_langgraph._capture", "journeyman_langgraph._chat"
    assert capture in graph[chat]
    graph[capture][chat] = Import(chat, ("chat_model",), None, 85, "function")
    up = graph[chat][capture]
    where = "packages/langgraph/src/journeyman_langgraph"
    assert cycles(graph) == [
        f"{capture}\n  -> {chat}   ({where}/_capture.py:85, function)\n"
        f"  -> {capture}   ({where}/_chat.py:{up.line}, {up.context})"
    ]


# Core's layers, bottom to top: a module imports only its own layer and those below (anywhere in
# the file, functions and TYPE_CHECKING included). The package faces (`journeyman`, the integrations'
# seam `journeyman.integrations`) sit above them all; only the app layer (the CLI) reaches up to one.
LAYERS = (
    ("errors", "_extras"),
    ("chat",),
    ("data",),
    ("rollout",),
    ("client",),
    ("rewards", "integrations"),
    ("environments",),  # the environment seam and its bridges: light, over the client
    ("policy",),
    ("engine",),
    ("training",),
    ("serving",),
    ("backends",),
    ("app",),
    ("art",),  # ART's API over Journeyman's (docs/migrating-from-art.md): above the app, it may use the faces
)
FACES = ("journeyman", "journeyman.integrations", "journeyman.adapters")  # the last: the old name of the seam
# `journeyman.art.langgraph` is ART's `art.langgraph`: it hands over to the LangGraph integration, imported
# when called (an optional install, named in the ImportError), the one import of an integration core makes.
COMPAT_INTEGRATION_IMPORTS = {("journeyman.art.langgraph", "journeyman_langgraph")}
# What a light install lacks: the layers below `policy` (and the faces) never import these at all,
# and only `serving` and above import the HTTP server's libraries.
TORCH_SHAPED = ("torch", "transformers", "peft", "safetensors", "gguf", "xgrammar", "matplotlib")
HTTP_SERVER = ("fastapi", "starlette", "uvicorn")
LIGHT_BELOW = "policy"
HTTP_FROM = "serving"


def layer_of(module: str) -> int:
    """The module's tier (the faces: len(LAYERS)); a module outside every layer is an error."""
    if module in FACES:
        return len(LAYERS)
    part = module.split(".")[1]
    for tier, names in enumerate(LAYERS):
        if part in names:
            return tier
    raise AssertionError(f"{module} is in no layer: put it in one of core's layer folders")


def _tier(name: str) -> int:
    return next(t for t, names in enumerate(LAYERS) if name in names)


def upward_imports(graph: dict[str, dict[str, Import]]) -> list[str]:
    found: list[str] = []
    known = modules(CORE)
    for source, edges in graph.items():
        tier = layer_of(source)
        for target, imp in edges.items():
            allowed = tier >= _tier("app") and target in FACES
            if layer_of(target) > tier and not allowed:
                where = known[source].where(imp.line) if source in known else source
                found.append(f"{where}: {source} imports {target}, a higher layer ({imp.context})")
    return found


def test_core_layers_import_only_downward() -> None:
    graph = core_graph()
    for name in graph:
        layer_of(name)  # every module sits in a layer
    found = upward_imports(graph)
    assert not found, "imports that run up core's layers:\n" + "\n".join(found)


def test_the_layer_check_catches_a_planted_upward_import() -> None:
    graph = {name: dict(edges) for name, edges in core_graph().items()}
    planted = Import("journeyman.backends.local", ("LocalBackend",), None, 1, "function")
    graph["journeyman.data.types"]["journeyman.backends.local"] = planted
    assert upward_imports(graph) == [
        "packages/core/src/journeyman/data/types.py:1: journeyman.data.types imports "
        "journeyman.backends.local, a higher layer (function)"
    ]


def test_light_layers_import_no_torch_and_no_http_server() -> None:
    found: list[str] = []
    for mod in modules(CORE).values():
        tier = layer_of(mod.name)
        for imp in imports(mod):
            if imp.context == "TYPE_CHECKING":
                continue
            lib = _top(imp.module)
            if lib in TORCH_SHAPED and (tier < _tier(LIGHT_BELOW) or mod.name in FACES):
                found.append(f"{mod.where(imp.line)}: {mod.name} imports {lib}")
            if lib in HTTP_SERVER and (tier < _tier(HTTP_FROM) or mod.name in FACES):
                found.append(f"{mod.where(imp.line)}: {mod.name} imports {lib}")
    assert not found, "the light layers import what only the backend extra installs:\n" + "\n".join(found)
