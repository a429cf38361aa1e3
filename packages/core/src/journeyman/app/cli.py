"""`journeyman` command line: chat with the default model, run the demo training, redraw plots."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from journeyman.app.langfuse_cli import QUERY as LANGFUSE_QUERY
from journeyman.app.langfuse_cli import RENAMED as LANGFUSE_RENAMED
from journeyman.app.langfuse_cli import Host as LangfuseHost
from journeyman.app.langfuse_cli import PublicKey as LangfusePublicKey
from journeyman.app.langfuse_cli import SecretKey as LangfuseSecretKey
from journeyman.app.langfuse_cli import app as langfuse_app
from journeyman.app.options import ADVANCED, BUDGET, App, Fields, budget_of, with_fields
from journeyman.backends.memory_plan import PRESETS, Layout, TrainingSetup
from journeyman.data.budget import spend_text
from journeyman.data.config import LoraConfig, ModelConfig, SFTConfig, TrainConfig, TrainerConfig
from journeyman.data.live_types import LiveConfig, LiveStatus
from journeyman.data.paths import RunLayout, RunRoot

app = App(help="Journeyman: on-the-job reinforcement learning for LLM agents.")
app.add_typer(langfuse_app, name="langfuse")  # `journeyman langfuse pull|train`

# Options that set a model's fields are derived from them (help, default, type): see app/options.py.
BASE_MODEL = Fields(ModelConfig, only=["base_model"])
# One word per thing across the command lines: --model names the trained model (as in `mcp-rl` and
# `langfuse train`), --trainer-ranks the trainer's processes, --backend the URL of `journeyman serve`.
MODEL_FLAG = {"name": "--model"}
DEMO_MODEL = Fields(ModelConfig, only=["name"], flags=MODEL_FLAG, defaults={"name": "demo"})
SFT_MODEL = Fields(
    ModelConfig,
    only=["name", "project", "base_model"],
    flags=MODEL_FLAG,
    defaults={"name": "sft", "project": "cli"},
)
# `sft --help` shows what a first run sets; --help-all the optimizer's and the memory's knobs
SFT = Fields(SFTConfig, panel="Fine-tuning (SFTConfig)", advanced=ADVANCED)
DEMO_TRAIN = Fields(TrainConfig, only=["learning_rate"], defaults={"learning_rate": 2e-4})  # run_demo's rate
TRAINER = Fields(TrainerConfig, only=["world_size"], flags={"world_size": "--trainer-ranks"})
PLAN_SETUP = Fields(TrainingSetup, exclude=["lora"], panel="Training")
PLAN_LORA = Fields(LoraConfig, only=["r"], prefix="lora_", panel="Training")
# the engine `register` plans for unless told otherwise: LocalBackend's (and `serve`'s) default
PLAN_LAYOUT = Fields(
    Layout, exclude=["device", "cpu_kv_cache_gib"], panel="Layout", defaults={"engine": "torch"}
)
# Options no model field holds, written once for the commands that take them.
_BACKEND = Annotated[
    str | None, typer.Option(help="train on `journeyman serve` at this URL instead of in this process")
]
_RENAMED_MODEL = {"--name": "--model"}  # the old spellings, accepted for one release
_SERVER_TOKEN = Annotated[
    str | None, typer.Option(help="the server's API token (default: $JOURNEYMAN_TOKEN)")
]


@app.command()
@with_fields(identity=BASE_MODEL)
def chat(
    prompt: Annotated[str, typer.Argument(help="what to ask the model")],
    max_tokens: Annotated[int, typer.Option(help="most tokens to generate")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.7,
    show_tokens: Annotated[bool, typer.Option(help="print the recorded token ids and logprobs")] = False,
    path: Annotated[Path, typer.Option(help="run directory root")] = Path(".journeyman"),
    *,
    identity: dict[str, Any],
) -> None:
    """Ask the model one question through its OpenAI-compatible endpoint, and show what was recorded."""
    import journeyman as jm

    config = BASE_MODEL.build(identity, name="chat", project="cli")

    async def run() -> None:
        backend = jm.LocalBackend(path=path)
        model = jm.TrainableModel(name=config.name, project=config.project, base_model=config.base_model)
        typer.echo("loading the model...", err=True)
        await model.register(backend)
        try:
            client = model.openai_client()
            completion = await client.chat.completions.create(
                model=model.name,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=temperature,
            )
            choice = completion.choices[0]
            typer.echo(choice.message.content or "")
            record = jm.record_of(choice)
            if record is not None:
                typer.echo(
                    f"\n[{record.model}] {len(record.prompt_token_ids)} prompt tokens, {len(record.token_ids)} sampled, "
                    f"finish={record.finish_reason}, mean logprob {sum(record.logprobs) / max(1, len(record.logprobs)):.3f}",
                    err=True,
                )
                if show_tokens:
                    typer.echo(
                        json.dumps({"token_ids": record.token_ids, "logprobs": record.logprobs}), err=True
                    )
        finally:
            backend.close()

    asyncio.run(run())


@app.command(
    renamed={**_RENAMED_MODEL, "--world-size": "--trainer-ranks", "--prompts-per-step": "--groups-per-step"}
)
@with_fields(model=DEMO_MODEL, train=DEMO_TRAIN, trainer=TRAINER, budget=BUDGET)
def demo(
    steps: Annotated[int, typer.Option(help="training steps (1 or more)")] = 10,
    groups_per_step: Annotated[int, typer.Option(help="scenarios per step, one group each")] = 8,
    group_size: Annotated[int, typer.Option(help="rollouts per scenario (the GRPO group; 2 or more)")] = 4,
    eval_prompts: Annotated[int, typer.Option(help="held-out prompts evaluated before and after")] = 32,
    path: Annotated[Path, typer.Option(help="run directory root")] = Path(".journeyman"),
    backend: _BACKEND = None,
    token: _SERVER_TOKEN = None,
    pipeline: Annotated[
        bool,
        typer.Option(help="train with the asynchronous PipelineTrainer: rollouts go on while a step trains"),
    ] = False,
    *,
    model: dict[str, Any],
    train: dict[str, Any],
    trainer: dict[str, Any],
    budget: dict[str, Any],
) -> None:
    """Train the embedded model on the CPU for a few minutes on a built-in task, and show that it learned."""
    name = DEMO_MODEL.build(model, project="journeyman-demo").name  # run_demo's project
    learning_rate = DEMO_TRAIN.build(train).learning_rate
    world_size = TRAINER.build(trainer).world_size
    caps = budget_of(budget)
    limits = caps.limits() if caps is not None else {}
    from tqdm.auto import tqdm

    from journeyman.app.demo import check_counts, run_demo
    from journeyman.backends.connect import open_backend

    check_counts(
        steps=steps, group_size=group_size, prompts_per_step=groups_per_step, eval_prompts=eval_prompts
    )
    bar = tqdm(total=steps, desc="training", unit="step", disable=pipeline)  # the pipeline shows its own

    def on_step(step: int, metrics: dict[str, float]) -> None:
        spent = {k: v for k, v in metrics.items() if k.startswith("spend_")}
        bar.set_postfix(
            reward=f"{metrics.get('reward', 0.0):.3f}",
            sec=f"{metrics.get('train_seconds', 0.0):.1f}",
            spent=spend_text(spent, limits),
        )
        bar.update(1)

    def on_start(step: int) -> None:
        if step:
            bar.write(
                f"{name} has trained {step} steps before: this run goes on from there (--model NAME starts afresh)"
            )

    typer.echo("Task: answer held-out questions briefly and on topic (reward = on-topic x brevity).")
    result = asyncio.run(
        run_demo(
            path=path,
            name=name,
            steps=steps,
            prompts_per_step=groups_per_step,
            group_size=group_size,
            learning_rate=learning_rate,
            eval_prompts=eval_prompts,
            on_step=on_step,
            backend=open_backend(backend, token=token, path=path) if backend else None,
            world_size=world_size,
            pipeline=pipeline,
            on_start=on_start,
            budget=caps,
        )
    )
    bar.close()
    b, a = result.before, result.after
    typer.echo(
        f"held-out reward before: {b.mean:.3f} ± {b.sem:.3f}  ({b.completion_tokens:.1f} tokens per answer)"
    )
    typer.echo(
        f"held-out reward after:  {a.mean:.3f} ± {a.sem:.3f}  ({a.completion_tokens:.1f} tokens per answer)"
    )
    typer.echo(f"gain: {result.gain_in_sems:.1f} standard errors")
    typer.echo(f"run directory: {result.run_dir}\nreward curve:  {result.plot}")


_ENV = Annotated[
    str,
    typer.Option(
        "--env",
        help="the environment: module:function, gym:<module>:<id>[:k=v,...], verifiers:<module>[:k=v,...] "
        "or openenv:<url> (docs/environments.md)",
    ),
]
_ENV_MODEL = Annotated[str, typer.Option("--model", help="the trained model's name")]
_ENV_PROJECT = Annotated[str, typer.Option(help="the model's project")]
_MAX_TOKENS = Annotated[int, typer.Option(help="most tokens a completion samples")]


@app.command("eval")
@with_fields(identity=BASE_MODEL)
def eval_env(
    env: _ENV,
    steps: Annotated[
        str, typer.Option(help="steps to evaluate, comma-separated: numbers, latest (0 = base)")
    ] = "latest",
    k: Annotated[int, typer.Option("--k", help="samples a task (pass@k where rewards are 0 or 1)")] = 1,
    tasks: Annotated[
        int | None, typer.Option(help="the first N tasks of the eval split (default: all)")
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="default: 0 (greedy) for --k 1, else 1")] = None,
    max_tokens: _MAX_TOKENS = 64,
    model: _ENV_MODEL = "env",
    project: _ENV_PROJECT = "environments",
    path: Annotated[Path, typer.Option(help="run directory root")] = Path(".journeyman"),
    backend: _BACKEND = None,
    token: _SERVER_TOKEN = None,
    *,
    identity: dict[str, Any],
) -> None:
    """Evaluate a model on an environment's eval split at one or more steps: mean reward ± SE, pass@k,
    the paired difference between steps; writes a results JSON and a plot under the run directory."""
    from journeyman.app.env_commands import parse_steps, run_eval
    from journeyman.environments import Sampling

    chosen = parse_steps(steps)
    base_model = BASE_MODEL.build(identity, name=model, project=project).base_model
    temp = temperature if temperature is not None else (0.0 if k == 1 else 1.0)
    report, written, png = asyncio.run(
        run_eval(
            env,
            steps=chosen,
            k=k,
            tasks=tasks,
            sampling=Sampling(temperature=temp, max_tokens=max_tokens),
            name=model,
            project=project,
            base_model=base_model,
            path=path,
            backend_url=backend,
            token=token,
        )
    )
    for line in report.lines():
        typer.echo(line)
    typer.echo(f"results: {written}\nplot:    {png}")


@app.command("train")
@with_fields(identity=BASE_MODEL, train=DEMO_TRAIN, budget=BUDGET)
def train_env(
    env: _ENV,
    steps: Annotated[int, typer.Option(help="training steps")] = 10,
    groups_per_step: Annotated[int, typer.Option(help="tasks drawn a step, one group each")] = 8,
    group_size: Annotated[int, typer.Option(help="rollouts a task (the GRPO group; 2 or more)")] = 4,
    temperature: Annotated[float, typer.Option(help="sampling temperature of the rollouts")] = 1.0,
    max_tokens: _MAX_TOKENS = 64,
    model: _ENV_MODEL = "env",
    project: _ENV_PROJECT = "environments",
    path: Annotated[Path, typer.Option(help="run directory root")] = Path(".journeyman"),
    backend: _BACKEND = None,
    token: _SERVER_TOKEN = None,
    pipeline: Annotated[
        bool, typer.Option(help="train with the PipelineTrainer: rollouts go on while a step trains")
    ] = False,
    *,
    identity: dict[str, Any],
    train: dict[str, Any],
    budget: dict[str, Any],
) -> None:
    """Train a model with GRPO on an environment's train split (a group of rollouts for each task drawn);
    `journeyman eval --env SPEC --steps 0,latest` then shows what it learned."""
    from journeyman.app.env_commands import run_train
    from journeyman.environments import Sampling, TrainStep

    base_model = BASE_MODEL.build(identity, name=model, project=project).base_model

    def on_step(s: TrainStep) -> None:
        failed = f", {s.failed} failed" if s.failed else ""
        skipped = " (skipped: no reward differed)" if s.skipped else ""
        typer.echo(
            f"step {s.step}: reward {s.reward:.3f} over {s.rollouts} rollouts{failed}, {s.seconds:.0f} s{skipped}"
        )

    _done, run_dir, reached = asyncio.run(
        run_train(
            env,
            steps=steps,
            groups_per_step=groups_per_step,
            group_size=group_size,
            learning_rate=DEMO_TRAIN.build(train).learning_rate,
            sampling=Sampling(temperature=temperature, max_tokens=max_tokens),
            name=model,
            project=project,
            base_model=base_model,
            path=path,
            pipeline=pipeline,
            backend_url=backend,
            token=token,
            budget=budget_of(budget),
            on_step=on_step,
        )
    )
    typer.echo(f"{project}/{model} now at step {reached}; run directory: {run_dir}")


@app.command()
def report(
    run_dir: Annotated[
        Path, typer.Argument(help="a model's run directory (.journeyman/<project>/models/<name>)")
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="PNG to write (default: <run_dir>/<metric>.png)")
    ] = None,
    metric: Annotated[
        str, typer.Option(help="history metric to plot per split, e.g. reward or success (mcp-rl runs)")
    ] = "reward",
) -> None:
    """Redraw the reward curve of a run from its history.jsonl."""
    from journeyman.app.plot import plot_history
    from journeyman.backends.store import RunStore
    from journeyman.errors import InvalidFieldError

    if not RunLayout(run_dir).history.exists():
        raise InvalidFieldError(
            "run_dir", str(run_dir), "no history.jsonl there (is it .journeyman/<project>/models/<name>?)"
        )
    history = RunStore(run_dir).history()
    default = RunLayout(run_dir).reward_plot.with_name(f"{metric}.png")  # reward.png for reward
    png = plot_history(history, output or default, title=run_dir.name, metric=metric)
    steps = [r["step"] for r in history if f"train/{metric}" in r]
    typer.echo(f"{len(steps)} training steps; plot: {png}")


@app.command()
def view(
    run_dirs: Annotated[
        list[Path] | None,
        typer.Argument(
            help="run directories, or roots holding them (default: .journeyman)", show_default=False
        ),
    ] = None,
    port: Annotated[int, typer.Option(help="port on 127.0.0.1 (0: any free port)")] = 7900,
    open_browser: Annotated[
        bool, typer.Option("--open/--no-open", help="open the page in a browser")
    ] = False,
) -> None:
    """Browse runs in a web page on 127.0.0.1: curves, steps, groups, trajectories and their token ids;
    a run that is training updates the page as it goes. Read-only."""
    from journeyman.app.view.server import ViewerServer

    paths = run_dirs or [Path(".journeyman")]
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise typer.BadParameter(f"no such directory: {missing[0]}", param_hint="RUN_DIRS")
    try:
        server = ViewerServer(paths, port=port)
    except OSError as e:
        typer.secho(f"journeyman view: cannot listen on 127.0.0.1:{port}: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"journeyman view: {server.url}  (Ctrl-C stops it)", err=True)
    if open_browser:
        import webbrowser

        webbrowser.open(server.url)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


@app.command(renamed=_RENAMED_MODEL)
@with_fields(identity=SFT_MODEL, sft=SFT, budget=BUDGET)
def sft(
    file: Annotated[
        Path,
        typer.Argument(
            help=".jsonl with one Trajectory or TrajectoryGroup JSON per line (e.g. `langfuse pull`)"
        ),
    ],
    min_reward: Annotated[
        float | None, typer.Option(help="train only on trajectories with at least this reward")
    ] = None,
    path: Annotated[Path, typer.Option(help="run directory root")] = Path(".journeyman"),
    backend: _BACKEND = None,
    token: _SERVER_TOKEN = None,
    report_to: Annotated[
        list[str] | None, typer.Option("--report-to", help="mirror the history to: wandb (repeatable)")
    ] = None,
    *,
    identity: dict[str, Any],
    sft: dict[str, Any],
    budget: dict[str, Any],
) -> None:
    """Supervised fine-tuning of a model's LoRA adapter on trajectories from FILE: one step of its run,
    so `model.train` (RL) continues from it."""
    from journeyman.data.trajectory_file import read_trajectories

    # a bad setting or file is one clear line, before any model loads
    config = SFT.build(sft)
    model_config = SFT_MODEL.build(identity)
    caps = budget_of(budget)
    name, project, base_model = model_config.name, model_config.project, model_config.base_model
    trajectories = read_trajectories(file, min_reward=min_reward)
    typer.echo(f"read {len(trajectories)} trajectories from {file}", err=True)

    async def run() -> None:
        import journeyman as jm

        if backend:
            b: jm.Backend = jm.RemoteBackend(backend, token=token)
        else:
            b = jm.LocalBackend(path=path, report_to=report_to or [])
        model = jm.TrainableModel(name=name, project=project, base_model=base_model, budget=caps)
        typer.echo("loading the model...", err=True)
        await model.register(b)
        try:
            result = await model.train_sft(trajectories, config=config)
            m = result.metrics
            typer.echo(
                f"{project}/{name} now at step {result.step}: loss {m['loss_first_epoch']:.4f} (first epoch) -> "
                f"{m['loss']:.4f} (last), {m['trained_tokens']:.0f} trained tokens per epoch, "
                f"{m['train_seconds']:.1f} s"
            )
            typer.echo(f"run directory: {model.run_dir}")
        finally:
            b.close()

    asyncio.run(run())


@app.command()
@with_fields(setup=PLAN_SETUP, lora=PLAN_LORA, layout=PLAN_LAYOUT)
def plan(
    model_config: Annotated[
        Path | None, typer.Option(help="the base model's config.json, or the model directory holding it")
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(help=f"a model Journeyman knows instead: {', '.join(PRESETS)}, smollm2-135m-instruct"),
    ] = None,
    lora_target_modules: Annotated[
        list[str] | None, typer.Option(help="modules LoRA adapts (repeatable); default all-linear")
    ] = None,
    models: Annotated[
        int,
        typer.Option(
            help="models sharing this base on one backend: each adds its adapter, optimizer state and "
            "KV cache, not a base",
            rich_help_panel="Layout",
        ),
    ] = 1,
    *,
    setup: dict[str, Any],
    lora: dict[str, Any],
    layout: dict[str, Any],
) -> None:
    """What each GPU will hold to train a model (weights, adapter, optimizer state, activations, KV
    cache) and whether it fits, worked out from its config.json before anything loads; exits 1 when
    it does not fit, naming what to change."""
    from journeyman.backends.memory_plan import plan_memory, preset_config
    from journeyman.errors import InvalidFieldError

    if (model_config is None) == (preset is None):
        raise typer.BadParameter(
            "give one of --model-config PATH or --preset NAME", param_hint="'--model-config'"
        )
    if model_config is not None:
        file = model_config / "config.json" if model_config.is_dir() else model_config
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"{file}: {e}", param_hint="'--model-config'") from None
    else:
        try:
            config = preset_config(preset or "")
        except InvalidFieldError as e:
            raise typer.BadParameter(str(e), param_hint="'--preset'") from None
    adapter = PLAN_LORA.build(lora, target_modules=lora_target_modules or "all-linear")
    training = PLAN_SETUP.build(setup, lora=adapter)
    try:
        result = plan_memory(config, training, PLAN_LAYOUT.build(layout), flag=_plan_flag, models=models)
    except InvalidFieldError as e:
        if e.field != "models":
            raise
        raise typer.BadParameter(str(e), param_hint="'--models'") from None
    typer.echo(result.table())
    if not result.fits:
        raise typer.Exit(1)


def _plan_flag(field: str) -> str:
    """The option of `plan` that sets a TrainingSetup or Layout field: its advice names the flags."""
    return (PLAN_LAYOUT if field in PLAN_LAYOUT.names() else PLAN_SETUP).flag(field)


def _log_to_stderr() -> None:
    """Journeyman's INFO lines on stderr, with the time (a server's log)."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("journeyman")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


