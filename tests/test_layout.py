"""README's Layout is a map of the tree that cannot go stale: every module of core and of the
TypeScript client is named there, and everything named there exists.

The map is the fenced block under `## Layout`: a path from the repository root at the margin, then
one entry a line, indented two spaces a level below its folder, its name (a folder ends in `/`) and
one phrase. A folder entry stands for the folder's `__init__.py`. Read as text; nothing is imported.
Likewise conftest.py's order of the long test files names files that exist.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Where every module must be on the map: (folder, the suffix of its modules).
MAPPED = (("packages/core/src/journeyman", ".py"), ("packages/ts/src", ".ts"))
SKIPPED = {"__pycache__", "node_modules", "dist"}


def layout_block(readme: str) -> list[str]:
    """The lines of the fenced block in the README's Layout section."""
    section = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert section, "README.md has no `## Layout` section"
    block = re.search(r"^```text\n(.*?)^```$", section.group(1), re.M | re.S)
    assert block, "README's Layout section has no ```text block (the map of the tree)"
    return block.group(1).splitlines()


def named_paths(lines: Iterable[str]) -> tuple[list[str], list[str]]:
    """(every path the map names, from the repository root; lines it cannot read, saying why)."""
    named: list[str] = []
    bad: list[str] = []
    folders: list[str] = []  # the folder of each open level
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        depth, odd = divmod(indent, 2)
        if odd or depth > len(folders):
            bad.append(
                f"Layout line {n}: indented {indent} spaces under {len(folders)} open folders: {line!r}"
            )
            continue
        del folders[depth:]
        name = line.split(maxsplit=1)[0]
        path = "/".join([*folders[-1:], name.rstrip("/")])
        named.append(path + ("/" if name.endswith("/") else ""))
        if name.endswith("/"):
            folders.append(path)
    return named, bad


def tree(root: Path = ROOT) -> set[str]:
    """Every file and folder (ending in `/`) under the mapped folders' packages, from the repository root."""
    found: set[str] = set()
    for folder, _ in MAPPED:
        top = root / folder
        for p in [top.parent, *top.parent.rglob("*")]:
            if SKIPPED & set(p.parts):
                continue
            rel = p.relative_to(root).as_posix()
            found.add(rel + "/" if p.is_dir() else rel)
    return found


def layout_problems(named: list[str], present: set[str]) -> list[str]:
    """Each module in the tree the map leaves out, and each name on the map the tree lacks."""
    problems: list[str] = []
    for path in sorted({p for p in named if named.count(p) > 1}):
        problems.append(f"{path}: named twice in README's Layout")
    on_map = {*named, *(p + "__init__.py" for p in named if p.endswith("/"))}
    for path in named:
        if path not in present:
            problems.append(f"{path}: named in README's Layout, but not in the tree")
    modules = sorted(
        p for p in present for folder, suffix in MAPPED if p.startswith(folder + "/") and p.endswith(suffix)
    )
    problems += [f"{p}: in the tree, but not in README's Layout" for p in modules if p not in on_map]
    return problems


def test_readme_layout_names_every_module_and_nothing_that_is_gone() -> None:
    named, bad = named_paths(layout_block(README.read_text()))
    assert not bad, "README's Layout block cannot be read:\n" + "\n".join(bad)
    problems = layout_problems(named, tree())
    assert not problems, "README's Layout and the tree disagree:\n" + "\n".join(problems)


def test_the_layout_check_catches_a_planted_module_and_a_stale_name() -> None:
    named, _ = named_paths(layout_block(README.read_text()))
    present = tree()
    assert "packages/core/src/journeyman/engine/base.py" in named  # the map was read as a tree
    assert "packages/core/src/journeyman/rewards/ruler/__init__.py" in present - set(named)  # its folder
    planted = "packages/core/src/journeyman/engine/planted.py"
    gone = "packages/core/src/journeyman/chat/formats.py"
    before = set(layout_problems(named, present))  # empty when the map is right; the plant adds to it
    found = layout_problems(named, (present | {planted, "packages/ts/src/planted.ts"}) - {gone})
    assert [p for p in found if p not in before] == [
        f"{gone}: named in README's Layout, but not in the tree",
        f"{planted}: in the tree, but not in README's Layout",
        "packages/ts/src/planted.ts: in the tree, but not in README's Layout",
    ]
    found = layout_problems([*named, "packages/ts/src/index.ts"], present)
    assert [p for p in found if p not in before] == [
        "packages/ts/src/index.ts: named twice in README's Layout"
    ]


def test_the_layout_reader_refuses_a_line_it_cannot_place() -> None:
    named, bad = named_paths(["packages/ts/", "  src/", "      index.ts  its public names", "   odd.ts"])
    assert named == ["packages/ts/", "packages/ts/src/"]
    assert bad == [
        "Layout line 3: indented 6 spaces under 2 open folders: '      index.ts  its public names'",
        "Layout line 4: indented 3 spaces under 2 open folders: '   odd.ts'",
    ]


def test_the_order_of_long_files_names_test_files_that_exist() -> None:
    """conftest.py's FILE_SECONDS hands xdist the long files first; a moved file would lose its place
    without a word (its tests still run, last)."""
    keys = re.findall(r'^\s+"([^"]+\.py)": \d+,', (ROOT / "conftest.py").read_text(), re.M)
    assert len(keys) > 10, "FILE_SECONDS moved or changed shape"
    gone = [k for k in keys if not (ROOT / k).is_file()]
    assert not gone, f"FILE_SECONDS names test files that are not there: {gone}"
