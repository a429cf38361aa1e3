"""`load(spec)`: an environment named by one string, as `journeyman train|eval --env SPEC` take it.

- `module:function` (or `path/to/file.py:function`): a callable that returns an `Environment`, or a
  pair `(rollout, tasks)` for `from_function`;
- `gym:<module>:<id>[:key=value,...]`: `<module>.make(<id>, **kwargs)`, a gym-style text game;
- `verifiers:<module-or-file>[:key=value,...]`: a verifiers environment, `load_environment(**kwargs)`
  (or a dotted path to an environment class, `verifiers.ReasoningGymEnv`), run in a worker of the
  Python named by `python=...` (default: this one);
- `openenv:<url>[:key=value,...]`: an OpenEnv environment server, one session WebSocket an episode
  (`max_turns`, `action_field`, `sessions`, `timeout_s`, ... of `OpenEnvEnvironment`).

Values in `key=value` are read as JSON where they parse (`n=5`, `hard=true`), else as strings.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from journeyman.environments._protocol import Environment, from_function
from journeyman.errors import InvalidFieldError

SCHEMES = ("gym", "verifiers", "openenv")


def load(spec: str | Environment) -> Environment:
    """The environment `spec` names (an Environment is returned as it is)."""
    if not isinstance(spec, str):
        if isinstance(spec, Environment):
            return spec
        raise InvalidFieldError("spec", spec, "give a SPEC string or an Environment")
    scheme, _, rest = spec.partition(":")
    if not rest:
        raise InvalidFieldError("spec", spec, _USAGE)
    if scheme == "gym":
        from journeyman.environments._gym import make_gym

        module, _, tail = rest.partition(":")
        env_id, _, args = tail.partition(":")
        if not module or not env_id:
            raise InvalidFieldError("spec", spec, "write gym:<module>:<id>[:key=value,...]")
        return make_gym(module, env_id, parse_args(args, spec))
    if scheme == "verifiers":
        from journeyman.environments._verifiers import verifiers

        target, args = _split_args(rest)
        return verifiers(target, **parse_args(args, spec))
    if scheme == "openenv":
        from journeyman.environments._openenv import OpenEnvEnvironment

        url, args = _split_args(rest)
        options = parse_args(args, spec)
        try:
            return OpenEnvEnvironment(url, **options)
        except TypeError as e:
            raise InvalidFieldError("spec", spec, f"OpenEnvEnvironment takes no such option: {e}") from e
    return _from_callable(spec)


_USAGE = "write module:function, gym:<module>:<id>, verifiers:<module>[:key=value,...] or openenv:<url>[:key=value,...]"


def _split_args(rest: str) -> tuple[str, str]:
    """`target[:k=v,...]`, where a Windows-free target never holds `=`: the last `:` before a `k=v`."""
    target, sep, args = rest.rpartition(":")
    if sep and "=" in args and "=" not in target:
        return target, args
    return rest, ""


def parse_args(args: str, spec: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise InvalidFieldError("spec", spec, f"{part!r} is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def import_target(target: str, spec: str) -> Any:
    """A module by dotted name, or a `.py` file by path (imported under its stem)."""
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise InvalidFieldError("spec", spec, f"no such file: {target}")
        name = f"_journeyman_env_{path.stem}"
        loader = importlib.util.spec_from_file_location(name, path)
        if loader is None or loader.loader is None:
            raise InvalidFieldError("spec", spec, f"cannot import {target}")
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        loader.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise InvalidFieldError("spec", spec, f"cannot import {target!r}: {e}") from e


def _from_callable(spec: str) -> Environment:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise InvalidFieldError("spec", spec, _USAGE)
    module = import_target(target, spec)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InvalidFieldError("spec", spec, f"{target!r} has no callable {attr!r}")
    made = factory()
    if isinstance(made, Environment):
        return made
    if isinstance(made, tuple) and len(made) == 2 and callable(made[0]):  # pyright: ignore[reportUnknownArgumentType]
        rollout, tasks = made  # pyright: ignore[reportUnknownVariableType]
        return from_function(rollout, tasks, name=attr)  # pyright: ignore[reportUnknownArgumentType]
    raise InvalidFieldError(
        "spec", spec, f"{attr}() returned {type(made).__name__}: return an Environment or (rollout, tasks)"
    )
