"""Start and supervise vLLM's OpenAI-compatible server as a child process on 127.0.0.1.

vLLM pins its own torch, so it usually lives in a separate virtual environment: the interpreter
that runs it is configurable (`VLLMConfig.python`). The child never outlives this process: it is
started from a supervisor thread that lives as long as the child, with PR_SET_PDEATHSIG on Linux (the
kernel sends SIGTERM when that thread's process dies, even on SIGKILL), in its own process group (so
`close` also reaches vLLM's engine-core subprocesses), and an `atexit` hook stops it on a normal exit.

Any local user can reach 127.0.0.1, so the server requires a random API key (`VLLMServer.api_key`),
which every call the engine makes sends as a bearer token. It is handed over in the environment
(`VLLM_API_KEY`, what `--api-key` sets), not on the command line, which every local user can read.
What vLLM guards with it depends on its version: up to the releases that check only `/v1` paths,
`/v1/completions` and `/v1/load_lora_adapter` are guarded, `/sleep`, `/wake_up` and the other
dev-mode routes are not; later ones guard every route but `/health`, `/ping`, `/metrics` and the docs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from journeyman.engine import vllm_env
from journeyman.errors import InvalidFieldError, JourneymanError

log = logging.getLogger("journeyman.vllm")

# vLLM accepts only these LoRA ranks for --max-lora-rank.
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMConfig(BaseModel):
    """How to run vLLM as the engine: `jm.LocalBackend(engine=jm.VLLMConfig(...))`."""

    model_config = ConfigDict(extra="forbid")

    python: str | None = Field(
        default=None,
        description="interpreter that runs vLLM (vLLM pins its own torch: a separate venv is normal). "
        "Default: this interpreter if it can import vllm, else the environment built by "
        "`python -m journeyman.engine.vllm_env` ($JOURNEYMAN_VLLM_ENV).",
    )
    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="fraction of GPU memory vLLM may take (CUDA). The trainer shares the GPU: vLLM sleeps "
        "during each training step, but the trainer's own weights stay resident.",
    )
    max_model_len: int = Field(default=4096, ge=16, description="prompt + completion tokens per sequence")
    dtype: str | None = Field(
        default=None,
        description="vLLM --dtype; default: the backend's, chosen by device (bfloat16 on a GPU with bf16, "
        "float32 on CPU, where bf16 logprobs drift further from the trainer's)",
    )
    max_loras: int = Field(
        default=2, ge=1, description="adapters resident at once (the newest step and the one before)"
    )
    max_lora_rank: int | None = Field(
        default=None, description="default: the model's LoRA rank, rounded up to one vLLM accepts"
    )
    lora_target_modules: list[str] | None = Field(
        default=None,
        description="module suffixes vLLM applies LoRA to (--lora-target-modules). Default: every linear "
        "layer of the checkpoint except the embeddings and lm_head, which is what PEFT's 'all-linear' trains",
    )
    sleep_mode: bool | None = Field(
        default=None,
        description="sleep during training steps to free the GPU for the trainer. Default: on when CUDA is "
        "available; vLLM does not support sleep on CPU.",
    )
    sleep_level: Literal[1, 2] = Field(
        default=2,
        description="how vLLM sleeps through a training step. 2 (default): its weights are discarded and "
        "re-read from the checkpoint on disk at the wake (POST /collective_rpc reload_weights); the base "
        "is frozen under LoRA, so the file holds exactly what was dropped, no host RAM is held and "
        "nothing is copied device -> host. 1: the weights are copied device -> host at every sleep and "
        "back at every wake, holding a pinned host copy (a 7B in bf16: 15 GB each way, ~0.6 s per copy "
        "at 25 GB/s PCIe, against a ~1.5-5 s re-read at level 2 from the page cache or an NVMe disk). "
        "Take 1 when the disk is slow (a network mount) and host RAM is plentiful. docs/scale.md, "
        "'Memory handoff'",
    )
    wake_timeout_s: float = Field(
        default=300.0,
        gt=0.0,
        description="how long one stage of a wake (weights, adapter, KV cache) may take before it fails "
        "with VLLMWakeError; a level-2 re-read of a large checkpoint from a slow disk takes longest",
    )
    cpu_kvcache_gb: float = Field(
        default=2.0, gt=0.0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE), GiB"
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        description="inference replicas inside one vLLM server (--data-parallel-size: one per GPU; "
        "vLLM balances requests across them and loads each new adapter on every one)",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="GPUs each replica's weights are split across (--tensor-parallel-size), for a base "
        "that does not fit one GPU beside the trainer; replicas x this many GPUs must be visible",
    )
    startup_timeout_s: float = Field(
        default=600.0, gt=0.0, description="how long to wait for the server to become healthy"
    )
    request_timeout_s: float = Field(default=900.0, gt=0.0, description="per-request HTTP timeout")
    extra_args: list[str] = Field(default_factory=list, description="more `api_server` flags, appended last")
    env: dict[str, str] = Field(default_factory=dict, description="more environment variables for the server")
    log_file: str | None = Field(
        default=None, description="where the server's output goes; default: a temp file"
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="times a server that exits on its own is restarted (and the served adapter loaded "
        "again) before the engine stays down; requests it held fail with EngineDownError either way",
    )


def check_layout(config: VLLMConfig, gpus: int | None) -> None:
    """Refuse a layout that needs more GPUs than `gpus` (None: unknown, e.g. on the CPU)."""
    need = config.tensor_parallel_size * config.data_parallel_size
    if gpus is not None and need > gpus:
        raise InvalidFieldError(
            "tensor_parallel_size",
            config.tensor_parallel_size,
            f"x data_parallel_size={config.data_parallel_size} needs {need} GPUs, but {gpus} are visible "
            "(CUDA_VISIBLE_DEVICES); lower either",
        )


# Allocator settings vLLM's sleep mode cannot run under. Its CuMemAllocator maps weights and KV cache
# into a memory pool, and PyTorch's expandable segments do not work with memory pools
# (pytorch/pytorch#147851): vLLM releases before the pool toggle asserted on it at start-up
# (vllm/device_allocator/cumem.py: "Expandable segments are not compatible with memory pool").
_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_BREAKS_SLEEP = "expandable_segments"


def strip_sleep_breaking_alloc_conf(env: dict[str, str]) -> list[str]:
    """Remove `expandable_segments` from PyTorch's allocator settings in `env` (other settings stay);
    the variables changed, for the log."""
    changed = []
    for var in _ALLOC_CONF_VARS:
        conf = env.get(var)
        if conf is None or _BREAKS_SLEEP not in conf:
            continue
        kept = [f for f in conf.split(",") if f.split(":")[0].strip() != _BREAKS_SLEEP and f.strip()]
        if kept:
            env[var] = ",".join(kept)
        else:
            del env[var]
        changed.append(f"{var}={conf!r} -> {env.get(var, '(unset)')!r}")
    return changed


class VLLMStartError(JourneymanError, RuntimeError):
    """The vLLM server exited or did not become healthy in time. The message ends with its log's tail."""


