"""The GPU-memory side of the handoff between the trainer and a sleeping vLLM on one device.

A training step's order (`LocalBackend._step`, `VLLMEngine`): vLLM sleeps (requests in flight
finish first) → the trainer steps → the trainer's cached CUDA blocks go back to the driver
(`return_cached_memory`) → vLLM wakes in stages: its weights, then the step's adapter, then its KV
cache. Before each stage `check_fits` compares what the stage will map with the device's free
memory and refuses by name (`WakeMemoryError`: needed, free, and who holds the rest) instead of
letting vLLM run out of memory mid-wake, which kills its engine core; the restart that follows
would need the same memory and fail the same way.

What a stage needs, per device: the weights stage the checkpoint's bytes at vLLM's dtype over the
tensor-parallel size (`weight_bytes`); the adapter stage the adapter file; the KV cache what the
sleep released beyond the weights, measured as the rise in free memory across the sleep. Without
CUDA there is nothing to measure and every check passes (`cuda_memory` answers None).
"""

from __future__ import annotations

import gc
import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from journeyman.errors import WakeMemoryError

log = logging.getLogger("journeyman.vllm")

GiB = 1024**3
# Room left beside a stage's own bytes: the driver maps in 2 MiB granules, and the reading of free
# memory and the wake are not one atomic step.
WAKE_HEADROOM_BYTES = 128 * 1024**2

Stage = Literal["weights", "adapter", "kv_cache", "restart"]

# safetensors' dtype names → bytes per element
_SAFETENSORS_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
_FLOAT = {"F64", "F32", "F16", "BF16"}
# vLLM's --dtype → bytes per floating-point element (None: the checkpoint's own)
_DTYPE_BYTES: dict[str, int | None] = {
    "auto": None, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
}  # fmt: skip


class DeviceMemory(BaseModel):
    """One reading of a device's memory, and what this process's torch allocator holds of it."""

    device: str = Field(description="e.g. cuda:0")
    free_bytes: int = Field(ge=0, description="free on the device, all processes counted (cudaMemGetInfo)")
    total_bytes: int = Field(ge=0)
    reserved_here: int = Field(default=0, ge=0, description="this process's torch allocator: reserved")
    allocated_here: int = Field(default=0, ge=0, description="... of which live tensors")
    processes: str = Field(
        default="", description="per-process use where NVML can say (torch.cuda.list_gpu_processes)"
    )


MemoryProbe = Callable[[], "DeviceMemory | None"]


def cuda_memory() -> DeviceMemory | None:
    """The current CUDA device's memory now; None where this process has not used CUDA (the CPU, a
    trainer on the CPU): asking would create a CUDA context, itself a few hundred MiB of the GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    try:  # needs pynvml; says so in its answer when absent
        processes = torch.cuda.list_gpu_processes(device)
    except Exception:  # only an aid to the message
        processes = ""
    if "not found" in processes or "pynvml" in processes:
        processes = ""
    return DeviceMemory(
        device=f"cuda:{device}",
        free_bytes=int(free),
        total_bytes=int(total),
        reserved_here=int(torch.cuda.memory_reserved(device)),
        allocated_here=int(torch.cuda.memory_allocated(device)),
        processes=processes.strip(),
    )


def return_cached_memory() -> int:
    """Give this process's cached, unused CUDA blocks back to the driver; the bytes returned.

    PyTorch's caching allocator keeps the blocks a training step freed (activations, gradients'
    scratch) for its next allocation: the driver counts them as used, so without this a woken vLLM
    finds them taken. A no-op without CUDA."""
    try:
        import torch
    except ImportError:
        return 0
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    gc.collect()  # tensors kept only by reference cycles (a step's autograd graph) are freed first
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    returned = before - torch.cuda.memory_reserved()
    log.info("returned %.2f GiB of the trainer's cached CUDA memory to the driver", returned / GiB)
    return returned


def weight_bytes(model_dir: Path, dtype: str | None) -> int:
    """The bytes a checkpoint's tensors take at `dtype` (vLLM's --dtype; "auto"/None: as stored),
    read from the safetensors headers alone. 0 for a directory without safetensors."""
    per_element = _DTYPE_BYTES.get(dtype or "auto")
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for entry in _safetensors_header(path).values():
            if not isinstance(entry, dict) or "dtype" not in entry:
                continue  # __metadata__
            kind = str(entry["dtype"])
            numel = 1
            for n in entry["shape"]:
                numel *= int(n)
            size = (
                per_element
                if (per_element is not None and kind in _FLOAT)
                else _SAFETENSORS_BYTES.get(kind, 4)
            )
            total += numel * size
    return total


def _safetensors_header(path: Path) -> dict[str, object]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))  # little-endian u64, then that many bytes of JSON
        return json.loads(f.read(length))


def adapter_bytes(path: Path) -> int:
    """The adapter's tensor bytes on disk (what loading it copies into vLLM's LoRA slots)."""
    return sum(f.stat().st_size for f in Path(path).glob("adapter_model.*"))


def check_fits(stage: Stage, needed: int, probe: MemoryProbe, *, what: str = "vLLM's wake") -> None:
    """Refuse `stage` with a WakeMemoryError when `needed` bytes (plus WAKE_HEADROOM_BYTES) exceed
    the device's free memory; pass when the probe has nothing to read (no CUDA)."""
    reading = probe()
    if reading is None or needed <= 0:
        return
    if needed + WAKE_HEADROOM_BYTES <= reading.free_bytes:
        return
    holders = (
        f"this process's torch allocator reserves {reading.reserved_here / GiB:.2f} GiB "
        f"({reading.allocated_here / GiB:.2f} GiB in live tensors, the rest cached)"
    )
    if reading.processes:
        holders += "; by process: " + " | ".join(line.strip() for line in reading.processes.splitlines())
    raise WakeMemoryError(
        stage=stage,
        needed=needed + WAKE_HEADROOM_BYTES,
        free=reading.free_bytes,
        total=reading.total_bytes,
        device=reading.device,
        holders=holders,
        what=what,
    )


__all__ = [
    "WAKE_HEADROOM_BYTES",
    "DeviceMemory",
    "MemoryProbe",
    "Stage",
    "adapter_bytes",
    "check_fits",
    "cuda_memory",
    "return_cached_memory",
    "weight_bytes",
]
