"""The TypeScript client (packages/ts, npm `journeyman`) against a real `journeyman serve`: its npm
packages installed from the lockfile (`npm ci`), built with its own `tsc`, then its `node --test`
suite, which drives the server with the `openai` package, the Vercel AI SDK's tool loop,
LangChain.js and `@anthropic-ai/sdk`, and trains a step on what they captured."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from journeyman.backends.server import ServerProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("npm") is None, reason="the TypeScript client needs Node >= 20 and npm"),
]

PACKAGE = Path(__file__).parents[1] / "packages" / "ts"


def _npm(*args: str, timeout_s: float, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        ["npm", *args], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"npm {' '.join(args)}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def built() -> Path:
    """The package installed from its lockfile (again only when the lockfile changed) and built."""
    installed = PACKAGE / "node_modules" / ".package-lock.json"
    lock = PACKAGE / "package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        _npm("ci", "--no-audit", "--no-fund", timeout_s=300)
    _npm("run", "build", timeout_s=120)
    return PACKAGE / "dist"


def test_the_typescript_client_trains_from_node(built: Path, remote_server: ServerProcess) -> None:
    env = {**os.environ, "JOURNEYMAN_URL": remote_server.url, "JOURNEYMAN_TOKEN": remote_server.token}
    _npm("test", timeout_s=900, env=env)  # ~11 min here at load 18 on 2 cores
    trained = list(remote_server.path.glob("ts/models/*/trajectories/train/0000.jsonl"))
    assert trained, "the step the Node suite trained left no trajectory file"


def _readme_snippet() -> str:
    """The ```ts block of README.md's "From TypeScript" section."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("### From TypeScript", 1)[1]
    return section.split("```ts\n", 1)[1].split("\n```", 1)[0]


def test_the_readme_snippet_runs(built: Path, remote_server: ServerProcess) -> None:
    """README's snippet as a module of the package (Node resolves `journeyman` to the package
    itself), against the same server."""
    snippet = PACKAGE / "test" / ".readme-snippet.mjs"  # gitignored
    snippet.write_text(_readme_snippet())
    env = {**os.environ, "JOURNEYMAN_URL": remote_server.url, "JOURNEYMAN_TOKEN": remote_server.token}
    done = subprocess.run(
        ["node", str(snippet)], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # step 1, or 0 when the two answers of each group happened to tie (a step with no signal is skipped)
    assert re.search(r"trained step [01] on 2 groups", done.stdout), done.stdout
