"""vLLM's side of the GPU handoff, against a wire-level stand-in (`vllm_standin.py`).

vLLM's CPU build has no sleep mode, so `/sleep`, `/wake_up`, `/is_sleeping` and the staged wake
cannot run for real here; the stand-in speaks vLLM 0.32's wire format for them, is started by the
real `VLLMServer` exactly as vLLM is (a child process, supervised, restarted), and records every call
it gets. What is tested is ours: the order of a training step (sleep → train → wake weights, re-read
them, load the new adapter, wake the KV cache), the memory check before each stage (a probe that
reports a small free figure: our decision logic, on the numbers a GPU would give), a wake that
times out, a server killed while asleep, and the settings passed to vLLM. The same ordering on a
real GPU with real vLLM: `bench/vllm_wake_check.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import journeyman as jm
import pytest
from _support import recorded_choice
from journeyman.engine.base import SamplingParams
from journeyman.engine.handoff import DeviceMemory, check_fits, weight_bytes
from journeyman.engine.vllm_engine import VLLMEngine, VLLMWakeError
from journeyman.engine.vllm_server import VLLMConfig, VLLMServer, check_layout, lora_slots
from journeyman.errors import EngineDownError, InvalidFieldError, WakeMemoryError
from pydantic import ValidationError

STANDIN = Path(__file__).with_name("vllm_standin.py")
GiB = 1024**3


# -- helpers -----------------------------------------------------------------------------------------


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A valid safetensors file of zeros (header, then data), written without torch."""
    size = {"F32": 4, "BF16": 2, "I64": 8}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * size[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def _tiny_model(root: Path) -> Path:
    model = root / "model"
    model.mkdir()
    _safetensors(model / "model.safetensors", {"model.layers.0.self_attn.q_proj.weight": ("F32", [256, 256])})
    return model


def _adapter(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    _safetensors(path / "adapter_model.safetensors", {"lora_A": ("F32", [8, 256])})
    return path


def _standin(root: Path, **fields: Any) -> tuple[VLLMConfig, Path]:
    """A VLLMConfig that starts the stand-in where vLLM would start (`-m vllm.entrypoints.openai.
    api_server`, found through a shim package on PYTHONPATH), and the file its calls go to."""
    pkg = root / "shim" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg.parent.parent, pkg.parent, pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(
        f"import runpy\nrunpy.run_path({str(STANDIN)!r}, run_name='__main__')\n"
    )
    log = root / "calls.jsonl"
    env = {"PYTHONPATH": str(root / "shim"), "STANDIN_LOG": str(log), **fields.pop("env", {})}
    config = VLLMConfig(
        python=sys.executable,
        sleep_mode=True,
        env=env,
        log_file=str(root / "server.log"),
        startup_timeout_s=60,
        request_timeout_s=30,
        **fields,
    )
    return config, log


def _calls(log: Path, pid: int | None = None) -> list[str]:
    """The stand-in's calls in order, each as a short name (`sleep 2 wait`, `wake weights`, ...);
    the trainer's marks, one per micro-batch, as one."""
    out: list[str] = []
    for line in log.read_text().splitlines():
        call = json.loads(line)
        if pid is not None and call["pid"] != pid:
            continue
        name = _name(call)
        if not (out and name == out[-1] and name.startswith("mark")):
            out.append(name)
    return out


def _name(call: dict[str, Any]) -> str:
    path, q, body = call["path"], call.get("query") or {}, call.get("body") or {}
    if call["method"] == "START":
        return "start"
    if path == "/sleep":
        return f"sleep {q['level'][0]} {q['mode'][0]}"
    if path == "/wake_up":
        return "wake " + ",".join(q.get("tags", ["all"]))
    if path == "/collective_rpc":
        return str(body["method"])
    if path == "/v1/load_lora_adapter":
        return f"load {body['lora_name']}" + (" inplace" if body.get("load_inplace") else "")
    if path == "/v1/unload_lora_adapter":
        return f"unload {body['lora_name']}"
    if path == "/v1/completions":
        return f"complete {body['model']}"
    if path == "/_mark":
        return f"mark {q['what'][0]}"
    return path.strip("/")  # health, is_sleeping


def _start_record(log: Path) -> dict[str, Any]:
    return json.loads(log.read_text().splitlines()[0])


class ScriptedGPU:
    """The free memory a GPU reports, reading by reading (the last one repeats): 80 GiB in all, with
    what this process's allocator holds and, as NVML would list them, the processes on it."""

    def __init__(self, *free_gib: float, reserved_gib: float = 0.0) -> None:
        self.free = list(free_gib)
        self.reserved_gib = reserved_gib

    def __call__(self) -> DeviceMemory:
        free = self.free.pop(0) if len(self.free) > 1 else self.free[0]
        return DeviceMemory(
            device="cuda:0",
            free_bytes=int(free * GiB),
            total_bytes=80 * GiB,
            reserved_here=int(self.reserved_gib * GiB),
            allocated_here=int(self.reserved_gib * 0.9 * GiB),
            processes="GPU:0\nprocess 4242 uses 8192.000 MB GPU memory",
        )


async def _engine(root: Path, probe: Callable[[], DeviceMemory | None] = lambda: None, **fields: Any):
    config, log = _standin(root, **fields)
    engine = await asyncio.to_thread(
        VLLMEngine, _tiny_model(root), {0}, config, dtype="float32", memory_probe=probe
    )
    return engine, log


async def _is_sleeping(engine: VLLMEngine) -> bool:
    async with httpx.AsyncClient(base_url=engine.base_url, headers=engine.server.headers) as c:
        return bool((await c.get("/is_sleeping")).json()["is_sleeping"])


def _group(*rewards: float) -> jm.TrajectoryGroup:
    return jm.TrajectoryGroup(
        [
            jm.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "q"},
                    recorded_choice(prompt_token_ids=[1, 2, 3], token_ids=[4, 5]),
                ],
                reward=r,
            )
            for r in rewards
        ]
    )


