"""`mcp-rl`: teach a model to use an MCP server's tools, from nothing but the server.

mcp-rl train http://127.0.0.1:8000/mcp --steps 10
mcp-rl train -- mcp-server-time --local-timezone UTC
mcp-rl scenarios stdio:"python examples/mcp_todo_server.py" --num-scenarios 8
mcp-rl eval http://127.0.0.1:8000/mcp --step 3
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:  # imported lazily at run time: `--help` stays fast
    from .train import McpRlSettings

T = TypeVar("T")

app = typer.Typer(
    help="MCP·RL: train a model to use any MCP server's tools (scenarios, rollouts, RULER, GRPO).",
    no_args_is_help=True,
    add_completion=False,
)

Server = Annotated[
    list[str],
    typer.Argument(
        help="the server: a Streamable HTTP URL (http://host:port/mcp), an SSE URL (.../sse), "
        "'stdio:<command>', or a command after '--' (mcp-rl train -- mcp-server-time)",
        show_default=False,
    ),
]
RunRoot = Annotated[
    Path,
    typer.Option(
        "--path", help="run root (as LocalBackend(path=...)); the run is <path>/<project>/models/<model>"
    ),
]
ModelName = Annotated[str, typer.Option("--model", help="name of the trained model (its run directory)")]
Project = Annotated[str, typer.Option(help="project name (a directory under --path)")]
BaseModel_ = Annotated[
    str | None,
    typer.Option(
        "--base-model",
        help="embedded model name, local HF directory or hub id (default: embedded SmolLM2-135M)",
    ),
]
Engine = Annotated[str, typer.Option(help="inference engine: torch (in process) or vllm")]
BackendUrl = Annotated[
    str | None,
    typer.Option("--backend", help="train on `journeyman serve` at this URL (default: in this process)"),
]
Token = Annotated[str | None, typer.Option(help="the server's token (default: $JOURNEYMAN_TOKEN)")]
Tools = Annotated[
    str | None, typer.Option("--tools", help="comma-separated tool names to train on (default: all)")
]
Generator = Annotated[
    str,
    typer.Option(
        help="scenario generator: local (the policy), none (tool schemas only), an OpenAI-compatible URL, or a LiteLLM id"
    ),
]
GeneratorModel = Annotated[str | None, typer.Option(help="model to ask when --generator is a URL")]
ScenariosFile = Annotated[
    Path | None, typer.Option(help="read scenarios from this JSON file (as written by `mcp-rl scenarios`)")
]
NumScenarios = Annotated[int, typer.Option(help="scenarios to generate (train + eval)")]
NumEval = Annotated[int, typer.Option(help="of those, held out for evaluation")]
MaxTurns = Annotated[int, typer.Option(help="model turns per episode")]
MaxTokens = Annotated[int, typer.Option(help="max tokens per model turn")]
ForcedTurns = Annotated[int, typer.Option(help="first turns forced to be a tool call (tool_choice=required)")]
Connections = Annotated[
    int | None,
    typer.Option(
        help="MCP sessions shared by concurrent rollouts (default: one per rollout of a step, at most 32)",
        show_default=False,
    ),
]
MaxArgChars = Annotated[
    int,
    typer.Option(
        help="cap string tool arguments at this many characters, so forced calls always close (0: off)"
    ),
]
Seed = Annotated[int, typer.Option(help="seed for scenario generation, split and sampling order")]
Judge = Annotated[
    str,
    typer.Option(
        help="RULER judge, for the training reward and the win rate: local (a frozen copy of the base "
        "model), none, an OpenAI-compatible URL, or a LiteLLM id"
    ),
]
JudgeModel = Annotated[str | None, typer.Option(help="model to ask when --judge is a URL")]
Against = Annotated[
    str,
    typer.Option(
        help="baseline for the held-out win rate: base (the base model, step 0), none (no comparison), "
        "local:<name>, an OpenAI-compatible URL (with --against-model) or a LiteLLM id"
    ),
]
AgainstModel = Annotated[str | None, typer.Option(help="model to ask when --against is a URL")]
EvalSamples = Annotated[
    int,
    typer.Option(
        help="sampled episodes per held-out scenario at --temperature, reported beside the greedy one (0: off)"
    ),
]
Temperature = Annotated[
    float, typer.Option(help="sampling temperature of training rollouts and sampled evaluation")
]


def _settings(server: list[str], **kw: Any) -> McpRlSettings:  # typer has checked each value's type
    from .rollout import RolloutConfig
    from .server import ServerSpec
    from .train import McpRlSettings

    tools = kw.pop("tools")
    rollout_keys = {"max_turns", "forced_turns", "max_tokens", "tool_timeout", "shaping", "temperature"}
    rollout = RolloutConfig(**{k: kw.pop(k) for k in list(kw) if k in rollout_keys})
    return McpRlSettings(
        server=ServerSpec.parse(server),
        tools=[t.strip() for t in str(tools).split(",") if t.strip()] if tools else [],
        rollout=rollout,
        **kw,
    )


def _run(coro_fn: Callable[..., Coroutine[Any, Any, T]], *args: object) -> T:
    """Run, turning the errors a user can fix into one clear line and exit code 1 (no traceback)."""
    from journeyman.errors import JourneymanError

    try:
        return asyncio.run(coro_fn(*args))
    except (JourneymanError, ImportError, FileNotFoundError) as e:
        typer.secho(f"mcp-rl: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.secho("mcp-rl: interrupted", fg=typer.colors.RED, err=True)
        raise typer.Exit(130) from None


def _checked(make: Callable[[], T]) -> T:
    """A setting built from options, or one clear line and exit code 2 naming the bad one."""
    from journeyman.errors import JourneymanError

    try:
        return make()
    except JourneymanError as e:
        typer.secho(f"mcp-rl: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


def _echo(msg: str) -> None:
    typer.echo(msg, err=True)


@app.command()
def train(
    server: Server,
    model: ModelName = "mcp-agent",
    project: Project = "mcp-rl",
    base_model: BaseModel_ = None,
    judge: Judge = "local",
    judge_model: JudgeModel = None,
    against: Against = "base",
    against_model: AgainstModel = None,
    eval_samples: EvalSamples = 1,
    generator: Generator = "local",
    generator_model: GeneratorModel = None,
    scenarios_file: ScenariosFile = None,
    num_scenarios: NumScenarios = 16,
    num_eval: NumEval = 4,
    steps: Annotated[int, typer.Option(help="training steps")] = 3,
    groups_per_step: Annotated[int, typer.Option(help="scenarios per step")] = 2,
    group_size: Annotated[int, typer.Option(help="rollouts per scenario (GRPO group)")] = 4,
    learning_rate: Annotated[float, typer.Option(help="AdamW learning rate of the LoRA")] = 1e-4,
    scale_rewards: Annotated[
        bool,
        typer.Option(
            help="divide advantages by each group's reward std (GRPO); off: centre only (Dr. GRPO), so "
            "small shaping terms stay small in groups that all failed"
        ),
    ] = False,
    min_reward_spread: Annotated[
        float,
        typer.Option(help="skip groups whose rewards span less than this (they differ by tie-breakers only)"),
    ] = 0.05,
    max_turns: MaxTurns = 3,
    forced_turns: ForcedTurns = 1,
    max_tokens: MaxTokens = 96,
    temperature: Temperature = 1.0,
    tool_timeout: Annotated[float, typer.Option(help="seconds per tool call")] = 30.0,
    shaping: Annotated[float, typer.Option(help="reward weight of the valid-tool-call fraction")] = 0.1,
    eval_every: Annotated[
        int, typer.Option(help="also evaluate every K steps (0: before and after only)")
    ] = 0,
    tools: Tools = None,
    connections: Connections = None,
    max_arg_chars: MaxArgChars = 64,
    max_exceptions: Annotated[
        float, typer.Option(help="failed rollouts tolerated per step (count, or fraction < 1)")
    ] = 0.25,
    sft_warmup: Annotated[
        Path | None,
        typer.Option(
            help="before RL, fine-tune on the trajectories in this .jsonl (Trajectory or TrajectoryGroup "
            "lines, e.g. successful runs); skipped when the run resumes past step 0"
        ),
    ] = None,
    sft_epochs: Annotated[int, typer.Option(help="epochs of the SFT warm-up")] = 2,
    sft_learning_rate: Annotated[float, typer.Option(help="peak learning rate of the SFT warm-up")] = 2e-4,
    engine: Engine = "torch",
    path: RunRoot = Path(".journeyman"),
    backend: BackendUrl = None,
    token: Token = None,
    seed: Seed = 0,
) -> None:
    """Generate scenarios, evaluate, (fine-tune on --sft-warmup and evaluate,) train with RULER + GRPO,
    evaluate again, have the judge compare the trained runs with the baseline's; print a before/after
    table with the win rate."""
    import journeyman as jm

    from .train import train as run_train

    settings = _settings(
        server,
        model=model,
        project=project,
        base_model=base_model,
        judge=judge,
        judge_model=judge_model,
        against=against,
        against_model=against_model,
        eval_samples=eval_samples,
        generator=generator,
        generator_model=generator_model,
        scenarios_file=scenarios_file,
        num_scenarios=num_scenarios,
        num_eval=num_eval,
        steps=steps,
        groups_per_step=groups_per_step,
        group_size=group_size,
        learning_rate=learning_rate,
        scale_rewards=scale_rewards,
        min_reward_spread=min_reward_spread,
        max_turns=max_turns,
        forced_turns=forced_turns,
        max_tokens=max_tokens,
        temperature=temperature,
        tool_timeout=tool_timeout,
        shaping=shaping,
        eval_every=eval_every,
        tools=tools,
        connections=connections,
        max_arg_chars=max_arg_chars,
        max_exceptions=max_exceptions,
        engine=engine,
        path=path,
        backend=backend,
        token=token,
        seed=seed,
        sft_warmup=sft_warmup,
        sft=_checked(lambda: jm.SFTConfig(epochs=sft_epochs, learning_rate=sft_learning_rate)),
    )
    report = _run(run_train, settings, _echo)
    typer.echo(report.table())
    typer.echo(f"run directory: {report.run_dir}")
    typer.echo(f"checkpoints:   {report.run_dir / 'checkpoints'}")
    typer.echo(f"reward curve:  {report.plot}")
    typer.echo(f"scenarios:     {report.scenarios_file}")


@app.command()
def scenarios(
    server: Server,
    generator: Generator = "local",
    generator_model: GeneratorModel = None,
    num_scenarios: NumScenarios = 16,
    num_eval: NumEval = 4,
    tools: Tools = None,
    base_model: BaseModel_ = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="where to write the scenarios JSON")] = Path(
        "scenarios.json"
    ),
    seed: Seed = 0,
) -> None:
    """Generate scenarios for a server and save them (edit by hand, then pass --scenarios-file to train)."""
    from .scenarios import ScenarioSet, generate_scenarios, split
    from .train import connect

    settings = _settings(
        server,
        tools=tools,
        generator=generator,
        generator_model=generator_model,
        num_scenarios=num_scenarios,
        num_eval=num_eval,
        base_model=base_model,
        seed=seed,
        connections=1,
    )

    async def go() -> ScenarioSet:
        import journeyman as jm

        pool, info = await connect(settings, _echo)
        backend = None
        try:
            gen = generator
            if generator == "local":  # the policy model generates: serve it for this command
                backend = jm.LocalBackend(path=Path(".journeyman"))
                m = jm.TrainableModel(
                    name="mcp-rl-generator",
                    project="mcp-rl",
                    base_model=base_model or jm.DEFAULT_BASE_MODEL,
                )
                _echo("loading the generator model...")
                await m.register(backend)
                gen = f"local:{m.name}"
            items, rep = await generate_scenarios(
                info, num_scenarios, generator=gen, generator_model=generator_model, seed=seed
            )
            _echo(
                f"{rep.from_generator} from the generator, {rep.from_schema} from tool schemas, "
                f"{rep.rejected} rejected, {rep.checks} end-state checks ({rep.checks_rejected} dropped)"
                + (f"; generator failed: {rep.generator_error}" if rep.generator_error else "")
            )
            tr, ev = split(items, num_eval, seed=seed)
            return ScenarioSet(server=settings.server.label(), tools=info.tool_names(), train=tr, eval=ev)
        finally:
            if backend is not None:
                backend.close()
            await pool.__aexit__(None, None, None)

    sset = _run(go)
    sset.save(output)
    for split_name, items in (("train", sset.train), ("eval", sset.eval)):
        for s in items:
            checks = f" [{len(s.checks)} checks]" if s.checks else ""
            typer.echo(f"[{split_name}] d{s.difficulty} {','.join(s.tools):<20} {s.task}{checks}")
    typer.echo(f"saved to {output}")


@app.command("eval")
def eval_(
    server: Server,
    step: Annotated[
        int | None, typer.Option(help="checkpoint step to evaluate (0 = base model; default: latest)")
    ] = None,
    model: ModelName = "mcp-agent",
    project: Project = "mcp-rl",
    base_model: BaseModel_ = None,
    scenarios_file: ScenariosFile = None,
    judge: Judge = "local",
    judge_model: JudgeModel = None,
    against: Against = "base",
    against_model: AgainstModel = None,
    eval_samples: EvalSamples = 1,
    temperature: Temperature = 1.0,
    max_turns: MaxTurns = 3,
    forced_turns: ForcedTurns = 1,
    max_tokens: MaxTokens = 96,
    tools: Tools = None,
    connections: Connections = None,
    max_arg_chars: MaxArgChars = 64,
    engine: Engine = "torch",
    path: RunRoot = Path(".journeyman"),
    backend: BackendUrl = None,
    token: Token = None,
) -> None:
    """Evaluate a checkpoint of a trained run on its held-out scenarios (greedy and sampled), and its
    win rate against a baseline (the base model by default) by the judge."""
    from .train import eval_step

    settings = _settings(
        server,
        model=model,
        project=project,
        base_model=base_model,
        scenarios_file=scenarios_file,
        judge=judge,
        judge_model=judge_model,
        against=against,
        against_model=against_model,
        eval_samples=eval_samples,
        temperature=temperature,
        max_turns=max_turns,
        forced_turns=forced_turns,
        max_tokens=max_tokens,
        tools=tools,
        connections=connections,
        max_arg_chars=max_arg_chars,
        engine=engine,
        path=path,
        backend=backend,
        token=token,
    )
    report = _run(eval_step, settings, step, _echo)
    typer.echo(report.table())


if __name__ == "__main__":
    app()
