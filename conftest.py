"""Fixtures shared by every package's tests: one registered default model per session, the
embedded chat format, scripted models served through the real endpoint (no weights), and
`journeyman serve` in a child process. Plain helpers and data live in tests/_support.py."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Converted weights are cached per machine; tests never download anything.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests/_support.py, importable by every package's tests as `_support`
sys.path.insert(0, str(Path(__file__).parent / "tests"))

if TYPE_CHECKING:
    import journeyman as jm
    from _support import ScriptedBackend
    from journeyman.backends.server import ServerProcess
    from journeyman.chat.formats import ChatFormat


# Seconds each long file took in a fresh-clone run on the development 2-core machine (2026-11-28,
# issues 53-54; per test wall time from tests/_timeline.py; the backend contract without the 300 s
# its Ctrl-C case then waited, the TypeScript file after it shared its server). xdist hands
# files out in this order, longest first (`--no-loadscope-reorder`), so the two workers finish
# together (they ended 4 s apart in that run): by test count, the one-test soak and learning files
# came last and one worker ran them alone for 200 s while the other sat idle. Files not listed
# (under 12 s) follow in collection order.
FILE_SECONDS = {
    "packages/core/tests/engine/test_vllm.py": 402,  # 650-item long prompt, not 900 (-11 s): 2026-11-29
    "packages/mcp/tests/test_mcp_rl.py": 238,  # alone, -n 0: 2026-11-29
    "tests/test_examples.py": 265,
    "packages/mcp/tests/test_win_rate.py": 80,  # 4 SFT epochs, not 10: 2026-11-29
    "packages/core/tests/backends/test_distributed.py": 131,  # two-rank test on 2 groups of 2 (-5 s): 2026-11-29
    "packages/core/tests/serving/test_endpoint.py": 100,
    "packages/core/tests/app/test_demo_learns.py": 77,
    "packages/core/tests/environments/test_environments.py": 64,
    "packages/core/tests/environments/test_openenv.py": 46,  # its venv built: 2026-11-29
    "packages/core/tests/environments/test_verifiers.py": 130,  # 88 in a fresh clone (venv built), + 40 s serve/pipeline: 2026-11-29
    "packages/agents-sdk/tests/test_agents_sdk.py": 91,
    "tests/test_typescript.py": 140,
    "packages/core/tests/backends/test_server.py": 83,
    "packages/core/tests/backends/test_otel.py": 15,  # a `journeyman serve` started: 2026-11-29
    "tests/test_soak.py": 89,
    "packages/langgraph/tests/test_langgraph.py": 49,
    "packages/core/tests/client/test_pipeline_trainer.py": 66,
    "packages/core/tests/chat/test_families.py": 54,
    "packages/core/tests/engine/test_kv.py": 39,
    "packages/core/tests/backends/test_train_step.py": 52,
    "packages/core/tests/serving/test_fuzz.py": 32,
    "packages/core/tests/backends/test_live_training.py": 68,  # + the budget stops: 2026-11-29
    "tests/test_remote_integrations.py": 41,
    "packages/core/tests/backends/test_drain.py": 20,
    "tests/test_light_client.py": 41,
    "packages/core/tests/rewards/test_ruler_local.py": 31,
    "tests/test_gpu_check.py": 26,
    "packages/core/tests/engine/test_constrained_decoding.py": 19,
    "packages/core/tests/backends/test_backend_contract.py": 60,
    "tests/test_art_compat.py": 19,
    "tests/test_front_doors.py": 22,
    "tests/test_docs.py": 115,
    "packages/core/tests/training/test_sft.py": 24,
    "packages/core/tests/backends/test_server_security.py": 23,
    "packages/core/tests/integrations/test_langfuse.py": 22,
    "packages/core/tests/engine/test_engine_faults.py": 21,
    "packages/mcp/tests/test_generated_checks.py": 21,
    "packages/core/tests/training/test_sharding.py": 19,
    "packages/core/tests/engine/test_vllm_handoff.py": 38,
    "packages/core/tests/app/test_viewer.py": 23,
    "packages/core/tests/serving/test_messages_api.py": 16,
    "packages/core/tests/rewards/test_ruler.py": 14,
    "packages/core/tests/training/test_packing.py": 13,
    "packages/core/tests/backends/test_schema_fuzz.py": 37,
    "packages/core/tests/backends/test_many_models.py": 70,  # alone: 2026-11-29 (mixed batches, pipelines)
    "packages/core/tests/backends/test_budget.py": 60,  # under load: 2026-11-29
    "packages/core/tests/backends/test_tenants.py": 73,  # alone, -n 0, wall: 2026-11-29
    "packages/core/tests/rewards/test_distill.py": 110,  # estimate under load: 2026-11-29
    "tests/test_live_kill.py": 70,  # 3 kills and restarts of a tiny model's server: 2026-11-29
    "packages/core/tests/serving/test_model_limits.py": 19,  # alone, -n 0 (32 s wall with collection): 2026-11-29
}


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("JOURNEYMAN_TIMELINE"):  # per-test wall and CPU seconds (tests/_timeline.py)
        import _timeline

        config.pluginmanager.register(_timeline, "journeyman-timeline")
    # Under pytest-xdist the workers share the machine's cores: each computes on its share, and so
    # do the processes its tests start (servers, the soak, trainer ranks), since two 2-thread
    # OpenMP pools on 2 cores spin against each other (a soak beside another test ran 438 s).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        share = max(1, (os.cpu_count() or 2) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        # vLLM's CPU worker pins its OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`, all cores by
        # default): pinned to the worker's own share, it no longer spins against the other worker
        # (its learning test took 107 s alone, 292-526 s beside another test, 128 s pinned: 2026-11-26).
        first = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) * share % (os.cpu_count() or 1)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first}-{first + share - 1}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a stable sort: the tests of a file keep their order (test_vllm.py relies on it)
    items.sort(key=lambda item: -FILE_SECONDS.get(item.nodeid.split("::")[0], 0))


@pytest.fixture(scope="session")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("journeyman-runs")


@pytest.fixture(scope="session")
async def served(run_root: Path) -> AsyncIterator[tuple[object, object]]:
    """(model, backend): the embedded default model served in process. Never trained: read-only use."""
    import journeyman as jm

    backend = jm.LocalBackend(path=run_root)
    model = jm.TrainableModel(name="shared", project="tests")
    await model.register(backend)
    yield model, backend
    backend.close()


@pytest.fixture(scope="session")
def chat_format() -> ChatFormat:
    """The embedded model's chat format, from its tokenizer files alone."""
    from _support import embedded_chat_format

    return embedded_chat_format()