# -- a training step through LocalBackend, the stand-in as its vLLM ------------------------------------


@pytest.fixture(scope="module")
async def trained(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Any, Any, Path]]:
    root = tmp_path_factory.mktemp("handoff")
    # an allocator setting vLLM's sleep mode cannot run under, beside one it can
    config, log = _standin(
        root, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,garbage_collection_threshold:0.6"}
    )
    backend = jm.LocalBackend(path=root / "runs", engine=config)
    model = jm.TrainableModel(name="handoff", project="tests")
    await model.register(backend)
    yield model, backend, log
    backend.close()


@pytest.mark.integration
async def test_a_step_sleeps_trains_then_wakes_weights_adapter_kv_cache(trained) -> None:
    """The stand-in sees one step as: sleep (level 2, requests in flight finish first), the trainer's
    work, then the staged wake: weights (and their re-read from disk), the new adapter, the KV cache."""
    model, backend, log = trained
    engine = backend.service(model).engine
    headers = engine.server.headers

    def mark(done: int, total: int) -> None:  # from the trainer's thread, mid-step
        httpx.post(f"{engine.base_url}/_mark", params={"what": "train"}, headers=headers)

    before = len(_calls(log))
    result = await backend.train(model, [_group(0.0, 1.0)], on_progress=mark)
    assert result.step == 1 and not result.skipped
    assert _calls(log)[before:] == [
        "sleep 2 wait",
        "mark train",
        "wake weights",
        "reload_weights",
        "load policy@1",
        "wake kv_cache",
    ]
    assert not await _is_sleeping(engine)
    samples = await engine.generate([1, 2, 3], SamplingParams(max_tokens=3))
    assert len(samples[0].token_ids) == 3 and _calls(log)[-1] == "complete policy@1"


@pytest.mark.integration
async def test_a_skipped_step_wakes_in_stages_with_the_served_adapter(trained) -> None:
    """No update (equal rewards): the wake still goes weights → adapter → KV cache, the served
    adapter loaded again in place (a level-2 re-read resets vLLM's LoRA state)."""
    model, backend, log = trained
    engine = backend.service(model).engine
    before = len(_calls(log))
    result = await backend.train(model, [_group(1.0, 1.0)])
    assert result.skipped and result.step == 1
    assert _calls(log)[before:] == [
        "sleep 2 wait",
        "wake weights",
        "reload_weights",
        "load policy@1 inplace",
        "wake kv_cache",
    ]
    assert not await _is_sleeping(engine) and engine.served_model == "policy@1"