@app.command()
def serve(
    host: Annotated[
        str, typer.Option(help="address to bind; anything but 127.0.0.1 is reachable from other machines")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 7800,
    path: Annotated[
        Path, typer.Option(help="run directory root (checkpoints, trajectories, history)")
    ] = Path(".journeyman"),
    engine: Annotated[str, typer.Option(help="torch (in process) or vllm")] = "torch",
    max_body_mb: Annotated[float, typer.Option(help="largest request body accepted (413 above it)")] = 64.0,
    report_to: Annotated[
        list[str] | None,
        typer.Option("--report-to", help="mirror each model's history to: wandb (repeatable)"),
    ] = None,
    ssl_certfile: Annotated[
        Path | None, typer.Option(help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
    ] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option(help="the certificate's private key (PEM)")] = None,
    otel_endpoint: Annotated[
        str | None,
        typer.Option(
            help="also push the /metrics series to this OpenTelemetry collector (OTLP/HTTP, "
            "http://host:4318/v1/metrics; default: $OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, "
            "$OTEL_EXPORTER_OTLP_ENDPOINT; the otel extra)"
        ),
    ] = None,
    otel_interval_s: Annotated[
        float | None,
        typer.Option(
            help="seconds between OpenTelemetry exports (default: $OTEL_METRIC_EXPORT_INTERVAL ms, else 60)"
        ),
    ] = None,
) -> None:
    """Serve the Backend protocol and every model's OpenAI endpoint over HTTP, for `jm.RemoteBackend`,
    and the run viewer at /view/ (open /view/?token=T once in a browser; an API token of scope train).

    Every request needs `Authorization: Bearer <token>`: $JOURNEYMAN_TOKEN (or a new one printed at
    start) is an admin API token; `journeyman token add` makes named ones with narrower scopes.
    SIGTERM drains: new requests get 503, those in flight (30 s) and a training step (300 s) finish."""
    import os
    import secrets

    from journeyman._extras import require_backend

    try:  # before the server's imports: a light install lacks fastapi
        require_backend("journeyman serve")
    except ImportError as e:
        typer.secho(str(e), fg=typer.colors.RED, err=True)  # says the command and what to install
        raise typer.Exit(2) from None
    from journeyman.app.view.mount import add_viewer
    from journeyman.backends.local import LocalBackend
    from journeyman.backends.otel import otel_settings, require_otel
    from journeyman.backends.server import serve as run
    from journeyman.errors import InvalidFieldError

    try:
        otel = otel_settings(otel_endpoint, otel_interval_s)
    except InvalidFieldError as e:  # the flag, or the OTEL_* variable, that was given
        flags = {"otel_endpoint": "'--otel-endpoint'", "otel_interval_s": "'--otel-interval-s'"}
        raise typer.BadParameter(e.reason, param_hint=flags.get(e.field, e.field)) from None
    if otel is not None:
        try:  # before the model loads: a missing extra is said at once
            require_otel(f"journeyman serve ({otel.source})")
        except ImportError as e:
            typer.secho(str(e), fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None

    token = os.environ.get("JOURNEYMAN_TOKEN") or secrets.token_urlsafe(32)
    _log_to_stderr()  # each register, step, promotion and refusal: one INFO line
    if host not in ("127.0.0.1", "localhost", "::1") and ssl_certfile is None:
        typer.echo(
            f"warning: binding {host} without TLS: API tokens cross the network in the clear; pass "
            "--ssl-certfile/--ssl-keyfile or put a TLS reverse proxy in front (README)",
            err=True,
        )

    def ready(url: str) -> None:
        typer.echo(f"journeyman serve: {url}", err=True)
        if "JOURNEYMAN_TOKEN" not in os.environ:
            typer.echo(f"token: {token}", err=True)
        typer.echo("ready", err=True)

    run(
        LocalBackend(path=path, engine=engine, report_to=report_to or []),
        token,
        host=host,
        port=port,
        max_body_bytes=int(max_body_mb * 2**20),
        on_ready=ready,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        routes=lambda app: add_viewer(app, path),  # the run viewer at /view/ (token of scope train)
        otel=otel,
    )


token_app = App(
    help="Named API tokens of `journeyman serve` (scopes: sample < train < admin); a running server "
    "sees changes on its next request."
)
app.add_typer(token_app, name="token")
_TOKEN_PATH = Annotated[Path, typer.Option(help="the server's run directory root (its --path)")]


@token_app.command("add")
def token_add(
    name: Annotated[str, typer.Argument(help="who holds it (named in the history rows it trains)")],
    scope: Annotated[str, typer.Option(help="sample, train or admin")] = "sample",
    models: Annotated[
        str | None,
        typer.Option(help="comma-separated models it alone may touch (default: every model; not with admin)"),
    ] = None,
    path: _TOKEN_PATH = Path(".journeyman"),
) -> None:
    """Add an API token and print its secret (shown once; the server keeps only its sha256)."""
    from journeyman.errors import InvalidFieldError
    from journeyman.serving.api_tokens import SCOPES, TokenBook

    if scope not in SCOPES:
        raise typer.BadParameter(f"use one of {', '.join(SCOPES)}", param_hint="--scope")
    names = None if models is None else [m.strip() for m in models.split(",") if m.strip()]
    try:
        secret = TokenBook(RunRoot(path).tokens).add(name, scope, names)  # pyright: ignore[reportArgumentType]
    except InvalidFieldError as e:  # the option, not the library's field, is what the user typed
        hint = {"models": "--models", "scope": "--scope", "name": "NAME"}.get(e.field, e.field)
        raise typer.BadParameter(str(e), param_hint=hint) from None
    typer.echo(secret)


@token_app.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Argument(help="the token's name")], path: _TOKEN_PATH = Path(".journeyman")
) -> None:
    """Revoke an API token: the next request that presents it gets a 401."""
    from journeyman.serving.api_tokens import TokenBook

    if not TokenBook(RunRoot(path).tokens).revoke(name):
        raise typer.BadParameter(f"no token named {name!r}", param_hint="name")


