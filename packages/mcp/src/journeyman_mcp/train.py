"""The MCP·RL loop: connect → scenarios → (eval) → [rollout groups → RULER → GRPO step]* → eval →
win rate against a baseline (the base model by default), judged pair by pair.

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
from journeyman.integrations import RunLayout, plot_history
from pydantic import BaseModel, Field, model_validator

from .players import BASE, NONE, Player, policy_player, resolve_against
from .reward import score_group
from .rollout import RolloutConfig, rollout
from .scenarios import GenerationReport, Scenario, ScenarioSet, generate_scenarios, split
from .server import ServerInfo, ServerSpec, ServerUnavailableError, SessionPool
from .winrate import WinRate, win_rate

Echo = Callable[[str], None]


def _mcp_train_config() -> jm.TrainConfig:
    """MCP·RL's training defaults. Skip groups whose rewards span < 0.05: a group that differs by the
    length term alone (every rollout failed, or every one succeeded) is not trained on noise. No std
    scaling (Dr. GRPO): the reward is a 0/1 success plus small shaping terms, and in a group where
    every rollout failed the scaling would blow those terms up into full-size advantages."""
    return jm.TrainConfig(learning_rate=1e-4, scale_rewards=False, min_reward_spread=0.05)


def _mcp_sft_config() -> jm.SFTConfig:
    """The SFT warm-up's defaults: two epochs at 2e-4 (a short, small data set of successful runs)."""
    return jm.SFTConfig(epochs=2, learning_rate=2e-4)


