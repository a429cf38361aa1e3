"""Fixtures shared by every package's tests: one registered default model per session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# Converted weights are cached per machine; tests never download anything.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Seconds each long file took in a fresh-clone run on the 2-core CI machine (pytest --durations and
# a per-test timeline, 2026-11-25). xdist hands files out in this order, longest first
# (`--no-loadscope-reorder`), so the two workers finish together: by test count, the one-test soak
# and learning files came last and one worker ran them alone for 200 s while the other sat idle.
# Files not listed follow in collection order.
FILE_SECONDS = {
    "packages/core/tests/test_vllm.py": 481,
    "packages/mcp/tests/test_mcp_rl.py": 276,
    "tests/test_examples.py": 251,
    "tests/test_soak.py": 149,
    "packages/core/tests/test_distributed.py": 83,
    "packages/mcp/tests/test_win_rate.py": 79,
    "packages/core/tests/test_learning.py": 72,
    "packages/core/tests/test_endpoint.py": 58,
    "packages/agents-sdk/tests/test_agents_sdk.py": 54,
    "packages/core/tests/test_remote.py": 50,
    "packages/core/tests/test_families.py": 41,
    "packages/langgraph/tests/test_langgraph.py": 40,
    "packages/core/tests/test_fuzz.py": 32,
    "packages/core/tests/test_train.py": 27,
    "packages/core/tests/test_ruler_local.py": 23,
    "tests/test_remote_adapters.py": 23,
}


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist the workers share the machine's cores: each computes on its share, and so
    # do the processes its tests start (servers, the soak, trainer ranks), since two 2-thread
    # OpenMP pools on 2 cores spin against each other (a soak beside another test ran 438 s).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        share = max(1, (os.cpu_count() or 2) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


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