@token_app.command("list")
def token_list(path: _TOKEN_PATH = Path(".journeyman")) -> None:
    """The API tokens in the file: name, scope, when added, its models (never the secrets)."""
    import time

    from journeyman.serving.api_tokens import TokenBook

    tokens = TokenBook(RunRoot(path).tokens).tokens()
    if not tokens:
        typer.echo(f"no API tokens under {path} (`journeyman token add NAME` makes one)", err=True)
    for t in tokens:
        added = time.strftime("%Y-%m-%d %H:%M", time.localtime(t.created_at))
        typer.echo(
            f"{t.name}\t{t.scope}\t{added}\t{','.join(t.models) if t.models is not None else '(every model)'}"
        )


live_app = App(
    help="Live training on `journeyman serve` (docs/live.md): start it, see its status, decide by hand."
)
app.add_typer(live_app, name="live")
LIVE = Fields(LiveConfig, exclude=["train", "gate", "budget"], panel="Live training (LiveConfig)")
GATE = Fields.nested(LiveConfig, "gate", prefix="gate_", panel="The gate (GateConfig)")
LIVE_TRAIN = Fields.nested(LiveConfig, "train", only=["learning_rate"], panel="Training")
_MODEL = Annotated[str, typer.Argument(help="the served model's name")]
_SERVER = Annotated[str, typer.Option("--backend", help="the URL `journeyman serve` printed")]
_RENAMED_SERVER = {"--server": "--backend"}  # the old spelling, accepted for one release