class McpRlSettings(BaseModel):
    """Everything one `mcp-rl` command needs (the `mcp-rl` options are these fields). Its files
    (scenarios, report, plot) go to `out_dir`, which is the run directory itself on a local backend."""

    server: ServerSpec
    path: Path = Field(
        default=Path(".journeyman"),
        description="run root (as `LocalBackend(path=...)`); the run lives in <path>/<project>/models/<model>",
    )
    project: str = Field(default="mcp-rl", description="project name (a directory under `path`)")
    model: str = Field(default="mcp-agent", description="name of the trained model (its run directory)")
    base_model: str | None = Field(
        default=None,
        description="embedded model name, local HF directory or hub id (default: the embedded SmolLM2-135M)",
    )
    engine: str = Field(default="torch", description="inference engine: torch (in process) or vllm")
    backend: str | None = Field(
        default=None, description="URL of `journeyman serve` to train on (default: in this process)"
    )
    token: str | None = Field(
        default=None,
        repr=False,
        exclude=True,
        description="the server's API token (default: $JOURNEYMAN_TOKEN)",
    )
    tools: list[str] = Field(default_factory=list, description="train on these tools only (all when empty)")
    judge: str = Field(
        default="local",
        description="RULER judge, for the training reward and the win rate: local (a frozen copy of the base "
        "model), none, an OpenAI-compatible URL, or a LiteLLM id",
    )
    judge_model: str | None = Field(default=None, description="model to ask when `judge` is a URL")
    generator: str = Field(
        default="local",
        description="scenario generator: local (the policy), none (tool schemas only), an OpenAI-compatible "
        "URL, or a LiteLLM id",
    )
    generator_model: str | None = Field(default=None, description="model to ask when `generator` is a URL")
    scenarios_file: Path | None = Field(
        default=None,
        description="read scenarios from this JSON file (as written by `mcp-rl scenarios`); default: the "
        "run's own, else generated",
    )
    num_scenarios: int = Field(default=16, ge=2, description="scenarios to generate (train + eval)")
    num_eval: int = Field(default=4, ge=1, description="of those, held out for evaluation")
    steps: int = Field(default=3, ge=0, description="training steps")
    groups_per_step: int = Field(default=2, ge=1, description="scenarios per step")
    group_size: int = Field(default=4, ge=2, description="rollouts per scenario (the GRPO group)")
    train: jm.TrainConfig = Field(
        default_factory=_mcp_train_config,
        description="settings of each training step, with MCP·RL's defaults (`_mcp_train_config`: "
        "learning_rate 1e-4, scale_rewards off, min_reward_spread 0.05)",
    )
    budget: jm.Budget | None = Field(
        default=None,
        description="hard caps on the run's spend (sampled and trained tokens, the RULER judge's dollars or "
        "tokens, wall time); the run stops with BudgetExceededError at one",
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
        default=64,
        ge=0,
        description="cap string tool arguments at this many characters, so forced calls always close (0: off)",
    )
    max_exceptions: float = Field(
        default=0.25, ge=0, description="rollouts that may fail per step (count, or fraction < 1)"
    )
    seed: int = Field(default=0, description="seed for scenario generation, split and sampling order")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="how each episode runs")
    eval_samples: int = Field(
        default=1,
        ge=0,
        description="sampled episodes per held-out scenario at the training temperature, reported beside "
        "the greedy one (0: greedy only); the same rollout and reward as training",
    )
    against: str = Field(
        default=BASE,
        description='the baseline the judge compares the trained policy with on held-out scenarios: "base" '
        '(the base model, step 0), "none" (no comparison), "local:<name>", an OpenAI-compatible URL '
        "(with against_model) or a LiteLLM id",
    )
    against_model: str | None = Field(default=None, description="model to ask when `against` is a URL")
    sft_warmup: Path | None = Field(
        default=None,
        description="before RL, fine-tune on the trajectories in this .jsonl (Trajectory or TrajectoryGroup "
        "lines, e.g. successful runs); only when the run starts at step 0",
    )
    sft: jm.SFTConfig = Field(
        default_factory=_mcp_sft_config,
        description="settings of the SFT warm-up, with MCP·RL's defaults (`_mcp_sft_config`)",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_train_fields(cls, data: Any) -> Any:
        """`learning_rate=...` (any TrainConfig field given flat, as before `train` held them) goes into
        `train`, over the settings' own training defaults."""
        if not isinstance(data, dict):
            return data
        flat = {
            k: v for k, v in data.items() if k in jm.TrainConfig.model_fields and k not in cls.model_fields
        }
        if not flat:
            return data
        given = data.get("train")
        base = dict(given) if isinstance(given, BaseModel) else dict(given or _mcp_train_config())
        return {**{k: v for k, v in data.items() if k not in flat}, "train": {**base, **flat}}

    @property
    def pool_size(self) -> int:
        # Rollouts that wait for a session cannot share the engine's batch with the others.
        return self.connections or min(32, self.groups_per_step * self.group_size)

    @property
    def out_dir(self) -> Path:
        return RunLayout.of(self.path, self.project, self.model).root

    def open_backend(self) -> jm.Backend:
        return jm.open_backend(self.backend, token=self.token, path=self.path, engine=self.engine)


TOO_EASY = 0.9
"""Held-out success of the base model at or above which the task set cannot show a gain."""


class EvalSummary(BaseModel):
    step: int
    scenarios: int
    success: float = Field(description="greedy")
    success_sem: float
    reward: float
    tool_calls: float
    tool_error_rate: float
    invalid_calls: float
    completed: float
    failed_rollouts: int = 0
    player: str = Field(default="policy", description="who played: the policy, or a baseline's label")
    samples: int = Field(default=0, description="sampled episodes per scenario (0: none)")
    sampled_success: float | None = Field(default=None, description="at the training temperature")
    sampled_success_sem: float | None = None
    sampled_reward: float | None = None


class TrainReport(BaseModel):
    run_dir: Path
    scenarios_file: Path
    generation: GenerationReport | None = None
    evals: list[EvalSummary]
    steps: list[dict[str, Any]]
    plot: Path | None = None
    baseline: EvalSummary | None = Field(default=None, description="the baseline's held-out episodes")
    win_rates: list[WinRate] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    def table(self) -> str:
        """Held-out results (greedy and sampled) per evaluated step, the baseline, then the judge's
        win rate and any warnings, as fixed-width text."""
        cols = ["step", "success", "sampled", "reward", "calls/ep", "tool err", "invalid/ep", "completed"]
        evals = [
            *self.evals,
            *([self.baseline] if self.baseline and self.baseline.player != "policy" else []),
        ]
        rows = [
            [
                str(e.step) if e.player == "policy" else e.player,
                f"{e.success:.2f} ± {e.success_sem:.2f}",
                f"{e.sampled_success:.2f} ± {e.sampled_success_sem or 0:.2f}"
                if e.sampled_success is not None
                else "-",
                f"{e.reward:.3f}",
                f"{e.tool_calls:.2f}",
                f"{e.tool_error_rate:.2f}",
                f"{e.invalid_calls:.2f}",
                f"{e.completed:.2f}",
            ]
            for e in evals
        ]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        line = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True))  # noqa: E731
        n = self.evals[0].scenarios if self.evals else 0
        k = max((e.samples for e in self.evals), default=0)
        head = f"held-out eval ({n} scenarios; success greedy" + (
            f", sampled x{k} at the training temperature)" if k else ")"
        )
        return "\n".join(
            [head, line(cols), line(["-" * w for w in widths])]
            + [line(r) for r in rows]
            + [w.line() for w in self.win_rates]
            + [f"warning: {w}" for w in self.warnings]
        )


