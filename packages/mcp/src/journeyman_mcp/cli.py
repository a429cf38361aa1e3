"""`mcp-rl`: teach a model to use an MCP server's tools, from nothing but the server.

mcp-rl train http://127.0.0.1:8000/mcp --steps 10
mcp-rl train -- mcp-server-time --local-timezone UTC
mcp-rl scenarios stdio:"python examples/mcp_todo_server.py" --num-scenarios 8
mcp-rl scenarios -o scenarios.json -- python my_server.py
mcp-rl eval http://127.0.0.1:8000/mcp --step 3

Everything after `--` is the server's command line: mcp-rl's own options go before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from journeyman.integrations import ADVANCED, BUDGET, App, Fields, RunLayout, budget_of, with_fields

from .train import McpRlSettings  # the options are its fields (the package imports it anyway)

T = TypeVar("T")

app = App(help="MCP·RL: train a model to use any MCP server's tools (scenarios, rollouts, RULER, GRPO).")

Server = Annotated[
    list[str],
    typer.Argument(
        help="the server: a Streamable HTTP URL (http://host:port/mcp), an SSE URL (.../sse), "
        "'stdio:<command>', or a command after '--' (mcp-rl train -- mcp-server-time)",
        show_default=False,
    ),
]
Tools = Annotated[
    str | None, typer.Option("--tools", help="comma-separated tool names to train on (default: all)")
]

# The options are McpRlSettings' fields (and its nested configs'): help, default and type come from
# the model. Only the server (the argument) and --tools (comma-separated) are written here.
_OWN = {"server", "tools", "rollout", "train", "sft", "budget"}
SETTINGS = Fields(McpRlSettings, exclude=_OWN, extra={"token": {"show_default": False}})
EVAL_SETTINGS = replace(
    SETTINGS,
    exclude=(),
    only=[
        *("model", "project", "base_model", "engine", "path", "backend", "token", "scenarios_file"),
        *("judge", "judge_model", "against", "against_model", "eval_samples", "connections", "max_arg_chars"),
    ],
)
SCENARIO_SETTINGS = Fields(
    McpRlSettings, only=["generator", "generator_model", "num_scenarios", "num_eval", "base_model", "seed"]
)
ROLLOUT = Fields.nested(McpRlSettings, "rollout", panel="Episodes (RolloutConfig)")
TRAIN = Fields.nested(  # distillation's teacher is set from Python (McpRlSettings.train.distill)
    McpRlSettings, "train", exclude={"distill"}, panel="Training step (TrainConfig)", advanced=ADVANCED
)
SFT = Fields.nested(
    McpRlSettings, "sft", prefix="sft_", panel="SFT warm-up (SFTConfig; with --sft-warmup)", advanced=ADVANCED
)


def _settings(
    ctx: typer.Context,
    server: list[str],
    tools: str | None,
    fields: Fields,
    values: dict[str, Any],
    **extra: Any,
) -> McpRlSettings:
    from .server import ServerSpec

    _check_server_args(ctx, server)
    picked = [t.strip() for t in tools.split(",") if t.strip()] if tools else []
    return fields.build(values, server=ServerSpec.parse(server), tools=picked, **extra)


def _check_server_args(ctx: typer.Context, server: list[str]) -> None:
    """Refuse a server command line (after `--`) holding one of this command's options: everything
    after `--` goes to the server, so `-o x` there would be the server's, not mcp-rl's."""
    ours = {o for p in ctx.command.params for o in p.opts if o != "--help"}
    misplaced = [a for a in server[1:] if a.partition("=")[0] in ours]
    if misplaced:
        raise typer.BadParameter(
            f"{' '.join(misplaced)} after '--' would go to the server: put mcp-rl's options before '--' "
            f'(a server that takes {misplaced[0]} itself: pass it as stdio:"<its command line>")',
            param_hint="SERVER",
        )


def _run(coro_fn: Callable[..., Coroutine[Any, Any, T]], *args: object) -> T:
    """Run the command's work (its errors: one line, from `App`)."""
    return asyncio.run(coro_fn(*args))


def _echo(msg: str) -> None:
    typer.echo(msg, err=True)


