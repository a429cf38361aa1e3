"""The MCP·RL loop: connect → scenarios → (eval) → [rollout groups → RULER → GRPO step]* → eval.

settings = McpRlSettings(server=ServerSpec.parse("http://127.0.0.1:8000/mcp"), steps=10)
report = asyncio.run(train(settings))
print(report.table())
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import journeyman as jm
from journeyman.plot import plot_history
from pydantic import BaseModel, Field

from .reward import score_group
from .rollout import RolloutConfig, rollout
from .scenarios import GenerationReport, Scenario, ScenarioSet, generate_scenarios, split
from .server import ServerInfo, ServerSpec, ServerUnavailableError, SessionPool

Echo = Callable[[str], None]


class McpRlSettings(BaseModel):
    """Everything one `mcp-rl` command needs. Its files (scenarios, report, plot) go to `out_dir`,
    which is the run directory itself on a local backend."""

    server: ServerSpec
    path: Path = Field(
        default=Path(".journeyman"),
        description="run root (as `LocalBackend(path=...)`); the run lives in <path>/<project>/models/<model>",
    )
    project: str = "mcp-rl"
    model: str = "mcp-agent"
    base_model: str | None = None
    engine: str = "torch"
    backend: str | None = Field(
        default=None, description="URL of `journeyman serve` to train on (default: in this process)"
    )
    token: str | None = Field(
        default=None, repr=False, exclude=True, description="its token ($JOURNEYMAN_TOKEN)"
    )
    tools: list[str] = Field(default_factory=list, description="train on these tools only (all when empty)")
    judge: str = Field(
        "local", description='"local" (a frozen copy of the base model), "none", a URL or a LiteLLM id'
    )
    judge_model: str | None = None
    generator: str = Field(
        "local", description='"local" (the policy), "none" (schemas only), a URL or a LiteLLM id'
    )
    generator_model: str | None = None
    scenarios_file: Path | None = None
    num_scenarios: int = Field(default=16, ge=2)
    num_eval: int = Field(default=4, ge=1)
    steps: int = Field(default=3, ge=0)
    groups_per_step: int = Field(default=2, ge=1)
    group_size: int = Field(default=4, ge=2)
    learning_rate: float = Field(default=1e-4, gt=0)
    min_reward_spread: float = Field(
        default=0.05,
        ge=0,
        description="train only on groups whose rewards span at least this: a group that differs by the "
        "length term alone (every rollout failed, or every one succeeded) is skipped, not trained on noise",
    )
    scale_rewards: bool = Field(
        default=False,
        description="divide advantages by the group's reward std (GRPO). Off (Dr. GRPO): the reward is a 0/1 "
        "success plus small shaping terms, and in a group where every rollout failed the std scaling "
        "would blow those terms up into full-size advantages",
    )
    eval_every: int = Field(
        default=0, ge=0, description="also evaluate every K steps (0: only before and after)"
    )
    connections: int | None = Field(
        default=None,
        ge=1,
        description="MCP sessions shared by concurrent rollouts (default: one per rollout of a step, at most 32)",
    )
    max_arg_chars: int = Field(
        default=64, ge=0, description="cap string tool arguments at this many characters (0: off)"
    )
    max_exceptions: float = Field(
        default=0.25, ge=0, description="rollouts that may fail per step (count, or fraction < 1)"
    )
    seed: int = 0
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sft_warmup: Path | None = Field(
        default=None,
        description="before RL, fine-tune on the trajectories in this .jsonl (Trajectory or TrajectoryGroup "
        "lines, e.g. successful runs); only when the run starts at step 0",
    )
    sft: jm.SFTConfig = Field(default_factory=jm.SFTConfig, description="settings of the SFT warm-up")

    @property
    def pool_size(self) -> int:
        # Rollouts that wait for a session cannot share the engine's batch with the others.
        return self.connections or min(32, self.groups_per_step * self.group_size)

    @property
    def out_dir(self) -> Path:
        return self.path / self.project / "models" / self.model

    def open_backend(self) -> jm.Backend:
        return jm.open_backend(self.backend, token=self.token, path=self.path, engine=self.engine)


class EvalSummary(BaseModel):
    step: int
    scenarios: int
    success: float
    success_sem: float
    reward: float
    tool_calls: float
    tool_error_rate: float
    invalid_calls: float
    completed: float
    failed_rollouts: int = 0


class TrainReport(BaseModel):
    run_dir: Path
    scenarios_file: Path
    generation: GenerationReport | None = None
    evals: list[EvalSummary]
    steps: list[dict[str, Any]]
    plot: Path | None = None

    def table(self) -> str:
        """Before/after (and intermediate) held-out results as a fixed-width text table."""
        cols = ["step", "success", "reward", "calls/ep", "tool err", "invalid/ep", "completed"]
        rows = [
            [
                str(e.step),
                f"{e.success:.2f} ± {e.success_sem:.2f}",
                f"{e.reward:.3f}",
                f"{e.tool_calls:.2f}",
                f"{e.tool_error_rate:.2f}",
                f"{e.invalid_calls:.2f}",
                f"{e.completed:.2f}",
            ]
            for e in self.evals
        ]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        line = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True))  # noqa: E731
        n = self.evals[0].scenarios if self.evals else 0
        return "\n".join(
            [f"held-out eval ({n} scenarios, greedy)", line(cols), line(["-" * w for w in widths])]
            + [line(r) for r in rows]
        )


def _summary(step: int, groups: list[jm.TrajectoryGroup], failed: int) -> EvalSummary:
    ts = [t for g in groups for t in g.trajectories]
    if not ts:
        return EvalSummary(
            step=step,
            scenarios=0,
            success=0,
            success_sem=0,
            reward=0,
            tool_calls=0,
            tool_error_rate=0,
            invalid_calls=0,
            completed=0,
            failed_rollouts=failed,
        )
    succ = [float(t.metrics["success"]) for t in ts]
    calls = sum(float(t.metrics["tool_calls"]) for t in ts)
    return EvalSummary(
        step=step,
        scenarios=len(ts) + failed,
        success=statistics.mean(succ + [0.0] * failed),  # a failed rollout is a failure
        success_sem=statistics.stdev(succ) / math.sqrt(len(succ)) if len(succ) > 1 else 0.0,
        reward=statistics.mean(t.metrics.get("independent_reward", t.reward) for t in ts),
        tool_calls=calls / len(ts),
        tool_error_rate=sum(float(t.metrics["tool_errors"]) for t in ts) / calls if calls else 0.0,
        invalid_calls=statistics.mean(float(t.metrics["invalid_calls"]) for t in ts),
        completed=statistics.mean(float(t.metrics["completed"]) for t in ts),
        failed_rollouts=failed,
    )


async def _rollout_on_pool(pool: SessionPool, *args: Any, **kwargs: Any) -> jm.Trajectory:
    async with pool.lease() as conn:
        return await rollout(*args, conn=conn, **kwargs)


async def evaluate(
    model: jm.TrainableModel,
    pool: SessionPool,
    info: ServerInfo,
    scenarios: list[Scenario],
    cfg: RolloutConfig,
    *,
    log: bool = True,
) -> tuple[EvalSummary, list[jm.TrajectoryGroup]]:
    """One greedy episode per held-out scenario; judge-free metrics, logged as split "val"."""
    client = model.openai_client()
    greedy = cfg.model_copy(update={"temperature": 0.0})
    step = await model.get_step()
    groups = [
        jm.TrajectoryGroup(
            [_rollout_on_pool(pool, model, client, info=info, scenario=s, cfg=greedy, seed=0)],
            metadata={"scenario_id": s.id},
        )
        for s in scenarios
    ]
    try:
        done = await jm.gather_trajectory_groups(
            groups, pbar_desc=f"eval@{step}", max_exceptions=len(scenarios)
        )
    except jm.TooManyExceptionsError as e:
        done = e.groups
    failed = sum(len(g.exceptions) for g in groups)
    for g in done:
        for t in g.trajectories:
            t.metrics["independent_reward"] = t.reward
    summary = _summary(step, done, failed)
    if log and done:
        # val/success is the mean of the rollouts' metrics; its SEM rides in the same row
        await model.log(done, split="val", metrics={"success_sem": summary.success_sem})
    return summary, done


async def evaluate_and_echo(
    model: jm.TrainableModel,
    pool: SessionPool,
    info: ServerInfo,
    scenarios: list[Scenario],
    cfg: RolloutConfig,
    echo: Echo,
) -> EvalSummary:
    summary, _ = await evaluate(model, pool, info, scenarios, cfg)
    echo(
        f"eval@{summary.step}: success {summary.success:.2f} ± {summary.success_sem:.2f}, "
        f"calls/ep {summary.tool_calls:.2f}"
    )
    return summary


async def load_or_generate(
    settings: McpRlSettings, info: ServerInfo, run_dir: Path, echo: Echo
) -> tuple[ScenarioSet, Path, GenerationReport | None]:
    """`--scenarios-file`, else the run's saved scenarios (resume), else freshly generated ones."""
    path = settings.scenarios_file or run_dir / "scenarios.json"
    if path.exists():
        sset = ScenarioSet.load(path)
        echo(f"scenarios: {len(sset.train)} train / {len(sset.eval)} eval from {path}")
        return sset, path, None
    if settings.scenarios_file is not None:
        raise jm.InvalidFieldError("scenarios_file", str(path), "no such file")
    scenarios, report = await generate_scenarios(
        info,
        settings.num_scenarios,
        generator=settings.generator,
        generator_model=settings.generator_model,
        seed=settings.seed,
    )
    train_s, eval_s = split(scenarios, settings.num_eval, seed=settings.seed)
    sset = ScenarioSet(server=settings.server.label(), tools=info.tool_names(), train=train_s, eval=eval_s)
    sset.save(path)
    echo(
        f"scenarios: {report.from_generator} from generator={settings.generator!r}, {report.from_schema} from "
        f"tool schemas ({report.rejected} generated rejected"
        + (f"; generator failed: {report.generator_error}" if report.generator_error else "")
        + f") -> {len(train_s)} train / {len(eval_s)} eval, saved to {path}"
    )
    return sset, path, report