def _summary(step: int, groups: list[jm.TrajectoryGroup], failed: int, player: str = "policy") -> EvalSummary:
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
            player=player,
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
        player=player,
    )


async def _rollout_on_pool(pool: SessionPool, *args: Any, **kwargs: Any) -> jm.Trajectory:
    async with pool.lease() as conn:
        return await rollout(*args, conn=conn, **kwargs)


async def episodes(
    player: Player,
    pool: SessionPool,
    info: ServerInfo,
    scenarios: list[Scenario],
    cfg: RolloutConfig,
    *,
    n: int,
    desc: str,
    seed: int | None = None,
    max_exceptions: float | None = None,
    after_each: Callable[[jm.TrajectoryGroup], Any] | None = None,
) -> tuple[list[jm.TrajectoryGroup], int]:
    """(groups, failed rollouts): `n` episodes of each scenario by `player`, one group per scenario.

    The one path that training, evaluation and baselines share, so their success and reward mean
    the same thing. With `max_exceptions` None any number of rollouts may fail (an evaluation
    counts them as failures); else `jm.TooManyExceptionsError` past it."""
    groups = [
        jm.TrajectoryGroup(
            (
                _rollout_on_pool(pool, player.model, player.client, info=info, scenario=s, cfg=cfg, seed=seed)
                for _ in range(n)
            ),
            metadata={"scenario_id": s.id, "task": s.task},
        )
        for s in scenarios
    ]
    limit = max_exceptions if max_exceptions is not None else len(scenarios) * n
    try:
        done = await jm.gather_trajectory_groups(
            groups, pbar_desc=desc, max_exceptions=limit, after_each=after_each
        )
    except jm.TooManyExceptionsError as e:
        if max_exceptions is not None:
            raise
        done = e.groups
    failed = sum(len(g.exceptions) for g in groups)
    for g in done:
        for t in g.trajectories:
            t.metrics.setdefault("independent_reward", t.reward)
    return done, failed


