"""A verifiers environment in its own interpreter, driven over stdin/stdout by `_verifiers.py`.

verifiers pins what this workspace cannot take (0.3 wants `mcp<2`; 0.4 wants `mcp==2.0.0` and has
no classic surface), and an environment brings its own packages too, so the environment runs in
whichever Python has verifiers installed (`python=` in the SPEC), and this file is all it needs
there: the standard library and verifiers, never journeyman.

The protocol, one JSON object a line:
- in:  `{"op": "load", "target": ..., "args": {...}}`, then `{"op": "rollout", "id": k, "split": ...,
  "index": i, "base_url": ..., "api_key": ..., "model": ..., "headers": {...}, "sampling": {...},
  "timeout_s": t}` any number of times, concurrently; end of input ends the worker;
- out: `{"op": "ready", "name": ..., "version": ..., "sizes": {"train": n, "eval": m}}` (or
  `{"op": "error", "error": ...}`), then `{"op": "result", "id": k, "reward": r, "metrics": {...}}`
  or `{"op": "result", "id": k, "error": ...}` per rollout, in the order they finish.

Each rollout goes through verifiers' own `Environment.run_rollout` with a `ClientConfig` whose
`extra_headers` carry the episode's capture id, so the Journeyman endpoint files every completion
the environment asks for, turn after turn and tool call after tool call, under that episode.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

API_KEY_VAR = "JOURNEYMAN_VERIFIERS_API_KEY"


def load_target(target: str, args: dict[str, Any]) -> Any:
    """The environment `target` names: a `.py` file or a module (its `load_environment(**args)`), or a
    dotted path to a callable such as `verifiers.ReasoningGymEnv` (called with `args`)."""
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise LookupError(f"no such file: {target}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise LookupError(f"cannot import {target}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return _call_load_environment(module, target, args)
    try:
        module = importlib.import_module(target.replace("-", "_"))
    except ModuleNotFoundError as e:
        parent, _, attr = target.rpartition(".")
        if not parent or e.name not in (target, target.replace("-", "_")):
            raise LookupError(f"cannot import {target!r}: {e}") from e
        factory = getattr(importlib.import_module(parent), attr, None)
        if not callable(factory):
            raise LookupError(f"{parent!r} has no callable {attr!r}") from e
        return factory(**args)
    return _call_load_environment(module, target, args)


def _call_load_environment(module: Any, target: str, args: dict[str, Any]) -> Any:
    load_environment = getattr(module, "load_environment", None)
    if not callable(load_environment):
        raise LookupError(
            f"{target!r} has no load_environment(**kwargs): a verifiers environment module defines one"
        )
    return load_environment(**args)


def dataset_rows(env: Any) -> dict[str, list[dict[str, Any]]]:
    """The environment's own splits: its eval dataset for eval, its dataset for train; one that
    declares no eval dataset is evaluated on the last fifth of its dataset, never trained on it."""

    def rows(method: str) -> list[dict[str, Any]]:
        try:
            dataset = getattr(env, method)()
        except (ValueError, TypeError, AttributeError):
            return []  # verifiers raises when a split is not declared
        return [dict(row) for row in dataset] if dataset is not None else []

    train, held = rows("get_dataset"), rows("get_eval_dataset")
    if not held and len(train) > 1:
        cut = len(train) - max(1, len(train) // 5)
        train, held = train[:cut], train[cut:]
    return {"train": train, "eval": held}


async def run_rollout(env: Any, row: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """One rollout of `row` through verifiers' `run_rollout`, the model reached at the request's
    `base_url` with its `headers`: the reward and metrics its rubric gave."""
    from verifiers.types import ClientConfig  # pyright: ignore[reportMissingImports]  # the worker's interpreter has it

    os.environ[API_KEY_VAR] = request.get("api_key") or "EMPTY"
    config = ClientConfig(
        api_base_url=request["base_url"],
        api_key_var=API_KEY_VAR,
        extra_headers=request.get("headers") or {},
        timeout=float(request.get("timeout_s") or 600.0),
        max_retries=0,
    )
    output = await env.run_rollout(
        input=row, client=config, model=request["model"], sampling_args=request.get("sampling") or {}
    )
    error = output.get("error")
    if error:
        raise RuntimeError(f"the rollout ended in error: {_error_text(error)}")
    metrics = {str(k): v for k, v in (output.get("metrics") or {}).items()}
    if output.get("is_truncated") is not None:
        metrics["truncated"] = float(bool(output["is_truncated"]))
    return {
        "reward": output.get("reward"),
        "metrics": metrics,
        "stop_condition": output.get("stop_condition"),
    }


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('error', '')}: {error.get('message', error)}"  # pyright: ignore[reportUnknownMemberType]
    return str(error)


def _json_number(value: Any) -> Any:
    """JSON cannot carry NaN or inf: they go as strings, which the caller refuses by name."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


async def serve(reader: asyncio.StreamReader, write: Any) -> None:
    first = json.loads(await reader.readline() or b"{}")
    try:
        env = load_target(first["target"], first.get("args") or {})
        for needed in ("run_rollout", "get_dataset"):
            if not hasattr(env, needed):
                raise LookupError(
                    f"the loaded {type(env).__name__} has no {needed!r}: not a verifiers Environment"
                )
        splits = dataset_rows(env)
    except Exception as e:
        write(
            {"op": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        )
        return
    import verifiers  # pyright: ignore[reportMissingImports]

    write(
        {
            "op": "ready",
            "name": type(env).__name__,
            "version": getattr(verifiers, "__version__", "?"),
            "sizes": {split: len(rows) for split, rows in splits.items()},
        }
    )

    async def one(request: dict[str, Any]) -> None:
        try:
            row = splits[request["split"]][int(request["index"])]
            done = await run_rollout(env, row, request)
            write(
                {
                    "op": "result",
                    "id": request["id"],
                    "reward": _json_number(done["reward"]),
                    "metrics": {k: _json_number(v) for k, v in done["metrics"].items()},
                    "stop_condition": done["stop_condition"],
                }
            )
        except Exception as e:
            write({"op": "result", "id": request["id"], "error": f"{type(e).__name__}: {e}"})

    running: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        request = json.loads(line)
        if request.get("op") == "rollout":
            task = asyncio.ensure_future(one(request))
            running.add(task)
            task.add_done_callback(running.discard)
    for task in list(running):
        task.cancel()


def main() -> None:
    # The protocol owns the real stdout; whatever the environment prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def write(message: dict[str, Any]) -> None:
        out.write(json.dumps(message, default=str) + "\n")
        out.flush()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2**24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await serve(reader, write)

    asyncio.run(run())


if __name__ == "__main__":
    main()
