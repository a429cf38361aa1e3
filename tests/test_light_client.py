"""The light install (`pip install journeyman`, no `backend` extra) drives `journeyman serve`.

A fresh venv gets core and the two agent integrations from the lockfile, offline, from uv's cache: no
torch, no fastapi, no xgrammar, no matplotlib. In it, `import journeyman` works, a `LocalBackend`
says which extra to install, and a `RemoteBackend` to a server started from the full environment
rolls out (plain client, LangGraph, Agents SDK) and trains a step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from journeyman.backends.server import ServerProcess

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
LIGHT_PACKAGES = ("journeyman", "journeyman-langgraph", "journeyman-agents")


def _light_env(venv: Path) -> dict[str, str]:
    """This process's environment minus what would point the light venv's Python at the full one.

    Bytecode goes to a folder beside the venv (not into the source tree): each later process reuses
    it instead of compiling openai, langchain and the Agents SDK again (~4 s each)."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONPYCACHEPREFIX": str(venv.parent / "pycache")}


@pytest.fixture(scope="module")
def light_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the light packages at the lockfile's versions (their own dependencies, no extras)."""
    uv = shutil.which("uv")
    assert uv, "uv is not on PATH (./dev installs it)"
    venv = tmp_path_factory.mktemp("light") / "venv"
    packages = [arg for name in LIGHT_PACKAGES for arg in ("--package", name)]
    out = subprocess.run(
        [uv, "sync", "--frozen", "--offline", "--no-dev", "--quiet", *packages],
        cwd=ROOT,
        env={**_light_env(venv), "UV_PROJECT_ENVIRONMENT": str(venv)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"the light venv did not install offline:\n{out.stderr}"
    return venv / "bin" / "python"


def run_light(python: Path, script: str, tmp_path: Path, **env: str) -> str:
    """Run `script` in the light venv (away from the repository, so nothing is found by cwd)."""
    out = subprocess.run(
        [str(python), "-c", script],
        cwd=tmp_path,
        env={**_light_env(python.parents[1]), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"the light client failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


_NO_BACKEND = """
import importlib.util

heavy = ("torch", "transformers", "peft", "safetensors", "fastapi", "xgrammar", "matplotlib")
installed = [m for m in heavy if importlib.util.find_spec(m) is not None]
assert not installed, f"the light venv has {installed}"

import journeyman as jm
from journeyman import RemoteBackend, TrainableModel, gather_trajectory_groups, read_trajectories, ruler_score_group
import journeyman_agents, journeyman_langgraph
import journeyman.art as art  # ART's API is light too (its `local` needs the backend extra)
from journeyman.art import dev, rewards, utils
assert isinstance(art.TrainableModel(name="a", project="p"), art.Model) and utils.iterate_dataset

for name in jm.__all__:  # every public name resolves, the backend's too (they fail when used)
    getattr(jm, name)
assert set(jm.__all__) <= set(dir(jm))
try:
    jm.LocalBackend(path="unused")
except ImportError as e:
    assert "pip install 'journeyman[backend]'" in str(e) and e.name == "torch", e
    print(e)
else:
    raise AssertionError("LocalBackend started without the backend extra")
"""


def test_the_light_install_imports_and_names_the_backend_extra(light_python: Path, tmp_path: Path) -> None:
    message = run_light(light_python, _NO_BACKEND, tmp_path)
    assert message.startswith("LocalBackend needs torch, transformers"), message
    serve = subprocess.run(
        [str(light_python.parent / "journeyman"), "serve", "--path", str(tmp_path)],
        env=_light_env(light_python.parents[1]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert serve.returncode == 2, serve.stderr
    assert serve.stderr.startswith("journeyman serve needs torch"), serve.stderr
    assert "pip install 'journeyman[backend]'" in serve.stderr, serve.stderr


_ROLLOUT_AND_TRAIN = """
import asyncio, os

import journeyman as jm
from agents import Agent, ModelSettings
from journeyman_agents import TrainableRunner
from journeyman_langgraph import chat_model, trainable, trajectory


async def main() -> None:
    backend = jm.RemoteBackend(os.environ["SERVER_URL"], token=os.environ["SERVER_TOKEN"], progress=False)
    model = jm.TrainableModel(name="light", project="p")
    await model.register(backend)
    client = model.openai_client()

    async def one(i: int) -> jm.Trajectory:
        messages = [{"role": "user", "content": f"Name a colour, number {i}."}]
        completion = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=4)
        choice = completion.choices[0]
        assert jm.record_of(choice) is not None, "no token record came back"
        return jm.Trajectory(messages_and_choices=[*messages, choice], reward=float(i % 2))

    groups = await jm.gather_trajectory_groups([jm.TrajectoryGroup(one(i) for i in range(2))], pbar_desc=None)
    result = await model.train(groups, config=jm.TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and not result.skipped and await model.get_step() == 1, result

    llm = trainable(chat_model(model, max_tokens=4))

    @trajectory(model)
    async def graph_rollout() -> float:
        await llm.ainvoke([("user", "Say hello.")])
        return 1.0

    traj = await graph_rollout()
    assert len(traj.records()) == 1 and traj.reward == 1.0, traj

    agent = Agent(name="Greeter", instructions="Answer in one word.", model_settings=ModelSettings(max_tokens=4))
    _, traj = await TrainableRunner(model).run(agent, "Say hello.")
    assert traj.metadata["agents"] == ["Greeter"] and len(traj.records()) == 1, traj
    backend.close()
    print("ok")


asyncio.run(main())
"""


def test_the_light_install_rolls_out_and_trains_on_a_server(
    light_python: Path, remote_server: ServerProcess, tmp_path: Path
) -> None:
    server = remote_server  # the root conftest's `journeyman serve`, from the full environment
    out = run_light(
        light_python, _ROLLOUT_AND_TRAIN, tmp_path, SERVER_URL=server.url, SERVER_TOKEN=server.token
    )
    assert out.strip().endswith("ok")