@pytest.fixture(scope="module")
async def scripted_module(
    chat_format: ChatFormat, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[jm.TrainableModel, ScriptedBackend]]:
    """The `ScriptedBackend` behind `scripted`, one per test module."""
    import journeyman as jm
    from _support import ScriptedBackend

    backend = ScriptedBackend(chat_format, path=tmp_path_factory.mktemp("scripted-runs"))
    model = jm.TrainableModel(name="scripted", project="tests")
    # in a task of its own: registering makes a backend the current one (judge="local" and the like)
    # in its context, and the tests beside this fixture keep the one they had
    await asyncio.create_task(model.register(backend))
    yield model, backend
    backend.close()


@pytest.fixture
def scripted(
    scripted_module: tuple[jm.TrainableModel, ScriptedBackend],
) -> Iterator[tuple[jm.TrainableModel, ScriptedBackend]]:
    """(model, backend): a model registered on a `ScriptedBackend`, served through the real endpoint
    and answering "OK" until a test sets `backend.engine(model).script`; the script, the engine's
    delay and the endpoint's timeout are put back after each test."""
    model, backend = scripted_module
    engine, endpoint = backend.engine(model), backend.endpoint(model)
    saved = engine.script, engine.delay_s, endpoint.request_timeout_s
    yield model, backend
    engine.script, engine.delay_s, endpoint.request_timeout_s = saved


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium for the browser tests, installed with apt-get where it is missing and this
    runs as root (as CI does); never a browser build downloaded by a test tool. Where it can be
    neither found nor installed, the tests that need it are skipped with a warning that says so."""
    import shutil
    import subprocess
    import warnings

    found = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        print(
            "\nchromium is missing: apt-get install -y chromium (for the viewer's browser test)", flush=True
        )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
            if done.returncode != 0:
                print(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}", flush=True)
                break
        found = shutil.which("chromium")
    if found is None:
        why = "BROWSER TESTS NOT RUN: no `chromium` on this machine and it could not be installed (apt-get install -y chromium, as root)"
        warnings.warn(why, pytest.PytestWarning, stacklevel=1)
        pytest.skip(why)
    return found


@pytest.fixture(scope="module")
def remote_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`journeyman serve` in a child process with its own run directory and a random token
    (`.token`, `.url`, `.path`); killed after the module's tests."""
    from journeyman.backends.server import ServerProcess

    server = ServerProcess(tmp_path_factory.mktemp("serve"), secrets.token_urlsafe(24)).start()
    yield server
    server.kill()
