"""`journeyman langfuse ...`: pull a scored review set from Langfuse, and train on it.

Mounted by the main CLI with `app.add_typer(langfuse_app, name="langfuse")`. Importing this module
needs only typer: the Langfuse SDK is imported when a command runs, so a missing extra says what
to install instead of breaking the whole CLI.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from journeyman.data.types import TrajectoryGroup
    from journeyman.integrations.langfuse import ReviewSet

app = typer.Typer(
    name="langfuse",
    help="Langfuse trace review: pull traces people scored, and train on them.",
    no_args_is_help=True,
    add_completion=False,
)

_DATE_FORMATS = ["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M:%S%z"]

Score = Annotated[
    list[str], typer.Option("--score", help="score name(s) that become the reward (repeatable)")
]
Combine = Annotated[
    str, typer.Option(help="how several scores on one trace combine: mean, min, max, sum, latest, first")
]
Tag = Annotated[
    list[str] | None, typer.Option("--tag", help="only traces with every one of these tags (repeatable)")
]
Name = Annotated[str | None, typer.Option(help="only traces with this trace name")]
Since = Annotated[
    datetime | None,
    typer.Option(formats=_DATE_FORMATS, help="only traces that started at or after this time (UTC)"),
]
Until = Annotated[
    datetime | None,
    typer.Option(formats=_DATE_FORMATS, help="only traces that started before this time (UTC)"),
]
Source = Annotated[
    str | None, typer.Option(help="only scores from this source: ANNOTATION (human review), API, EVAL")
]
Queue = Annotated[str | None, typer.Option(help="only scores from this annotation queue id")]
GroupBy = Annotated[
    str | None,
    typer.Option(
        help="group by this metadata key (e.g. scenario_id), session_id or trace_name; default: the exported group"
    ),
]
MinGroup = Annotated[
    int, typer.Option(help="skip groups with fewer trajectories (GRPO compares within a group)")
]
GenName = Annotated[
    str | None, typer.Option(help="in traces not exported by Journeyman: the policy's generation name")
]
Limit = Annotated[int | None, typer.Option(help="look at most at this many traces")]
PublicKey = Annotated[str | None, typer.Option(envvar="LANGFUSE_PUBLIC_KEY", help="Langfuse public key")]
SecretKey = Annotated[
    str | None, typer.Option(envvar="LANGFUSE_SECRET_KEY", help="Langfuse secret key", show_default=False)
]
Host = Annotated[str | None, typer.Option(envvar=["LANGFUSE_BASE_URL", "LANGFUSE_HOST"], help="Langfuse URL")]


def _utc(t: datetime | None) -> datetime | None:
    return t if t is None or t.tzinfo is not None else t.replace(tzinfo=UTC)


def _fetch(**kwargs: Any) -> ReviewSet:
    from journeyman.integrations.langfuse import fetch_review_set

    kwargs["since"], kwargs["until"] = _utc(kwargs["since"]), _utc(kwargs["until"])
    return asyncio.run(fetch_review_set(progress=True, **kwargs))


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


@app.command()
def pull(
    score: Score,
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="where to write the groups (one TrajectoryGroup JSON per line)"),
    ] = Path("review.jsonl"),
    combine: Combine = "mean",
    tag: Tag = None,
    name: Name = None,
    since: Since = None,
    until: Until = None,
    source: Source = None,
    queue_id: Queue = None,
    group_by: GroupBy = None,
    min_group_size: MinGroup = 2,
    generation_name: GenName = None,
    limit: Limit = None,
    public_key: PublicKey = None,
    secret_key: SecretKey = None,
    host: Host = None,
) -> None:
    """Fetch scored traces, rebuild them as trajectory groups, and save them for `train --input`."""
    review = _fetch(
        score=score, combine=combine, tags=tag or [], name=name, since=since, until=until, score_source=source,
        queue_id=queue_id, group_by=group_by, min_group_size=min_group_size, generation_name=generation_name,
        limit=limit, public_key=public_key, secret_key=secret_key, host=host,
    )  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w") as f:
        for g in review.groups:
            f.write(g.model_dump_json() + "\n")
    _print_summary(review)
    typer.echo(f"wrote {output}")


@app.command()
def train(
    score: Annotated[
        list[str] | None, typer.Option("--score", help="score name(s) that become the reward (repeatable)")
    ] = None,
    model: Annotated[
        str, typer.Option(help="name of the model to train (the same name resumes its run)")
    ] = "reviewed",
    project: Annotated[str, typer.Option(help="project of the model")] = "langfuse",
    base_model: Annotated[
        str | None, typer.Option(help="embedded model name, local HF directory, or hub id")
    ] = None,
    path: Annotated[Path, typer.Option(help="run directory root")] = Path(".journeyman"),
    learning_rate: Annotated[float, typer.Option(help="AdamW learning rate of the LoRA adapter")] = 5e-5,
    input: Annotated[
        Path | None, typer.Option(help="train on a file written by `pull` instead of fetching")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="fetch and summarise, do not train")] = False,
    combine: Combine = "mean",
    tag: Tag = None,
    name: Name = None,
    since: Since = None,
    until: Until = None,
    source: Source = None,
    queue_id: Queue = None,
    group_by: GroupBy = None,
    min_group_size: MinGroup = 2,
    generation_name: GenName = None,
    limit: Limit = None,
    public_key: PublicKey = None,
    secret_key: SecretKey = None,
    host: Host = None,
) -> None:
    """Pull a review set (or read one from `--input`) and train one step on it."""
    from journeyman.data.types import TrajectoryGroup

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
        if not score:
            raise typer.BadParameter(
                "name the score that becomes the reward (--score), or pass --input", param_hint="--score"
            )
        review = _fetch(
            score=score, combine=combine, tags=tag or [], name=name, since=since, until=until, score_source=source,
            queue_id=queue_id, group_by=group_by, min_group_size=min_group_size, generation_name=generation_name,
            limit=limit, public_key=public_key, secret_key=secret_key, host=host,
        )  # fmt: skip
        _print_summary(review)
        groups = review.groups
    if not groups:
        typer.echo("nothing to train on", err=True)
        raise typer.Exit(1)
    if dry_run:
        return
    result = asyncio.run(_train(groups, model, project, base_model, path, learning_rate))
    shown = {
        k: round(v, 4)
        for k, v in result.metrics.items()
        if k
        in ("reward", "trained_tokens", "rows", "rows_retokenized", "groups_zero_signal", "train_seconds")
    }
    if result.skipped:
        typer.echo(f"step skipped: no group has rewards that differ {json.dumps(shown)}")
    else:
        typer.echo(f"trained {project}/{model}: now at step {result.step} {json.dumps(shown)}")


async def _train(
    groups: list[TrajectoryGroup],
    name: str,
    project: str,
    base_model: str | None,
    path: Path,
    learning_rate: float,
) -> Any:
    from journeyman.backends.local import LocalBackend
    from journeyman.client.model import TrainableModel
    from journeyman.data.config import DEFAULT_BASE_MODEL, TrainConfig

    backend = LocalBackend(path=path)
    model = TrainableModel(name=name, project=project, base_model=base_model or DEFAULT_BASE_MODEL)
    typer.echo("loading the model...", err=True)
    await model.register(backend)
    try:
        return await model.train(groups, config=TrainConfig(learning_rate=learning_rate))
    finally:
        backend.close()