async def evaluate(
    model: jm.TrainableModel,
    pool: SessionPool,
    info: ServerInfo,
    scenarios: list[Scenario],
    cfg: RolloutConfig,
    *,
    log: bool = True,
    samples: int = 0,
    player: Player | None = None,
) -> tuple[EvalSummary, list[jm.TrajectoryGroup]]:
    """One greedy episode per held-out scenario (and `samples` at `cfg.temperature`), by the policy or
    by `player`; judge-free metrics, the policy's logged as split "val". Returns the greedy groups."""
    who = player or policy_player(model)
    greedy = cfg.model_copy(update={"temperature": 0.0})
    step = await model.get_step()
    label = "policy" if player is None else player.label
    desc = f"eval@{step}" if player is None else f"eval {player.label}"
    done, failed = await episodes(who, pool, info, scenarios, greedy, n=1, desc=desc, seed=0)
    summary = _summary(step, done, failed, label)
    if samples:
        sampled, s_failed = await episodes(who, pool, info, scenarios, cfg, n=samples, desc=f"{desc} sampled")
        s = _summary(step, sampled, s_failed)
        summary = summary.model_copy(
            update={
                "samples": samples,
                "sampled_success": s.success,
                "sampled_success_sem": s.success_sem,
                "sampled_reward": s.reward,
            }
        )
    if log and done and player is None:
        # val/success is the mean of the greedy rollouts' metrics; the rest rides in the same row
        extra = {"success_sem": summary.success_sem}
        if summary.sampled_success is not None:
            extra["sampled_success"] = summary.sampled_success
        await model.log(done, split="val", metrics=extra)
    return summary, done


async def evaluate_and_echo(
    model: jm.TrainableModel,
    pool: SessionPool,
    info: ServerInfo,
    scenarios: list[Scenario],
    cfg: RolloutConfig,
    echo: Echo,
    samples: int = 0,
) -> tuple[EvalSummary, list[jm.TrajectoryGroup]]:
    summary, groups = await evaluate(model, pool, info, scenarios, cfg, samples=samples)
    sampled = (
        f", sampled {summary.sampled_success:.2f} ± {summary.sampled_success_sem or 0:.2f}"
        if summary.sampled_success is not None
        else ""
    )
    echo(
        f"eval@{summary.step}: success {summary.success:.2f} ± {summary.success_sem:.2f}{sampled}, "
        f"calls/ep {summary.tool_calls:.2f}"
    )
    return summary, groups


def too_easy(base: EvalSummary) -> str | None:
    """The warning a saturated task set deserves, or None."""
    if base.scenarios and base.success >= TOO_EASY:
        return (
            f"the base model already scores {base.success:.2f} (>= {TOO_EASY}) on the held-out split: this "
            "task set is too easy to show a gain (harder scenarios: --generator <a real model>, "
            "multi-step tasks, end-state checks)"
        )
    return None


async def compare(
    settings: McpRlSettings,
    model: jm.TrainableModel,
    pool: SessionPool,
    info: ServerInfo,
    scenarios: list[Scenario],
    trained: list[jm.TrajectoryGroup],
    judge: str,
    backend: jm.Backend,
    echo: Echo,
    player: Player | None,
    base: tuple[EvalSummary, list[jm.TrajectoryGroup]] | None = None,
) -> tuple[EvalSummary, list[jm.TrajectoryGroup], WinRate | None]:
    """The baseline's greedy held-out episodes (summary and groups), by `player` or (None) the base
    model, reusing `base` (the step-0 evaluation) when it was run; and the judge's win rate of
    `trained` against them (None with judge "none")."""
    step = await model.get_step()
    if player is None:
        label = "base (step 0)"
        if base is None:  # the adapter off, then on again: one engine plays both sides
            await model.serve_step(0)
            try:
                summary, groups = await evaluate(model, pool, info, scenarios, settings.rollout, log=False)
            finally:
                await model.serve_step(step)
            summary = summary.model_copy(update={"player": label})
        else:
            summary, groups = base
    else:
        summary, groups = await evaluate(
            model, pool, info, scenarios, settings.rollout, log=False, player=player
        )
        label = player.label
    echo(f"baseline {label}: success {summary.success:.2f} ± {summary.success_sem:.2f}")
    if judge == "none":
        return summary, groups, None
    rate = await win_rate(
        trained,
        groups,
        judge=judge,
        judge_model=settings.judge_model,
        backend=backend,
        step=step,
        against=label,
        scenario_ids=[s.id for s in scenarios],
    )
    echo(rate.line())
    return summary, groups, rate


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
        + (
            f"; {report.checks} end-state checks kept, {report.checks_rejected} dropped"
            if report.checks or report.checks_rejected
            else ""
        )
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
    errlog = settings.out_dir / "mcp_server.log"
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