@pytest.mark.integration
async def test_allocator_settings_that_break_sleep_mode_never_reach_vllm(trained) -> None:
    """expandable_segments is taken out of vLLM's environment (other allocator settings stay)."""
    _, _, log = trained
    assert _start_record(log)["alloc_conf"] == {
        "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6",
        "PYTORCH_ALLOC_CONF": None,
    }


# -- the engine alone: memory, timeouts, restarts ------------------------------------------------------


async def test_a_wake_that_does_not_fit_names_the_memory_and_fails_fast(tmp_path: Path) -> None:
    """The sleep released 8 GiB; at the wake 0.5 GiB is free and the trainer's allocator holds 7
    GiB. Weights (256 KiB here) and the adapter fit; the KV cache is refused before vLLM is asked,
    by an error that says needed, free, and who holds it. Requests fail at once meanwhile; once the
    memory is back, the next wake does only the stage left."""
    gpu = ScriptedGPU(1.0, 9.0, 0.5, reserved_gib=7.0)  # before sleep, after sleep, then at the wake
    engine, log = await _engine(tmp_path, gpu)
    try:
        await engine.sleep()
        with pytest.raises(WakeMemoryError) as e:
            await engine.load_adapter(_adapter(tmp_path, "step1"), 1)
        message = str(e.value)
        assert e.value.stage == "kv_cache" and e.value.free == GiB // 2
        assert e.value.needed >= 8 * GiB - 256 * 1024  # what the sleep released, less the weights
        for part in (
            "'kv_cache'",
            "8.12 GiB",
            "0.50 GiB",
            "of 80.00 GiB",
            "reserves 7.00 GiB",
            "process 4242",
        ):
            assert part in message, (part, message)
        assert _calls(log)[-3:] == ["wake weights", "reload_weights", "load policy@1"]
        assert await _is_sleeping(engine)
        t0 = time.perf_counter()
        with pytest.raises(EngineDownError, match="WakeMemoryError"):
            await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert time.perf_counter() - t0 < 1.0

        gpu.free = [20.0]  # the trainer let go
        await engine.wake()
        assert _calls(log)[-1] == "wake kv_cache" and _calls(log).count("wake weights") == 1
        assert not await _is_sleeping(engine)
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert _calls(log)[-1] == "complete policy@1"
    finally:
        engine.close()


def test_a_refused_first_stage_says_so_before_vllm_is_asked() -> None:
    """The weights stage of a 7B at bf16 (15.2 GB) against 4 GiB free: refused by name; no probe
    (the CPU) means no check."""
    gpu = ScriptedGPU(4.0, reserved_gib=60.0)
    with pytest.raises(WakeMemoryError) as e:
        check_fits("weights", 15_200_000_000, gpu)
    assert e.value.stage == "weights" and "14.28 GiB" in str(e.value) and "4.00 GiB" in str(e.value)
    check_fits("weights", 10**15, lambda: None)


async def test_a_wake_that_times_out_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    """vLLM takes 5 s to answer a wake; wake_timeout_s is 0.5 s: a VLLMWakeError naming the stage
    and the setting within a second, and the request that was waiting for the wake fails too."""
    engine, _ = await _engine(tmp_path, wake_timeout_s=0.5, env={"STANDIN_WAKE_DELAY_S": "5"})
    try:
        await engine.sleep()
        waiting = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # held at the gate while the engine sleeps
        t0 = time.perf_counter()
        with pytest.raises(VLLMWakeError, match=r"wake weights: .*within 0.5 s \(VLLMConfig.wake_timeout_s"):
            await engine.wake()
        assert time.perf_counter() - t0 < 2.0
        with pytest.raises(EngineDownError, match="did not wake"):
            await asyncio.wait_for(waiting, timeout=2.0)
    finally:
        engine.close()


