"""`journeyman langfuse ...`: pull a scored review set from Langfuse, and train on it.

Mounted by the main CLI with `app.add_typer(langfuse_app, name="langfuse")`. Importing this module
needs only typer: the Langfuse SDK is imported when a command runs, so a missing extra says what
to install instead of breaking the whole CLI.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from journeyman.app.options import ADVANCED, App, Fields, with_fields
from journeyman.data.config import ModelConfig, TrainConfig
from journeyman.integrations.langfuse._query import ReviewQuery

if TYPE_CHECKING:
    from journeyman.data.types import TrajectoryGroup
    from journeyman.integrations.langfuse import ReviewSet

app = App(name="langfuse", help="Langfuse trace review: pull traces people scored, and train on them.")

_DATE_FORMATS = ["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M:%S%z"]
# every filter of ReviewQuery but a mapping (categorical rewards: Python only)
QUERY = Fields(
    ReviewQuery,
    exclude={"categories"},
    flags={"tags": "--tag", "score_source": "--source", "name": "--trace-name"},
    panel="Which traces (ReviewQuery)",
    extra={"since": {"formats": _DATE_FORMATS}, "until": {"formats": _DATE_FORMATS}},
)
# `train --help` shows the step's main settings; --help-all the optimizer's and the memory's knobs
# (distillation's teacher is set from Python: `TrainConfig(distill=DistillConfig(teacher=...))`)
TRAIN = Fields(TrainConfig, exclude={"distill"}, panel="Training step (TrainConfig)", advanced=ADVANCED)
# the model trained; `--model` names it (ReviewQuery's --trace-name filters traces)
MODEL = Fields(
    ModelConfig,
    only=["name", "project", "base_model"],
    prefix="model_",
    flags={"name": "--model", "project": "--project", "base_model": "--base-model"},
    defaults={"name": "reviewed", "project": "langfuse"},
)

# --langfuse-*: `serve --host` is an address to bind, not the Langfuse URL
PublicKey = Annotated[
    str | None,
    typer.Option("--langfuse-public-key", envvar="LANGFUSE_PUBLIC_KEY", help="Langfuse public key"),
]
SecretKey = Annotated[
    str | None,
    typer.Option(
        "--langfuse-secret-key", envvar="LANGFUSE_SECRET_KEY", help="Langfuse secret key", show_default=False
    ),
]
Host = Annotated[
    str | None,
    typer.Option("--langfuse-host", envvar=["LANGFUSE_BASE_URL", "LANGFUSE_HOST"], help="Langfuse URL"),
]
# the old spellings, accepted for one release
RENAMED = {
    "--host": "--langfuse-host",
    "--public-key": "--langfuse-public-key",
    "--secret-key": "--langfuse-secret-key",
    "--name": "--trace-name",
}


def _fetch(
    query: dict[str, Any], public_key: str | None, secret_key: str | None, host: str | None
) -> ReviewSet:
    from journeyman.integrations.langfuse import fetch_review_set

    q = QUERY.build(query)
    return asyncio.run(
        fetch_review_set(q, public_key=public_key, secret_key=secret_key, host=host, progress=True)
    )


def _print_summary(review: ReviewSet) -> None:
    typer.echo(
        f"kept {review.trajectories} trajectories in {len(review.groups)} groups from {review.traces} traces"
        + (f" ({review.retokenized} re-tokenised: not exported by Journeyman)" if review.retokenized else "")
    )
    if review.skipped:
        typer.echo("skipped:")
        for why, n in sorted(review.skipped.items(), key=lambda kv: -kv[1]):
            typer.echo(f"  {n:>6}  {why}")
    flat = [g.rewards() for g in review.groups]
    no_signal = sum(1 for r in flat if max(r) - min(r) < 1e-9)
    if no_signal:
        typer.echo(
            f"note: {no_signal} of {len(flat)} groups have equal rewards (nothing to learn from; training skips them)"
        )


@app.command(renamed=RENAMED)
@with_fields(query=QUERY)
def pull(
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="where to write the groups (one TrajectoryGroup JSON per line)"),
    ] = Path("review.jsonl"),
    public_key: PublicKey = None,
    secret_key: SecretKey = None,
    host: Host = None,
    *,
    query: dict[str, Any],
) -> None:
    """Fetch scored traces, rebuild them as trajectory groups, and save them for `train --input`."""
    review = _fetch(query, public_key, secret_key, host)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w") as f:
        for g in review.groups:
            f.write(g.model_dump_json() + "\n")
    _print_summary(review)
    typer.echo(f"wrote {output}")


@app.command(renamed=RENAMED)
@with_fields(model=MODEL, query=replace(QUERY, defaults={"score": None}), train=TRAIN)
def train(
    path: Annotated[Path, typer.Option(help="run directory root")] = Path(".journeyman"),
    input: Annotated[
        Path | None, typer.Option(help="train on a file written by `pull` instead of fetching")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="fetch and summarise, do not train")] = False,
    public_key: PublicKey = None,
    secret_key: SecretKey = None,
    host: Host = None,
    *,
    model: dict[str, Any],
    query: dict[str, Any],
    train: dict[str, Any],
) -> None:
    """Pull a review set (or read one from `--input`) and train one step on it."""
    from journeyman.data.types import TrajectoryGroup

    # a bad setting fails before anything is fetched
    config, identity = TRAIN.build(train), MODEL.build(model)
    if input is not None:
        groups = [
            TrajectoryGroup.model_validate_json(line)
            for line in input.read_text().splitlines()
            if line.strip()
        ]
        typer.echo(
            f"read {sum(len(g.trajectories) for g in groups)} trajectories in {len(groups)} groups from {input}"
        )
    else:
        if not query.get("score"):
            raise typer.BadParameter(
                "name the score that becomes the reward (--score), or pass --input", param_hint="--score"
            )
        review = _fetch(query, public_key, secret_key, host)
        _print_summary(review)
        groups = review.groups
    if not groups:
        typer.echo("nothing to train on", err=True)
        raise typer.Exit(1)
    if dry_run:
        return
    result = asyncio.run(_train(groups, identity, path, config))
    shown = {
        k: round(v, 4)
        for k, v in result.metrics.items()
        if k
        in ("reward", "trained_tokens", "rows", "rows_retokenized", "groups_zero_signal", "train_seconds")
    }
    if result.skipped:
        typer.echo(f"step skipped: no group has rewards that differ {json.dumps(shown)}")
    else:
        typer.echo(
            f"trained {identity.project}/{identity.name}: now at step {result.step} {json.dumps(shown)}"
        )


async def _train(
    groups: list[TrajectoryGroup], identity: ModelConfig, path: Path, config: TrainConfig
) -> Any:
    from journeyman.backends.local import LocalBackend
    from journeyman.client.model import TrainableModel

    backend = LocalBackend(path=path)
    model = TrainableModel(**identity.model_dump())
    typer.echo("loading the model...", err=True)
    await model.register(backend)
    try:
        return await model.train(groups, config=config)
    finally:
        backend.close()
