"""Fixtures shared by every package's tests: one registered default model per session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# Converted weights are cached per machine; tests never download anything.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist the workers share the machine's cores: each computes on its share, since
    # two 2-thread OpenMP pools on 2 cores spin against each other.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


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