def _remote_call(server: str, token: str | None, model: str, call: Any) -> Any:
    """`call(backend, model config)` on the server's model (its errors: one line, from `App`)."""
    import journeyman as jm

    async def run() -> Any:
        backend = jm.RemoteBackend(server, token=token, progress=False)
        # the model's config as the server serves it: its status and decisions need only the name
        return await call(backend, ModelConfig(name=model, project="live"))

    return asyncio.run(run())


@live_app.command("start", renamed=_RENAMED_SERVER)
@with_fields(live=LIVE, gate=GATE, train=LIVE_TRAIN, budget=BUDGET)
def live_start(
    model: _MODEL,
    server: _SERVER = "http://127.0.0.1:7800",
    token: _SERVER_TOKEN = None,
    *,
    live: dict[str, Any],
    gate: dict[str, Any],
    train: dict[str, Any],
    budget: dict[str, Any],
) -> None:
    """Start (or reconfigure) live training of a served model: scored episodes train candidates in the
    background, and the gate decides which serve; `--budget-*` caps what the run spends from now on."""
    config = LIVE.build(live, gate=GATE.build(gate), train=LIVE_TRAIN.build(train), budget=budget_of(budget))
    status = _remote_call(server, token, model, lambda b, m: b.live(m, config))
    typer.echo(_status_text(status))


