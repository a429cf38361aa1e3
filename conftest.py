"""Suite-wide settings, for every package's tests."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist two workers share the machine's cores: each computes on one thread, since
    # two 2-thread OpenMP pools on 2 cores spin against each other.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
