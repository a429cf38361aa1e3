"""The TypeScript client (packages/ts, npm `journeyman-rl`) against a real `journeyman serve`: its npm
packages installed from the lockfile (`npm ci`), built with its own `tsc`, then its `node --test`
suite, which drives the server with the `openai` package, the Vercel AI SDK's tool loop,
LangChain.js and `@anthropic-ai/sdk`, and trains a step on what they captured. Then README's
commands for the example (examples/ts), pasted into a fresh checkout of the two folders."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from journeyman.backends.server import ServerProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("npm") is None, reason="the TypeScript client needs Node >= 20 and npm"),
]

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "packages" / "ts"


def _npm(*args: str, timeout_s: float, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        ["npm", *args], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"npm {' '.join(args)}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def built() -> Path:
    """The package installed from its lockfile (again only when the lockfile changed) and built."""
    # Where README's snippet was once written: `node --test test/` runs every .mjs under test/, so a
    # copy left there trained its model in the Node suite first, and the snippet printed step 2.
    (PACKAGE / "test" / ".readme-snippet.mjs").unlink(missing_ok=True)
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


def _readme_section() -> str:
    return (ROOT / "README.md").read_text().split("### From TypeScript", 1)[1].split("\n### ", 1)[0]


def _readme_snippet() -> str:
    """The ```ts block of README.md's "From TypeScript" section."""
    return _readme_section().split("```ts\n", 1)[1].split("\n```", 1)[0]


def test_the_readme_snippet_runs(built: Path, remote_server: ServerProcess) -> None:
    """README's snippet as a module of the package (Node resolves `journeyman-rl` to the package
    itself), against the same server."""
    snippet = PACKAGE / ".readme-snippet.mjs"  # gitignored; not under test/, which `npm test` runs whole
    snippet.write_text(_readme_snippet())
    env = {**os.environ, "JOURNEYMAN_URL": remote_server.url, "JOURNEYMAN_TOKEN": remote_server.token}
    done = subprocess.run(
        ["node", str(snippet)], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # step 1, or 0 when the two answers of each group happened to tie (a step with no signal is skipped)
    assert re.search(r"trained step [01] on 2 groups", done.stdout), done.stdout


def _readme_example_commands() -> dict[str, str]:
    """The example's shell lines in README's "From TypeScript" section, by their first word."""
    block = _readme_section().split("```bash\n", 1)[1].split("\n```", 1)[0]
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines()]
    return {"build": next(x for x in lines if x.startswith("cd examples/ts")), "start": lines[-1]}


def test_the_example_builds_from_a_fresh_checkout_and_trains(
    tmp_path: Path, remote_server: ServerProcess
) -> None:
    """README's build line, as pasted, in a copy of the tracked files of examples/ts and packages/ts
    (no node_modules, no dist): `npm run build` builds the client first. Then its start line with
    small sizes (one step of one group of 2, one held-out prompt) against the module's server (its
    own project, `ts-example`: a server of its own cost another ~12 s of CPU to start)."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "examples/ts", "packages/ts"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, tracked.split("\0")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    commands = _readme_example_commands()
    built = subprocess.run(
        ["bash", "-c", commands["build"]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, f"{commands['build']}:\n{built.stdout[-4000:]}\n{built.stderr[-3000:]}"
    assert (tmp_path / "examples/ts/dist/train.js").is_file()

    env_part, args = commands["start"].split("npm start --", 1)
    assert env_part.startswith("JOURNEYMAN_URL=") and "<token>" in env_part, commands["start"]
    # README's arguments first (parseArgs is strict: a renamed flag fails), then small sizes (the last wins)
    small = f"{args.strip()} --steps 1 --group-size 2 --prompts-per-step 1 --eval-prompts 1"
    env = {**os.environ, "JOURNEYMAN_URL": remote_server.url, "JOURNEYMAN_TOKEN": remote_server.token}
    log = tmp_path / "start.log"  # what it printed so far, also when it runs out of time
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", f"npm start -- {small}"],
            cwd=tmp_path / "examples/ts",
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,  # npm, sh and node: killed together
        )
        try:
            proc.wait(timeout=900)  # ~5 min at load 14 on 2 cores
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    printed = log.read_text()
    assert proc.returncode == 0, printed[-6000:]
    assert "held-out reward before:" in printed and "held-out reward after:" in printed, printed
    assert re.search(r"step [01]: train reward", printed), printed