async def sft_warmup(
    model: jm.TrainableModel, trajectories: list[jm.Trajectory], config: jm.SFTConfig, echo: Echo
) -> bool:
    """Supervised fine-tuning before any RL step; False when the run has already trained (a
    resume), since the warm-up is in its checkpoints already."""
    step = await model.get_step()
    if step > 0:
        echo(f"sft warm-up skipped: the run resumes at step {step}")
        return False
    result = await model.train_sft(trajectories, config=config)
    m = result.metrics
    echo(
        f"sft warm-up on {len(trajectories)} trajectories: loss {m['loss_first_epoch']:.3f} -> {m['loss']:.3f} "
        f"over {m['epochs']:.0f} epochs, {m['train_seconds']:.0f}s; now at step {result.step}"
    )
    return True


async def connect(settings: McpRlSettings, echo: Echo) -> tuple[SessionPool, ServerInfo]:
    # A stdio server's stderr (often chatty logging) goes to a file in the run directory.
    errlog = settings.path / settings.project / "models" / settings.model / "mcp_server.log"
    pool = SessionPool(settings.server, size=settings.pool_size, errlog=errlog)
    await pool.__aenter__()
    try:
        info = (await pool.describe()).select(settings.tools).bounded(settings.max_arg_chars)
    except BaseException:
        await pool.__aexit__(None, None, None)
        raise
    if not info.tools:
        await pool.__aexit__(None, None, None)
        raise ServerUnavailableError(f"the MCP server {settings.server.label()} offers no tools")
    echo(
        f"server {info.name!r}: {len(info.tools)} tools ({', '.join(info.tool_names())}), "
        f"{len(info.resources)} resources, {len(info.prompts)} prompts"
    )
    return pool, info