@live_app.command("status", renamed=_RENAMED_SERVER)
def live_status(
    model: _MODEL,
    server: _SERVER = "http://127.0.0.1:7800",
    token: _SERVER_TOKEN = None,
    as_json: Annotated[bool, typer.Option("--json", help="the LiveStatus as JSON")] = False,
) -> None:
    """Traffic, waiting episodes, the candidate, the promoted step and the last decisions."""
    status = _remote_call(server, token, model, lambda b, m: b.live_status(m))
    typer.echo(status.model_dump_json(indent=1) if as_json else _status_text(status))


@live_app.command("decide", renamed=_RENAMED_SERVER)
def live_decide(
    model: _MODEL,
    action: Annotated[str, typer.Argument(help="promote, reject or rollback")],
    step: Annotated[
        int | None, typer.Option(help="default: the candidate; for rollback, the promoted step")
    ] = None,
    reason: Annotated[str, typer.Option(help="why (kept in the history row)")] = "",
    server: _SERVER = "http://127.0.0.1:7800",
    token: _SERVER_TOKEN = None,
) -> None:
    """Promote a step, reject the candidate, or roll the promoted step back to its parent."""
    if action not in ("promote", "reject", "rollback"):
        raise typer.BadParameter("use promote, reject or rollback", param_hint="action")
    d = _remote_call(server, token, model, lambda b, m: b.decide(m, action, step, reason))
    typer.echo(f"{d.action} step {d.step}: serving step {d.served} ({d.reason})")