async def open_against(settings: McpRlSettings, backend: jm.Backend) -> Player | None:
    """The baseline player (None for "base" and "none"), resolved before any work so a wrong spec
    fails at once rather than after training."""
    if settings.against in (BASE, NONE):
        if settings.against_model is not None:
            raise jm.InvalidFieldError(
                "against_model",
                settings.against_model,
                f"only a base-URL --against takes a model; it is {settings.against!r}",
            )
        return None
    return await resolve_against(settings.against, settings.against_model, backend=backend)


async def open_judge(settings: McpRlSettings, backend: jm.Backend) -> str:
    """The judge spec to use: "local" becomes a frozen copy of the base model registered beside the
    policy, so the policy never grades itself (not even at step 0, where they would agree)."""
    if settings.judge != "local":
        return settings.judge
    judge_model = jm.TrainableModel(
        name=f"{settings.model}-judge",
        project=settings.project,
        base_model=settings.base_model or jm.DEFAULT_BASE_MODEL,
    )
    await judge_model.register(backend)
    return f"local:{judge_model.name}"


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
            budget=settings.budget,
        )
        echo("loading the policy...")
        await model.register(backend)
        judge = await open_judge(settings, backend)
        against = await open_against(settings, backend)
        generator = f"local:{model.name}" if settings.generator == "local" else settings.generator
        sset, spath, gen = await load_or_generate(
            settings.model_copy(update={"generator": generator}), info, settings.out_dir, echo
        )
        cfg = settings.rollout
        k = settings.eval_samples
        warnings: list[str] = []
        started_at = await model.get_step()
        first = await evaluate_and_echo(model, pool, info, sset.eval, cfg, echo, k)
        evals = [first[0]]
        base = first if started_at == 0 else None  # the base model's episodes, for the comparison
        if base is not None and (warning := too_easy(base[0])):
            warnings.append(warning)
            echo(f"warning: {warning}")
        last = first
        if warmup is not None and await sft_warmup(model, warmup, settings.sft, echo):
            last = await evaluate_and_echo(model, pool, info, sset.eval, cfg, echo, k)
            evals.append(last[0])
        policy = policy_player(model)
        score = functools.partial(score_group, judge=judge, judge_model=settings.judge_model, backend=backend)
        config = settings.train
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
            try:
                with jm.charging(model):  # the judge's spend is the policy's run's (its budget)
                    groups, failed = await episodes(
                        policy,
                        pool,
                        info,
                        batch,
                        cfg,
                        n=settings.group_size,
                        desc=f"step {step}",
                        max_exceptions=settings.max_exceptions,
                        after_each=score,
                    )
            except jm.TooManyExceptionsError as e:
                first_error = next((x for g in e.groups for x in g.exceptions), None)
                raise ServerUnavailableError(
                    f"{e.failed} of {e.total} rollouts failed at step {step} (max_exceptions="
                    f"{settings.max_exceptions:g}); first: "
                    f"{first_error.type + ': ' + first_error.message if first_error else '?'}"
                ) from None
            rollout_s = time.perf_counter() - t0
            groups = [g for g in groups if len(g.trajectories) >= 2]
            ts = [t for g in groups for t in g.trajectories]
            row: dict[str, Any] = {"step": step, "rollout_seconds": round(rollout_s, 1)}
            if ts:
                row.update(
                    reward=statistics.mean(t.reward for t in ts),
                    independent_reward=statistics.mean(float(t.metrics["independent_reward"]) for t in ts),
                    success=statistics.mean(float(t.metrics["success"]) for t in ts),
                    tool_calls=statistics.mean(float(t.metrics["tool_calls"]) for t in ts),
                    failed=failed,
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
                f"step {step}: reward {row.get('reward', float('nan')):.3f}, success (sampled, train) "
                f"{row.get('success', float('nan')):.2f}, "
                f"calls/ep {row.get('tool_calls', float('nan')):.2f}, rollouts {rollout_s:.0f}s, "
                f"train {row.get('train_seconds', 0):.0f}s{' (skipped: no reward spread)' if row.get('skipped') else ''}"
            )
            if settings.eval_every and (i + 1) % settings.eval_every == 0 and i + 1 < settings.steps:
                last = await evaluate_and_echo(model, pool, info, sset.eval, cfg, echo, k)
                evals.append(last[0])
        if settings.steps:
            if await model.get_step() != last[0].step:  # else every step since was skipped
                last = await evaluate_and_echo(model, pool, info, sset.eval, cfg, echo, k)
            else:
                echo(
                    f"eval@{last[0].step}: unchanged since its evaluation above (the steps since were skipped)"
                )
            evals.append(last[0])
        baseline: EvalSummary | None = None
        win_rates: list[WinRate] = []
        if settings.against != NONE and (settings.steps or settings.against != BASE):
            baseline, _, rate = await compare(
                settings, model, pool, info, sset.eval, last[1], judge, backend, echo, against, base
            )
            win_rates += [rate] if rate is not None else []
        run_dir = settings.out_dir
        plot = plot_history(
            await model.history(),
            RunLayout(run_dir).reward_plot,
            title=f"mcp-rl: {info.name} ({settings.model}), task success",
            metric="success",
        )
        report = TrainReport(
            run_dir=run_dir,
            scenarios_file=spath,
            generation=gen,
            evals=evals,
            steps=steps,
            plot=plot,
            baseline=baseline,
            win_rates=win_rates,
            warnings=warnings,
        )
        (run_dir / "mcp_rl_report.json").write_text(report.model_dump_json(indent=2))
        return report
    finally:
        backend.close()
        await pool.__aexit__(None, None, None)