async def test_a_server_killed_asleep_restarts_awake_when_the_step_ends(tmp_path: Path) -> None:
    """SIGKILL vLLM mid-step: no restart beside the trainer (a fresh server takes its whole budget
    at start-up); at the wake a fresh server starts, awake, on the new step's adapter, and serves."""
    engine, log = await _engine(tmp_path)
    try:
        await engine.load_adapter(_adapter(tmp_path, "step1"), 1)
        await engine.sleep()
        first = engine.server.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.down is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert engine.down is not None and "while asleep" in engine.down
        await asyncio.sleep(0.3)
        assert engine.restarts == 0 and not engine.server.alive()  # waits for the trainer

        await engine.load_adapter(_adapter(tmp_path, "step2"), 2)  # what the step's end does
        second = engine.server.pid
        assert engine.down is None and engine.restarts == 1 and second != first
        fresh = [c for c in _calls(log, second) if c != "health"]
        assert fresh == ["start", "load policy@2"]  # never put to sleep, never woken
        assert not await _is_sleeping(engine)
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert _calls(log, second)[-1] == "complete policy@2" and engine.served_model == "policy@2"
    finally:
        engine.close()


# -- settings passed to vLLM ---------------------------------------------------------------------------


def test_expandable_segments_is_stripped_from_vllms_environment_only_in_sleep_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    model = _tiny_model(tmp_path)
    sleeping = VLLMServer(model, VLLMConfig(python=sys.executable, sleep_mode=True, log_file=os.devnull))
    with caplog.at_level(logging.WARNING, logger="journeyman.vllm"):
        env = sleeping.environment()
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512" and "PYTORCH_ALLOC_CONF" not in env
    assert "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True,max_split_size_mb:512'" in caplog.text
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"  # ours is left alone
    awake = VLLMServer(model, VLLMConfig(python=sys.executable, sleep_mode=False, log_file=os.devnull))
    assert awake.environment()["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


def test_tensor_parallel_size_is_passed_and_must_fit_the_gpus(tmp_path: Path) -> None:
    server = VLLMServer(
        _tiny_model(tmp_path), VLLMConfig(python=sys.executable, tensor_parallel_size=2, log_file=os.devnull)
    )
    cmd = server.command()
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    with pytest.raises(InvalidFieldError) as e:
        check_layout(VLLMConfig(tensor_parallel_size=4, data_parallel_size=2), gpus=4)
    assert e.value.field == "tensor_parallel_size" and "needs 8 GPUs, but 4 are visible" in str(e.value)
    check_layout(VLLMConfig(tensor_parallel_size=4, data_parallel_size=2), gpus=8)
    check_layout(VLLMConfig(tensor_parallel_size=64), gpus=None)  # unknown (CPU): vLLM decides
    with pytest.raises(ValidationError):
        VLLMConfig(tensor_parallel_size=0)


def test_weight_bytes_are_read_from_the_headers_at_vllms_dtype(tmp_path: Path) -> None:
    _safetensors(
        tmp_path / "a.safetensors", {"w": ("F32", [256, 256]), "b": ("BF16", [4, 8]), "ids": ("I64", [3])}
    )
    assert weight_bytes(tmp_path, "float32") == 256 * 256 * 4 + 32 * 4 + 24
    assert weight_bytes(tmp_path, "bfloat16") == 256 * 256 * 2 + 32 * 2 + 24
    assert weight_bytes(tmp_path, "auto") == weight_bytes(tmp_path, None) == 256 * 256 * 4 + 32 * 2 + 24


# -- several models on one server ----------------------------------------------------------------------


async def test_models_on_one_base_share_one_server_each_under_its_own_adapter_names(tmp_path: Path) -> None:
    """A second model's engine samples on the first one's server: its steps are adapters of their
    own names, a step does not put the shared server to sleep (the other model's traffic goes on),
    a restart loads every model's served adapter again, and the server stops with the last model."""
    first, log = await _engine(tmp_path)
    second = await asyncio.to_thread(VLLMEngine, tmp_path / "model", {0}, share_with=first)
    try:
        assert second.server is first.server and second.shared and first.shared
        await first.load_adapter(_adapter(tmp_path, "a1"), 1)
        await second.load_adapter(_adapter(tmp_path, "b1"), 1)
        await asyncio.gather(
            first.generate([1, 2, 3], SamplingParams(max_tokens=2)),
            second.generate([1, 2, 3], SamplingParams(max_tokens=2)),
        )
        await second.generate([1, 2], SamplingParams(max_tokens=2, base=True))
        pid = first.server.pid
        calls = [c for c in _calls(log, pid) if c != "health"]
        assert calls[:3] == ["start", "load policy@1", "load policy-1@1"]
        assert sorted(calls[3:5]) == ["complete policy-1@1", "complete policy@1"]
        assert calls[5] == "complete policy"

        await second.sleep()  # what a step of the second model does first: the server stays awake
        assert not second.sleep_wake.asleep and not await _is_sleeping(first)
        await first.generate([1, 2, 3], SamplingParams(max_tokens=2))

        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (first.restarts == 0 or first.down is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert first.restarts == second.restarts == 1 and second.down is None
        fresh = [c for c in _calls(log, first.server.pid) if c != "health"]
        assert sorted(fresh[1:3]) == ["load policy-1@1", "load policy@1"]

        first.close()  # the second model still samples on it
        assert first.server.alive() and not first.alive and second.alive
        await second.generate([1, 2, 3], SamplingParams(max_tokens=2))
    finally:
        first.close()
        second.close()
    assert not second.server.alive()


def _max_loras(log: Path) -> list[int]:
    """`--max-loras` of each start of the server, in order."""
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    return [int(c["argv"][c["argv"].index("--max-loras") + 1]) for c in starts if c["method"] == "START"]


def test_a_server_holds_two_adapter_slots_a_model_doubled_as_models_join() -> None:
    assert [lora_slots(n, 2) for n in (1, 2, 3, 4, 5, 8, 9)] == [2, 4, 8, 8, 16, 16, 32]
    assert lora_slots(1, 1) == 1 and lora_slots(2, 1) == 4 and lora_slots(2, 6) == 6


async def test_a_model_joining_beyond_the_adapter_slots_restarts_the_server_with_twice_as_many(
    tmp_path: Path,
) -> None:
    """max_loras=2 holds one model's two steps: the second model's join restarts the shared server
    with 4 (`lora_slots`), the third's with 8, the fourth fits. A completion running at the join
    finishes on the old server, one asked meanwhile waits for the new one, which has the first
    model's served adapter loaded again before it answers."""
    first, log = await _engine(tmp_path, env={"STANDIN_COMPLETE_DELAY_S": "0.5"})
    joined: list[VLLMEngine] = []
    try:
        await first.load_adapter(_adapter(tmp_path, "a1"), 1)
        old_pid = first.server.pid
        running = asyncio.create_task(first.generate([1, 2, 3], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.2)  # on the server
        join = asyncio.create_task(asyncio.to_thread(VLLMEngine, tmp_path / "model", {0}, share_with=first))
        await asyncio.sleep(0.1)  # the join holds new requests back
        asked = asyncio.create_task(first.generate([1, 2], SamplingParams(max_tokens=2)))
        joined.append(await join)
        assert len(await running) == len(await asked) == 1
        assert first.config.max_loras == joined[0].config.max_loras == 4 and first.down is None
        assert _max_loras(log) == [2, 4] and first.server.pid != old_pid and first.restarts == 0
        assert [c for c in _calls(log, old_pid) if c != "health"][-1] == "complete policy@1"
        fresh = [c for c in _calls(log, first.server.pid) if c != "health"]
        assert fresh == ["start", "load policy@1", "complete policy@1"]

        for _ in range(2):
            joined.append(await asyncio.to_thread(VLLMEngine, tmp_path / "model", {0}, share_with=first))
        assert _max_loras(log) == [2, 4, 8] and joined[-1].config.max_loras == 8
        await joined[-1].generate([1, 2], SamplingParams(max_tokens=2))
    finally:
        for engine in [first, *joined]:
            engine.close()
    assert not first.server.alive()