@live_app.command("langfuse", renamed={**_RENAMED_SERVER, **LANGFUSE_RENAMED})
@with_fields(query=replace(LANGFUSE_QUERY, defaults={"score": None}))
def live_langfuse(
    model: _MODEL,
    server: _SERVER = "http://127.0.0.1:7800",
    token: _SERVER_TOKEN = None,
    episode_from: Annotated[
        str,
        typer.Option(
            help="where a trace holds its episode id: session_id, trace_id, trace_name or a metadata key"
        ),
    ] = "session_id",
    group_from: Annotated[
        str | None,
        typer.Option(help="where it holds the episode's group key, read the same way (default: none)"),
    ] = None,
    every: Annotated[float, typer.Option(help="seconds between two rounds; 0: one round and exit")] = 0.0,
    public_key: LangfusePublicKey = None,
    secret_key: LangfuseSecretKey = None,
    host: LangfuseHost = None,
    *,
    query: dict[str, Any],
) -> None:
    """Report scored Langfuse traces as the outcomes of a served model's live episodes (idempotent:
    run it on a timer, or with --every)."""
    import time

    if not query.get("score"):
        raise typer.BadParameter("name the score that becomes the reward", param_hint="--score")
    q = LANGFUSE_QUERY.build(query)

    async def once(backend: Any, m: ModelConfig) -> Any:
        from journeyman.integrations.langfuse import report_scored_outcomes

        return await report_scored_outcomes(
            functools.partial(backend.report_outcome, m),
            q,
            episode_from=episode_from,
            group_from=group_from,
            public_key=public_key,
            secret_key=secret_key,
            host=host,
        )

    while True:
        sync = _remote_call(server, token, model, once)
        skipped = ", ".join(f"{n} {why}" for why, n in sync.skipped.items()) or "none"
        typer.echo(
            f"{sync.traces} traces: {sync.reported} outcomes reported, {sync.duplicates} reported before; "
            f"skipped: {skipped}"
        )
        if every <= 0:
            return
        time.sleep(every)