async def train(settings: McpRlSettings, echo: Echo = print) -> TrainReport:
    # a bad warm-up file fails now, not after the model loaded and the first evaluation ran
    warmup = jm.read_trajectories(settings.sft_warmup) if settings.sft_warmup is not None else None
    pool, info = await connect(settings, echo)
    backend = settings.open_backend()
    try:
        model = jm.TrainableModel(
            name=settings.model,
            project=settings.project,
            base_model=settings.base_model or jm.DEFAULT_BASE_MODEL,
        )
        echo("loading the policy...")
        await model.register(backend)
        judge = settings.judge
        if judge == "local":
            # A frozen copy of the base model judges, so the policy never grades itself.
            judge_model = jm.TrainableModel(
                name=f"{settings.model}-judge",
                project=settings.project,
                base_model=settings.base_model or jm.DEFAULT_BASE_MODEL,
            )
            await judge_model.register(backend)
            judge = f"local:{judge_model.name}"
        generator = f"local:{model.name}" if settings.generator == "local" else settings.generator
        sset, spath, gen = await load_or_generate(
            settings.model_copy(update={"generator": generator}), info, settings.out_dir, echo
        )
        cfg = settings.rollout
        evals: list[EvalSummary] = []
        evals.append(await evaluate_and_echo(model, pool, info, sset.eval, cfg, echo))
        if warmup is not None and await sft_warmup(model, warmup, settings.sft, echo):
            evals.append(await evaluate_and_echo(model, pool, info, sset.eval, cfg, echo))
        client = model.openai_client()
        score = functools.partial(score_group, judge=judge, judge_model=settings.judge_model, backend=backend)
        config = jm.TrainConfig(
            learning_rate=settings.learning_rate,
            scale_rewards=settings.scale_rewards,
            min_reward_spread=settings.min_reward_spread,
        )
        rng = random.Random(settings.seed)
        order: list[Scenario] = []
        steps: list[dict[str, Any]] = []
        for i in range(settings.steps):
            step = await model.get_step()
            batch = []
            for _ in range(settings.groups_per_step):
                if not order:
                    order = rng.sample(sset.train, len(sset.train))
                batch.append(order.pop())
            t0 = time.perf_counter()
            groups = [
                jm.TrajectoryGroup(
                    (
                        _rollout_on_pool(pool, model, client, info=info, scenario=s, cfg=cfg)
                        for _ in range(settings.group_size)
                    ),
                    metadata={"scenario_id": s.id, "task": s.task},
                )
                for s in batch
            ]
            try:
                groups = await jm.gather_trajectory_groups(
                    groups, pbar_desc=f"step {step}", max_exceptions=settings.max_exceptions, after_each=score
                )
            except jm.TooManyExceptionsError as e:
                first = next((x for g in groups for x in g.exceptions), None)
                raise ServerUnavailableError(
                    f"{e.failed} of {e.total} rollouts failed at step {step} (max_exceptions="
                    f"{settings.max_exceptions:g}); first: {first.type + ': ' + first.message if first else '?'}"
                ) from None
            rollout_s = time.perf_counter() - t0
            groups = [g for g in groups if len(g.trajectories) >= 2]
            ts = [t for g in groups for t in g.trajectories]
            row: dict[str, Any] = {"step": step, "rollout_seconds": round(rollout_s, 1)}
            if ts:
                row.update(
                    reward=statistics.mean(t.reward for t in ts),
                    success=statistics.mean(float(t.metrics["success"]) for t in ts),
                    tool_calls=statistics.mean(float(t.metrics["tool_calls"]) for t in ts),
                    failed=sum(len(g.exceptions) for g in groups),
                )
                await model.log(split="train", metrics={"success": row["success"]})
                result = await model.train(groups, config=config)
                row.update(
                    new_step=result.step,
                    skipped=result.skipped,
                    train_seconds=round(result.metrics.get("train_seconds", 0.0), 1),
                )
            else:
                row.update(skipped=True)
            steps.append(row)
            echo(
                f"step {step}: reward {row.get('reward', float('nan')):.3f}, success {row.get('success', float('nan')):.2f}, "
                f"calls/ep {row.get('tool_calls', float('nan')):.2f}, rollouts {rollout_s:.0f}s, "
                f"train {row.get('train_seconds', 0):.0f}s{' (skipped: no reward spread)' if row.get('skipped') else ''}"
            )
            if settings.eval_every and (i + 1) % settings.eval_every == 0 and i + 1 < settings.steps:
                evals.append(await evaluate_and_echo(model, pool, info, sset.eval, cfg, echo))
        if settings.steps:
            evals.append(await evaluate_and_echo(model, pool, info, sset.eval, cfg, echo))
        run_dir = settings.out_dir
        plot = plot_history(
            await model.history(),
            run_dir / "reward.png",
            title=f"mcp-rl: {info.name} ({settings.model}), task success",
            metric="success",
        )
        report = TrainReport(
            run_dir=run_dir, scenarios_file=spath, generation=gen, evals=evals, steps=steps, plot=plot
        )
        (run_dir / "mcp_rl_report.json").write_text(report.model_dump_json(indent=2))
        return report
    finally:
        backend.close()
        await pool.__aexit__(None, None, None)


async def eval_step(settings: McpRlSettings, step: int | None, echo: Echo = print) -> EvalSummary:
    """Evaluate checkpoint `step` (latest when None; 0 = the base model) on the run's eval scenarios."""
    pool, info = await connect(settings, echo)
    backend = settings.open_backend()
    try:
        model = jm.TrainableModel(
            name=settings.model,
            project=settings.project,
            base_model=settings.base_model or jm.DEFAULT_BASE_MODEL,
        )
        await model.register(backend)
        if step is not None:
            await model.serve_step(step)  # refuses a step the run does not have, naming it
        run_dir = settings.out_dir
        sset, _, _ = await load_or_generate(
            settings.model_copy(
                update={"scenarios_file": settings.scenarios_file or run_dir / "scenarios.json"}
            ),
            info,
            run_dir,
            echo,
        )
        summary, _ = await evaluate(model, pool, info, sset.eval, settings.rollout, log=False)
        return summary
    finally:
        backend.close()
        await pool.__aexit__(None, None, None)