@app.command()
@with_fields(settings=SETTINGS, rollout=ROLLOUT, train=TRAIN, sft=SFT, budget=BUDGET)
def train(
    ctx: typer.Context,
    server: Server,
    tools: Tools = None,
    *,
    settings: dict[str, Any],
    rollout: dict[str, Any],
    train: dict[str, Any],
    sft: dict[str, Any],
    budget: dict[str, Any],
) -> None:
    """Generate scenarios, evaluate, (fine-tune on --sft-warmup and evaluate,) train with RULER + GRPO,
    evaluate again, have the judge compare the trained runs with the baseline's; print a before/after
    table with the win rate."""
    from .train import train as run_train

    s = _settings(
        ctx,
        server,
        tools,
        SETTINGS,
        settings,
        rollout=ROLLOUT.build(rollout),
        train=TRAIN.build(train),
        sft=SFT.build(sft),
        budget=budget_of(budget),
    )
    report = _run(run_train, s, _echo)
    typer.echo(report.table())
    typer.echo(f"run directory: {report.run_dir}")
    typer.echo(f"checkpoints:   {RunLayout(report.run_dir).checkpoints}")
    typer.echo(f"reward curve:  {report.plot}")
    typer.echo(f"scenarios:     {report.scenarios_file}")


@app.command()
@with_fields(settings=SCENARIO_SETTINGS)
def scenarios(
    ctx: typer.Context,
    server: Server,
    tools: Tools = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="where to write the scenarios JSON")] = Path(
        "scenarios.json"
    ),
    *,
    settings: dict[str, Any],
) -> None:
    """Generate scenarios for a server and save them (edit by hand, then pass --scenarios-file to train)."""
    from .scenarios import ScenarioSet, generate_scenarios, split
    from .train import connect

    s = _settings(ctx, server, tools, SCENARIO_SETTINGS, settings, connections=1)

    async def go() -> ScenarioSet:
        import journeyman as jm

        pool, info = await connect(s, _echo)
        backend = None
        try:
            gen = s.generator
            if gen == "local":  # the policy model generates: serve it for this command
                backend = jm.LocalBackend(path=Path(".journeyman"))
                m = jm.TrainableModel(
                    name="mcp-rl-generator",
                    project="mcp-rl",
                    base_model=s.base_model or jm.DEFAULT_BASE_MODEL,
                )
                _echo("loading the generator model...")
                await m.register(backend)
                gen = f"local:{m.name}"
            items, rep = await generate_scenarios(
                info, s.num_scenarios, generator=gen, generator_model=s.generator_model, seed=s.seed
            )
            _echo(
                f"{rep.from_generator} from the generator, {rep.from_schema} from tool schemas, "
                f"{rep.rejected} rejected, {rep.checks} end-state checks ({rep.checks_rejected} dropped)"
                + (f"; generator failed: {rep.generator_error}" if rep.generator_error else "")
            )
            tr, ev = split(items, s.num_eval, seed=s.seed)
            return ScenarioSet(server=s.server.label(), tools=info.tool_names(), train=tr, eval=ev)
        finally:
            if backend is not None:
                backend.close()
            await pool.__aexit__(None, None, None)

    sset = _run(go)
    sset.save(output)
    for split_name, items in (("train", sset.train), ("eval", sset.eval)):
        for sc in items:
            checks = f" [{len(sc.checks)} checks]" if sc.checks else ""
            typer.echo(f"[{split_name}] d{sc.difficulty} {','.join(sc.tools):<20} {sc.task}{checks}")
    typer.echo(f"saved to {output}")


@app.command("eval")
@with_fields(settings=EVAL_SETTINGS, rollout=ROLLOUT)
def eval_(
    ctx: typer.Context,
    server: Server,
    step: Annotated[
        int | None, typer.Option(help="checkpoint step to evaluate (0 = base model; default: latest)")
    ] = None,
    tools: Tools = None,
    *,
    settings: dict[str, Any],
    rollout: dict[str, Any],
) -> None:
    """Evaluate a checkpoint of a trained run on its held-out scenarios (greedy and sampled), and its
    win rate against a baseline (the base model by default) by the judge."""
    from .train import eval_step

    s = _settings(ctx, server, tools, EVAL_SETTINGS, settings, rollout=ROLLOUT.build(rollout))
    report = _run(eval_step, s, step, _echo)
    typer.echo(report.table())


if __name__ == "__main__":
    app()
