"""`journeyman eval --env` and `journeyman train --env`: an environment evaluated and trained on a
model, the results as JSON and a PNG under the model's run directory (`evals/`)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path

from journeyman._extras import require_backend
from journeyman.backends.connect import open_backend
from journeyman.client.model import TrainableModel
from journeyman.data.budget import Budget
from journeyman.data.config import DEFAULT_BASE_MODEL, TrainConfig
from journeyman.data.paths import RunLayout
from journeyman.environments import EvalReport, Sampling, TrainStep, evaluate, load, train
from journeyman.environments._evaluate import StepRef
from journeyman.errors import InvalidFieldError


def parse_steps(text: str) -> list[StepRef]:
    """`0,latest` -> [0, "latest"]."""
    out: list[StepRef] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == "latest":
            out.append("latest")
        elif part.isdigit():
            out.append(int(part))
        else:
            raise InvalidFieldError(
                "steps", text, "write step numbers and/or 'latest', comma-separated (0,latest)"
            )
    if not out:
        raise InvalidFieldError("steps", text, "name one step or more")
    return out


async def run_eval(
    spec: str,
    *,
    steps: Sequence[StepRef],
    k: int,
    tasks: int | None,
    sampling: Sampling | None,
    name: str,
    project: str,
    base_model: str | None,
    path: Path,
    backend_url: str | None = None,
    token: str | None = None,
) -> tuple[EvalReport, Path, Path]:
    """Evaluate, then write `<run_dir>/evals/<time>-<env>.json` and `.png`: (report, json, png)."""
    require_backend("journeyman eval (its plot)", ("matplotlib",))
    env = load(spec)
    backend = open_backend(backend_url, token=token, path=path)
    model = TrainableModel(name=name, project=project, base_model=base_model or DEFAULT_BASE_MODEL)
    try:
        await model.register(backend)
        report = await evaluate(model, env, steps=steps, k=k, tasks=tasks, sampling=sampling)
    finally:
        backend.close()
    run_dir = RunLayout.of(path, project, name).root  # here, also when the backend is remote
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", env.name).strip("_")[:60]
    stem = run_dir / "evals" / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}"
    written = report.write(stem.with_suffix(".json"))
    return report, written, plot_eval(report, stem.with_suffix(".png"))


async def run_train(
    spec: str,
    *,
    steps: int,
    groups_per_step: int,
    group_size: int,
    learning_rate: float,
    sampling: Sampling,
    name: str,
    project: str,
    base_model: str | None,
    path: Path,
    pipeline: bool = False,
    backend_url: str | None = None,
    token: str | None = None,
    on_step: object = None,
    budget: Budget | None = None,
) -> tuple[list[TrainStep], Path, int]:
    """Train; (each step, the run directory, the step reached)."""
    env = load(spec)
    backend = open_backend(backend_url, token=token, path=path)
    model = TrainableModel(
        name=name, project=project, base_model=base_model or DEFAULT_BASE_MODEL, budget=budget
    )
    try:
        await model.register(backend)
        done = await train(
            model,
            env,
            steps=steps,
            groups_per_step=groups_per_step,
            group_size=group_size,
            config=TrainConfig(learning_rate=learning_rate),
            sampling=sampling,
            pipeline=pipeline,
            on_step=on_step if callable(on_step) else None,  # pyright: ignore[reportArgumentType]
        )
        reached = await model.get_step()
    finally:
        backend.close()
    return done, RunLayout.of(path, project, name).root, reached


def plot_eval(report: EvalReport, out: Path) -> Path:
    """Mean reward ± SE at each evaluated step (and pass@k where rewards are binary)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from journeyman.app.plot import save_figure

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    xs = [s.step for s in report.steps]
    ax.errorbar(
        xs,
        [s.mean for s in report.steps],
        yerr=[s.sem for s in report.steps],
        marker="o",
        capsize=4,
        label="mean reward ± SE",
    )
    if all(s.pass_at_k is not None for s in report.steps) and report.steps[0].k > 1:
        ax.plot(
            xs,
            [s.pass_at_k or 0.0 for s in report.steps],
            marker="s",
            linestyle="--",
            label=f"pass@{report.steps[0].k}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward on the eval split")
    ax.set_xticks(xs)
    ax.set_title(f"{report.model} on {report.environment}")
    return save_figure(fig, ax, out)