def resolve_python(config: VLLMConfig) -> str:
    """The interpreter to run vLLM with (see `VLLMConfig.python`)."""
    if config.python:
        if not Path(config.python).exists():
            raise InvalidFieldError("python", config.python, "no such interpreter")
        return config.python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if vllm_env.is_provisioned():
        return str(vllm_env.env_python())
    raise InvalidFieldError(
        "python",
        None,
        "this interpreter cannot import vllm and no vLLM environment is provisioned. On the CPU, "
        + vllm_env.provision_hint()
        # No `journeyman[vllm]` extra: vLLM pins its own torch, so it gets an environment of its own.
        + ". On CUDA: python3 -m venv VENV && VENV/bin/pip install vllm, then "
        'VLLMConfig(python="VENV/bin/python")',
    )


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def cuda_device_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def linear_module_suffixes(model_dir: Path) -> list[str]:
    """Suffixes of the checkpoint's 2-D weights (its linear layers), without embeddings and lm_head.

    vLLM wraps lm_head for LoRA unless told otherwise; our adapters never train it (PEFT's
    'all-linear' skips the output layer), and that wrapper costs a vocabulary-sized LoRA matmul per
    token and, in vllm-cpu 0.32, crashes the engine on `prompt_logprobs` when more than one request
    is in the batch (punica CPU `bgmv_shrink` broadcasts per-request indices over prompt tokens).
    """
    from safetensors import safe_open

    found: set[str] = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                parts = key.split(".")
                if len(parts) >= 2 and parts[-1] == "weight" and len(st.get_slice(key).get_shape()) == 2:
                    found.add(parts[-2])
    return sorted(found - {"embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out"})


