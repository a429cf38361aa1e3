"""Helpers the benches share: the built-in task's rollouts timed as one step, a LoRA adapter that
changes the model's outputs, and a LocalBackend on the vLLM engine serving it."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import journeyman as jm
import torch
from journeyman.app import tasks
from journeyman.engine import vllm_env
from journeyman.engine.vllm_engine import VLLMEngine
from journeyman.engine.vllm_server import VLLMConfig
from openai import AsyncOpenAI


async def rollout_step(
    model: jm.TrainableModel,
    client: AsyncOpenAI,
    scenarios: list[tasks.Scenario],
    group_size: int,
    max_tokens: int,
) -> tuple[list[jm.TrajectoryGroup], float]:
    """(groups with rewards that differ in each group, so every step trains; completion tokens/s)."""
    t0 = time.perf_counter()
    groups = await jm.gather_trajectory_groups(
        (
            jm.TrajectoryGroup(
                tasks.rollout(model, client, s, max_tokens=max_tokens) for _ in range(group_size)
            )
            for s in scenarios
        ),
        pbar_desc=None,
    )
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for g in groups for t in g.trajectories for r in t.records())
    for g in groups:
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2)
    return groups, tokens / elapsed


def nonzero_adapter(backend: jm.LocalBackend, model: jm.TrainableModel) -> Path:
    """Give the LoRA B matrices small random values (fresh LoRA is a no-op) and save it in PEFT format."""
    policy = backend.service(model).policy
    gen = torch.Generator().manual_seed(0)
    with policy.editing(), torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
        policy.version += 1
    path = Path(tempfile.mkdtemp(prefix="jm-bench-adapter-"))
    policy.save(path)
    return path


async def vllm_model(
    path: Path, name: str, python: str | None = None
) -> tuple[jm.LocalBackend, jm.TrainableModel, VLLMEngine, float]:
    """A LocalBackend on the vLLM engine serving `name` with a nonzero adapter hot-loaded as step 1,
    as after a training step: (backend, model, engine, seconds to register). `python`: vLLM's
    interpreter; default: provision the CPU environment (once, a few minutes) if it is absent."""
    python = python or str(vllm_env.provision())
    t0 = time.perf_counter()
    backend = jm.LocalBackend(path=path, engine=VLLMConfig(python=python))
    model = jm.TrainableModel(name=name, project="bench")
    try:
        await model.register(backend)
        engine = backend.service(model).engine
        assert isinstance(engine, VLLMEngine)
        register_s = time.perf_counter() - t0
        await engine.load_adapter(nonzero_adapter(backend, model), 1)
    except BaseException:
        backend.close()
        raise
    return backend, model, engine, register_s


def group_pids(pgid: int) -> list[int]:
    """Processes of a process group (a vLLM server and its engine-core workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().split(")")[-1].split()[2]) == pgid:
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def cpu_seconds(pids: list[int], threads: tuple[int, ...] | list[int] = ()) -> float:
    """User + system CPU seconds used so far by processes `pids` (all their threads, not reaped
    children) and by threads `threads` of this process (native ids; /proc/<tid> would count the
    whole process)."""
    paths = [f"/proc/{pid}/stat" for pid in pids] + [f"/proc/self/task/{tid}/stat" for tid in threads]
    total = 0
    for path in paths:
        try:
            with open(path) as f:
                fields = f.read().split(")")[-1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")