def _status_text(s: LiveStatus) -> str:
    c = s.counts
    lines = [
        f"promoted step {s.promoted}, candidate {s.candidate if s.candidate is not None else '-'}, "
        f"latest checkpoint {s.latest}{'' if s.enabled else ' (live training off)'}",
        f"episodes: {s.episodes_open} open, {s.episodes_waiting} scored and waiting, {c.get('trained', 0)} trained "
        f"in {c.get('steps', 0)} steps",
        f"outcomes: {c.get('outcomes', 0)} ({c.get('duplicates', 0)} repeated, {c.get('unknown', 0)} unknown, "
        f"{c.get('refused_expired', 0)} too late); {c.get('expired', 0)} episodes expired, {c.get('stale', 0)} stale",
    ]
    if s.candidate is not None:
        k = s.canary
        lines.append(
            f"canary: candidate {k['candidate_reward']:.3f} (n={k['candidate_episodes']:.0f}) vs promoted "
            f"{k['promoted_reward']:.3f} (n={k['promoted_episodes']:.0f})"
        )
    for d in s.decisions[-5:]:
        lines.append(f"  {d.action} step {d.step} -> serving {d.served} by {d.by}: {d.reason}")
    if s.error:
        lines.append(f"last error: {s.error}")
    lines.append(f"spent: {spend_text(s.spent, s.limits)}")
    return "\n".join(lines)


if __name__ == "__main__":
    app()