def lora_slots(models: int, max_loras: int) -> int:
    """`--max-loras` (adapters in one batch) of a server that `models` models on one base share: two
    a model (its served step, and the one before while requests still run on it), `max_loras` (the
    first model's) doubled until they fit, so a server restarts for it once a doubling
    (`VLLMEngine(share_with=)`), not once a model. One model: `max_loras` as configured."""
    slots = max_loras
    while models > 1 and slots < 2 * models:
        slots *= 2
    return slots


def lora_rank_for(r: int) -> int:
    for rank in _LORA_RANKS:
        if rank >= r:
            return rank
    raise InvalidFieldError("lora.r", r, f"vLLM serves LoRA ranks up to {_LORA_RANKS[-1]}")


class VLLMServer:
    """One vLLM OpenAI server process serving `model_dir` (base name `served_name`) with runtime LoRA."""

    def __init__(
        self,
        model_dir: Path,
        config: VLLMConfig,
        *,
        served_name: str = "base",
        dtype: str = "float32",
        lora_rank: int = 8,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.served_name = served_name
        self.dtype = config.dtype or dtype
        self.lora_rank = config.max_lora_rank or lora_rank_for(lora_rank)
        self.lora_target_modules = config.lora_target_modules or linear_module_suffixes(self.model_dir)
        self.python = resolve_python(config)
        self.cuda = cuda_available()
        check_layout(config, cuda_device_count() if self.cuda else None)
        self.sleep_mode = self.cuda if config.sleep_mode is None else config.sleep_mode
        self.port = 0
        # the bearer token the server requires; `--api-key` among `extra_args` wins, as in vLLM
        self.api_key = _flag(config.extra_args, "--api-key") or secrets.token_urlsafe(32)
        self.log_path = Path(config.log_file) if config.log_file else self._temp_log()
        self.startup_seconds = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._watcher: threading.Thread | None = None
        self._closed = False
        # called with the exit code when the server exits without `stop()`: a crash, an OOM kill
        self.on_exit: Callable[[int], None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What every request to the server carries: its API key."""
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        c = self.config
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",  # `vllm serve` fails with vllm-cpu's package metadata
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(c.max_model_len),
            "--enable-lora",
            "--max-lora-rank",
            str(self.lora_rank),
            "--max-loras",
            str(c.max_loras),
            # Our trainer computes raw (temperature-1, unfiltered) logprobs; ask vLLM for the same.
            "--logprobs-mode",
            "raw_logprobs",
            # Defaults come from the request, not the model's generation_config.json.
            "--generation-config",
            "vllm",
            "--disable-uvicorn-access-log",
        ]
        if self.lora_target_modules:  # empty: a checkpoint without safetensors, vLLM's own choice
            cmd += ["--lora-target-modules", *self.lora_target_modules]
        if self.cuda:
            cmd += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        else:
            # vLLM's CPU build kills its engine core on a seeded request whose prefill is chunked: it
            # rewinds the request's generator, which a CPU generator cannot do ("CPU Generator does
            # not use offset"). Unchunked, a prompt is prefilled in one step (the batch budget
            # rises to max_model_len).
            cmd += ["--no-enable-chunked-prefill"]
        if self.sleep_mode:
            cmd += ["--enable-sleep-mode"]
        if c.data_parallel_size > 1:
            cmd += ["--data-parallel-size", str(c.data_parallel_size)]
        if c.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(c.tensor_parallel_size)]
        return cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The parent's venv must not leak into vLLM's interpreter.
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(key, None)
        ncpu = os.cpu_count() or 1
        env.update(
            {
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": f"{self.config.cpu_kvcache_gb:g}",
            }
        )
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncpu - 1}")
        if self.sleep_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /sleep, /wake_up and /collective_rpc
        env.update(self.config.env)
        if self.sleep_mode:
            for change in strip_sleep_breaking_alloc_conf(env):
                log.warning(
                    "not passed to vLLM: %s (sleep mode's memory pool cannot run with expandable "
                    "segments, pytorch#147851; this process keeps its own setting)",
                    change,
                )
        env["VLLM_API_KEY"] = self.api_key  # in the environment: a command line is world-readable
        return env

    def start(self) -> None:
        """Start the process and block until `/health` answers (or raise `VLLMStartError`)."""
        t0 = time.monotonic()
        for attempt in range(2):  # a second try only if another process took our free port
            self.port = free_port()
            self._spawn()
            try:
                self._wait_healthy(t0 + self.config.startup_timeout_s)
                break
            except VLLMStartError:
                self.stop()
                if attempt == 0 and "address already in use" in self.log_tail(40).lower():
                    self._closed = False
                    continue
                raise
        self.startup_seconds = time.monotonic() - t0
        log.info("vLLM ready on %s in %.1f s (log: %s)", self.base_url, self.startup_seconds, self.log_path)

    def _spawn(self) -> None:
        if self._closed:  # stopped while a restart was on its way: never a server nobody owns
            raise VLLMStartError("the vLLM server was stopped")
        cmd, env = self.command(), self.environment()
        started = threading.Event()
        failure: list[BaseException] = []

        def supervise() -> None:
            # Popen from this thread: PR_SET_PDEATHSIG fires when the *thread* that forked the child
            # exits, so that thread must live exactly as long as the child.
            try:
                with open(self.log_path, "ab") as out:
                    self._proc = subprocess.Popen(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=tempfile.gettempdir(),
                        start_new_session=True,
                        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                    )
            except BaseException as e:
                failure.append(e)
                started.set()
                return
            if sys.platform == "linux":
                # vLLM ignores SIGTERM while it starts up, and its engine-core process outlives a
                # killed API server; this watchdog SIGKILLs the whole group when we die.
                subprocess.Popen(
                    [sys.executable, "-c", _WATCHDOG, str(self._proc.pid)],
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent,
                )
            started.set()
            proc = self._proc
            code = proc.wait()
            if not self._closed and proc is self._proc and self.on_exit is not None:
                self.on_exit(code)

        self._watcher = threading.Thread(target=supervise, name="journeyman-vllm-supervisor", daemon=True)
        self._watcher.start()
        started.wait()
        if failure:
            raise VLLMStartError(f"could not start {cmd[0]}: {failure[0]}") from failure[0]
        _LIVE.add(self)
        log.info("starting vLLM: %s", " ".join(cmd))

    def _wait_healthy(self, deadline: float) -> None:
        assert self._proc is not None
        with httpx.Client(timeout=5.0, headers=self.headers) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise VLLMStartError(
                        f"the vLLM server exited with code {code} before it was ready "
                        f"(log: {self.log_path}):\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise VLLMStartError(
                        f"the vLLM server was not healthy after {self.config.startup_timeout_s:.0f} s "
                        f"(VLLMConfig.startup_timeout_s; log: {self.log_path}):\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def relaunch(self, config: VLLMConfig) -> None:
        """Stop this server and start a fresh one with `config`: a restart on purpose, which
        `on_exit` is not told of (the old process's exit is no crash)."""
        self.stop()
        self.config, self._closed = config, False
        self.start()

    def restart(self) -> None:
        """A fresh server after this one exited on its own; what is left of the old process group
        (vLLM's engine-core outlives a killed API server) is killed first."""
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGKILL)
        self.start()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines)).rstrip()
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `timeout`. Idempotent."""
        self._closed = True
        _LIVE.discard(self)
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("vLLM (pid %d) ignored SIGTERM for %.0f s; killing it", proc.pid, timeout)
        # vLLM's engine-core workers share the group; make sure none outlives the server.
        _signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    def _temp_log(self) -> Path:
        fd, name = tempfile.mkstemp(prefix="journeyman-vllm-", suffix=".log")
        os.close(fd)
        return Path(name)


def _flag(args: list[str], name: str) -> str | None:
    """The value given to `name` in `args` (`--name value` or `--name=value`), else None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # start_new_session: the group id is the server's pid


_PR_SET_PDEATHSIG = 1

# Gets SIGTERM when the process that started vLLM dies (PR_SET_PDEATHSIG); kills vLLM's process
# group then. Exits by itself once the group is gone.
_WATCHDOG = """
import os, signal, sys, time
group = int(sys.argv[1])
def kill(*_):
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
    os._exit(0)
signal.signal(signal.SIGTERM, kill)
while True:
    try:
        os.killpg(group, 0)
    except OSError:
        os._exit(0)
    time.sleep(1)
"""


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM me when my parent (thread) dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# Servers still running; stopped at interpreter exit (a normal exit, an unhandled exception).
_LIVE: set[VLLMServer] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout=10)
