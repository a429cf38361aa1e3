"""OpenEnv through the bridge, against a real OpenEnv server from PyPI: openenv 0.10.0 in its own
interpreter (it pulls gradio and fastmcp>=3; this workspace pins mcp), serving the echo environment
`openenv init` writes, under uvicorn on a free port. The embedded model plays, evaluates and trains
on it over the server's session WebSocket; a server that dies mid-episode, a dead URL and an
action field the server does not have are named errors."""

from __future__ import annotations

import math
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import journeyman as jm
import pytest
from _support import pinned_venv
from journeyman.environments import OpenEnvEnvironment, Sampling, evaluate, load, run_task

pytestmark = pytest.mark.integration

REQUIREMENTS = Path(__file__).with_name("openenv-requirements.txt")
SHORT = Sampling(temperature=1.0, max_tokens=8)


def _echo_env(python: str) -> Path:
    """The environment `openenv init echo_env` writes (OpenEnv's template: it echoes the action's
    `message`, reward min(0.1 * length, 1), never done), once beside the interpreter."""
    where = Path(python).parent.parent / "echo_env"
    if not (where / "server" / "app.py").exists():
        openenv = str(Path(python).with_name("openenv"))
        done = subprocess.run(
            [openenv, "init", "echo_env", "--output-dir", str(where.parent)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0 or not (where / "server" / "app.py").exists():
            pytest.fail(
                f"openenv init echo_env failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
    return where


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(python: str, timeout_s: float = 90.0) -> tuple[subprocess.Popen[str], str]:
    """The echo environment under uvicorn, as its README runs it, answering `/health`."""
    port = _free_port()
    server = subprocess.Popen(
        [python, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=_echo_env(python),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            pytest.fail(f"the OpenEnv server exited ({server.returncode}):\n{server.stderr.read()[-3000:]}")  # pyright: ignore[reportOptionalMemberAccess]
        try:
            if httpx.get(f"{url}/health", timeout=2).json() == {"status": "healthy"}:
                return server, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"the OpenEnv server did not answer /health in {timeout_s:.0f} s")
        time.sleep(0.2)


def _stop(server: subprocess.Popen[str]) -> None:
    server.kill()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def openenv_python() -> str:
    return pinned_venv(REQUIREMENTS)


@pytest.fixture(scope="module")
def echo_server(openenv_python: str) -> Iterator[str]:
    server, url = _start(openenv_python)
    yield url
    _stop(server)


async def test_an_openenv_episode_is_played_over_its_session_and_recorded_token_exactly(
    served: tuple[Any, Any], echo_server: str
) -> None:
    model, _ = served
    assert load(f"openenv:{echo_server}").name == f"openenv:{echo_server}"
    env = OpenEnvEnvironment(echo_server, max_turns=3)
    train, held_out = env.tasks("train"), env.tasks("eval")
    assert {t.id for t in train}.isdisjoint(t.id for t in held_out)
    trajectory = await run_task(env, model, held_out[0], SHORT)
    assert trajectory.metrics == {"turns": 3, "done": False}
    messages = trajectory.messages()
    said = [str(m["content"]) for m in messages if m["role"] == "assistant"]
    # the server's own reward, summed over the episode's steps: one session, three steps
    assert trajectory.reward == pytest.approx(sum(min(0.1 * len(s), 1.0) for s in said))
    assert math.isfinite(trajectory.reward)
    assert messages[0] == {"role": "user", "content": "Echo Env environment ready!"}
    # the server echoes each answer back, and the model hears it as the next turn
    heard = [str(m["content"]) for m in messages if m["role"] == "user"][1:]
    assert len(heard) == 2 and all(h == s for h, s in zip(heard, said, strict=False) if s)
    records = trajectory.records()
    assert len(records) == 3 and all(r.token_ids and len(r.logprobs) == len(r.token_ids) for r in records)


async def test_train_then_evaluate_before_and_after_on_an_openenv_server(
    served: tuple[Any, Any], echo_server: str
) -> None:
    _, backend = served
    model = jm.TrainableModel(name="openenv-tiny", project="tests-openenv")
    await model.register(backend)
    env = OpenEnvEnvironment(echo_server, max_turns=1)
    # 3 tokens: answers of 3 to 15 characters, so rewards differ within a group and the step learns
    steps = await jm.environments.train(
        model, env, steps=1, groups_per_step=2, group_size=2, sampling=Sampling(max_tokens=3)
    )
    assert len(steps) == 1 and steps[0].rollouts == 4 and steps[0].failed == 0
    latest = await model.get_step()
    assert latest == (0 if steps[0].skipped else 1)
    report = await evaluate(model, env, steps=[0, "latest"], tasks=2, sampling=SHORT, log=False)
    assert [s.step for s in report.steps] == [0, latest]
    for s in report.steps:
        assert s.tasks == 2 and not s.failures and math.isfinite(s.mean)
        assert set(s.task_rewards) == {"seed-1000000", "seed-1000001"}
        assert all(0.0 <= r <= 1.0 for r in s.task_rewards.values())


async def test_what_goes_wrong_with_a_server_is_named(
    served: tuple[Any, Any], openenv_python: str, echo_server: str
) -> None:
    model, _ = served
    task = OpenEnvEnvironment(echo_server).tasks("eval")[0]
    # an action field the server's /schema does not have: refused before an episode begins
    wrong = OpenEnvEnvironment(echo_server, action_field="code")
    with pytest.raises(jm.EnvironmentRolloutError) as raised:
        await run_task(wrong, model, task, SHORT)
    assert isinstance(raised.value.error, jm.InvalidFieldError) and raised.value.error.field == "action_field"
    assert "['message', 'metadata']" in str(raised.value)
    # the server dies after the episode began: the step names the session it dropped
    server, url = _start(openenv_python)
    env = OpenEnvEnvironment(url, max_turns=4)
    send = env._send  # pyright: ignore[reportPrivateUsage]

    async def send_then_die(ws: Any, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        answer = await send(ws, kind, data)
        if kind == "reset":
            _stop(server)
        return answer

    env._send = send_then_die  # pyright: ignore[reportPrivateUsage]
    with pytest.raises(jm.EnvironmentRolloutError, match="dropped the session at step") as raised:
        await run_task(env, model, task, SHORT)
    assert raised.value.environment == f"openenv:{url}" and raised.value.task == task.id
    assert isinstance(raised.value.error, ConnectionError)
    # nothing answers there any more: each task is a named failure, and evaluation goes on
    report = await evaluate(model, OpenEnvEnvironment(url), tasks=2, sampling=SHORT, log=False)
    (step,) = report.steps
    assert step.tasks == 0 and len(step.failures) == 2
    assert all("no OpenEnv server answers" in f.error for f in step.failures)