async def eval_step(settings: McpRlSettings, step: int | None, echo: Echo = print) -> TrainReport:
    """Evaluate checkpoint `step` (latest when None; 0 = the base model) on the run's eval scenarios,
    greedy and sampled, and (unless `against` or `judge` is "none") its win rate against the baseline."""
    pool, info = await connect(settings, echo)
    backend = settings.open_backend()
    try:
        model = jm.TrainableModel(
            name=settings.model,
            project=settings.project,
            base_model=settings.base_model or jm.DEFAULT_BASE_MODEL,
        )
        if step is not None and isinstance(backend, jm.LocalBackend):
            # a step the run lacks is refused before the model loads (a remote run is asked below)
            backend.check_step(model, step)
        await model.register(backend)
        if step is not None:
            await model.serve_step(step)  # refuses a step the run does not have, naming it
        against = await open_against(settings, backend)
        run_dir = settings.out_dir
        spath = settings.scenarios_file or run_dir / "scenarios.json"
        sset, _, _ = await load_or_generate(
            settings.model_copy(update={"scenarios_file": spath}), info, run_dir, echo
        )
        summary, groups = await evaluate(
            model, pool, info, sset.eval, settings.rollout, log=False, samples=settings.eval_samples
        )
        report = TrainReport(run_dir=run_dir, scenarios_file=spath, evals=[summary], steps=[])
        if settings.against != NONE:
            judge = await open_judge(settings, backend) if settings.judge != "none" else "none"
            baseline, _, rate = await compare(
                settings, model, pool, info, sset.eval, groups, judge, backend, echo, against
            )
            report.baseline = baseline
            report.win_rates = [rate] if rate is not None else []
            if settings.against == BASE and (warning := too_easy(baseline)):
                report.warnings.append(warning)
        return report
    finally:
        backend.close()
        await pool.__aexit__(None, None, None)
