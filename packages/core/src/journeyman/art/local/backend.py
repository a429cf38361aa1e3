"""`art.local.backend.LocalBackend` (also `art.local.LocalBackend`): Journeyman's LocalBackend with
ART's constructor, `backend.train` call shape and result, `with`/`await backend.close()`, and ART's
object-storage method names."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

import journeyman as jm
from journeyman.art._model import TrainableModel, as_groups
from journeyman.art._types import LocalTrainResult, journeyman_config
from journeyman.art._unsupported import refuse
from journeyman.art.dev import ART_TRAIN_NAMES, warn_unsupported
from journeyman.backends.local import LocalBackend as _LocalBackend
from journeyman.client.protocol import Progress
from journeyman.data.config import ModelConfig
from journeyman.errors import InvalidFieldError

ART_PATH = ".art"
"""ART's default run root: `.art/<project>/models/<name>/`, the layout Journeyman's runs have too."""


class _Closed:
    """What `close()` returns: closing is done already; awaiting it (ART's `await backend.close()`) is a no-op."""

    def __await__(self) -> Generator[Any, None, None]:
        yield from ()


class LocalBackend(_LocalBackend):
    """`LocalBackend(in_process=..., path=...)` as ART spells it; everything else is Journeyman's
    (`engine="vllm"` or a `jm.VLLMConfig` for vLLM, `device`, `report_to`, ...).

    `in_process`: ART's choice of running vLLM in this process or a child; Journeyman's engine runs
    in this process either way (vLLM, when chosen, is its own server process), so it changes nothing.
    `enable_expert_replay`: ART's routing replay for mixture-of-experts models; Journeyman trains on
    the sampled tokens' own forward pass, so it changes nothing either. `gpu_cost_per_hour_usd`
    raises ArtFeatureNotSupported."""

    def __init__(
        self,
        *,
        in_process: bool = False,
        path: str | Path | None = None,
        gpu_cost_per_hour_usd: float | None = None,
        enable_expert_replay: bool = True,
        **options: Any,
    ) -> None:
        if gpu_cost_per_hour_usd is not None:
            refuse("art.local.LocalBackend(gpu_cost_per_hour_usd=)")
        del in_process, enable_expert_replay  # see the class docstring: the same either way here
        super().__init__(ART_PATH if path is None else path, **options)

    async def train(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        model: ModelConfig,
        groups: Iterable[Any],
        config: jm.TrainConfig | None = None,
        *,
        idempotency_key: str | None = None,
        on_progress: Progress | None = None,
        trained_by: str | None = None,
        **art_settings: Any,
    ) -> Any:
        """ART's `backend.train(model, groups, learning_rate=..., ...)`: one step, ART's defaults
        (learning rate 5e-6), a `LocalTrainResult(step, metrics, checkpoint_path)` for `model.log`.
        ART's settings are translated where Journeyman has the knob, warned about where not; an
        unknown one is refused. Called Journeyman's way (a `jm.TrainConfig`), it is Journeyman's train."""
        step = {"idempotency_key": idempotency_key, "on_progress": on_progress, "trained_by": trained_by}
        checked = as_groups(groups, "trajectory_groups") or []
        if not art_settings and (config is not None or not isinstance(model, TrainableModel)):
            return await super().train(model, checked, config, **step)  # pyright: ignore[reportAbstractUsage]
        defaults = model._train_defaults if isinstance(model, TrainableModel) else {}  # pyright: ignore[reportPrivateUsage]
        cfg = journeyman_config(defaults, config, art_settings, "backend.train")
        result = await super().train(model, checked, cfg, **step)  # pyright: ignore[reportAbstractUsage]
        if isinstance(model, TrainableModel):
            model._last_result = result  # pyright: ignore[reportPrivateUsage]
        ckpt = self.run_dir(model) / "checkpoints" / f"{result.step:04d}"
        return LocalTrainResult(result.step, dict(result.metrics), str(ckpt) if ckpt.is_dir() else None)

    def close(self) -> Any:
        """Stop the engines and servers now; the result may be awaited (ART's `await backend.close()`)."""
        super().close()
        return _Closed()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- ART's object-storage names: any fsspec URL underneath (`push_run` / `pull_run`) ----------------

    def _s3_url(self, model: ModelConfig, s3_bucket: str | None, prefix: str | None) -> str:
        bucket = s3_bucket or os.environ.get("BACKUP_BUCKET")
        if not bucket:
            raise InvalidFieldError(
                "s3_bucket", s3_bucket, "give a bucket, or set $BACKUP_BUCKET as ART reads it"
            )
        parts = [bucket.removeprefix("s3://").strip("/"), *([prefix.strip("/")] if prefix else [])]
        return "s3://" + "/".join([*parts, model.project, "models", model.name])

    async def _experimental_push_to_s3(
        self,
        model: ModelConfig,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> None:
        """Upload the model's run to `s3://<bucket>/<prefix>/<project>/models/<name>` (ART's layout)."""
        n = await self.push_run(model, self._s3_url(model, s3_bucket, prefix), delete=delete)
        if verbose:
            print(f"pushed {n} files of {model.name} to {self._s3_url(model, s3_bucket, prefix)}")

    async def _experimental_pull_from_s3(
        self,
        model: ModelConfig,
        step: int | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
        exclude: Iterable[str] | None = None,
    ) -> None:
        """Download a run pushed by `_experimental_push_to_s3` before `register`, which resumes from it."""
        if step is not None or exclude:
            warn_unsupported(
                "_experimental_pull_from_s3(step=/exclude=)", "is not applied: the whole run is pulled"
            )
        n = await self.pull_run(model, self._s3_url(model, s3_bucket, prefix), delete=delete)
        if verbose:
            print(f"pulled {n} files of {model.name} from {self._s3_url(model, s3_bucket, prefix)}")


# ART's settings `train` takes through `**art_settings` (translated, or warned about; see art.dev)
LocalBackend.train.art_keywords = ART_TRAIN_NAMES  # pyright: ignore[reportFunctionMemberAccess]

__all__ = ["ART_PATH", "LocalBackend"]
