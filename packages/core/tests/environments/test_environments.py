"""The environment seam on the embedded model: TextArena's GuessTheNumber (from PyPI) through the
gym-style bridge, evaluated and trained; errors in an environment named and counted, never fatal."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from journeyman.environments import GymEnvironment, Sampling, Task, evaluate, from_function, load, run_task

GAME = "gym:textarena:GuessTheNumber-v0:max_turns=2"
SHORT = Sampling(temperature=0.0, max_tokens=8)


async def test_a_textarena_game_is_played_turn_by_turn_and_recorded_token_exactly(
    served: tuple[Any, Any],
) -> None:
    model, _ = served
    env = load(GAME)
    assert env.name == "textarena:GuessTheNumber-v0"
    train, held_out = env.tasks("train"), env.tasks("eval")
    assert {t.id for t in train}.isdisjoint(t.id for t in held_out)
    trajectory = await run_task(env, model, held_out[0], Sampling(temperature=1.0, max_tokens=8))
    turns = int(trajectory.metrics["turns"])
    # the game's 2 turns, plus retries: TextArena lets an invalid guess be made again without using a
    # turn (its error allowance), so a sampled run may take more model calls; the bridge's bound is 32
    assert 1 <= turns <= 32 and 0.0 <= trajectory.reward <= 1.0
    assert trajectory.metadata["task"] == held_out[0].id
    # every assistant turn carries the ids and logprobs the engine sampled
    records = trajectory.records()
    assert len(records) == turns and all(r.token_ids and len(r.logprobs) == len(r.token_ids) for r in records)
    messages = trajectory.messages()
    assert "Guess The Number" in str(messages[0]["content"])
    # TextArena repeats its whole transcript; the conversation holds each turn once
    later = [str(m["content"]) for m in messages[1:] if m["role"] == "user"]
    assert all("You are playing Guess The Number" not in text for text in later)


async def test_train_then_evaluate_before_and_after_with_a_paired_difference(
    served: tuple[Any, Any], tmp_path: Path
) -> None:
    _, backend = served
    model = jm.TrainableModel(name="env-tiny", project="tests-environments")
    await model.register(backend)
    env = load(GAME)
    steps = await jm.environments.train(
        model, env, steps=1, groups_per_step=2, group_size=2, sampling=Sampling(max_tokens=8)
    )
    assert len(steps) == 1 and steps[0].rollouts == 4 and steps[0].failed == 0
    latest = await model.get_step()
    assert latest == (0 if steps[0].skipped else 1)
    report = await evaluate(model, env, steps=[0, "latest"], tasks=3, sampling=SHORT)
    assert [s.step for s in report.steps] == [0, latest]
    for s in report.steps:
        assert s.tasks == 3 and s.episodes == 3 and not s.failures
        assert (
            math.isfinite(s.mean)
            and s.sem >= 0
            and set(s.task_rewards) == {"seed-1000000", "seed-1000001", "seed-1000002"}
        )
    (diff,) = report.differences
    assert diff.tasks == 3 and diff.earlier == 0 and diff.later == latest
    assert diff.mean == pytest.approx(report.steps[1].mean - report.steps[0].mean)
    # the latest step is logged beside training, and served again
    assert any(r.get("split") == "val" for r in await model.history())
    from journeyman.app.env_commands import plot_eval

    written = report.write(tmp_path / "eval.json")
    assert jm.environments.EvalReport.model_validate_json(written.read_text()) == report
    assert plot_eval(report, tmp_path / "eval.png").stat().st_size > 1000
    assert any("paired" in line for line in report.lines())


async def test_a_failing_task_is_named_and_counted_and_the_rest_is_kept(served: tuple[Any, Any]) -> None:
    model, _ = served

    async def rollout(m: jm.TrainableModel, task: Task, sampling: Sampling) -> jm.Trajectory:
        if task.input == "boom":
            raise RuntimeError("the environment fell over")
        messages = [{"role": "user", "content": f"Say {task.input}."}]
        completion = await m.openai_client().chat.completions.create(
            model=m.name, messages=messages, max_tokens=sampling.max_tokens, temperature=0.0
        )
        choice = completion.choices[0]
        reward = math.nan if task.input == "nan" else float(task.input in (choice.message.content or ""))
        return jm.Trajectory(messages_and_choices=[*messages, choice], reward=reward)

    env = from_function(rollout, {"train": ["yes"], "eval": ["yes", "boom", "nan", "no"]}, name="sayer")
    report = await evaluate(model, env, tasks=4, sampling=SHORT, log=False)
    (step,) = report.steps
    assert step.tasks == 2 and set(step.task_rewards) == {"0", "3"}
    assert step.pass_at_k is not None  # rewards 0/1: pass@1 is the mean
    failed = {f.task: f.error for f in step.failures}
    assert set(failed) == {"1", "2"}
    assert "task '1'" in failed["1"] and "the environment fell over" in failed["1"]
    assert "reward=nan" in failed["2"] and "finite" in failed["2"]
    with pytest.raises(jm.EnvironmentRolloutError) as raised:
        await run_task(env, model, Task(id="x", input="boom"), SHORT)
    assert raised.value.task == "x" and raised.value.environment == "sayer"


class _BadGame:
    """Gymnasium's shape, with a reward that is not a number."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "Say anything.", {}

    def step(self, action: str) -> tuple[str, object, bool, bool, dict[str, Any]]:
        return "", "a lot", True, False, {}


async def test_a_reward_that_is_not_a_number_is_refused_naming_it(served: tuple[Any, Any]) -> None:
    model, _ = served
    env = GymEnvironment(_BadGame, name="bad")
    with pytest.raises(
        jm.EnvironmentRolloutError, match=r"step reward='a lot': must be a finite number, not str"
    ):
        await run_task(env, model, env.tasks("eval")[0], SHORT)


def test_bad_specs_are_named_errors() -> None:
    for spec, why in (
        ("gym:textarena:NoSuchGame-v0", "textarena.make failed"),
        ("gym:no_such_module_here:X-v0", "cannot import 'no_such_module_here'"),
        ("no_such_module_here:make", "cannot import"),
        ("json:no_such_function", "has no callable 'no_such_function'"),
        ("gym:textarena", "gym:<module>:<id>"),
        ("openenv:localhost", "openenv:http://host:port"),
        ("openenv:http://127.0.0.1:9:turns=4", "takes no such option.*'turns'"),
    ):
        with pytest.raises(jm.InvalidFieldError, match=why) as raised:
            load(spec)
        assert raised.value.field == "spec"
    assert load(GAME).max_turns == 32  # type: ignore[attr-defined]  # the bridge's bound; the game's is 2
    server = load("openenv:http://127.0.0.1:9:max_turns=4,sessions=2")
    assert (server.url, server.max_turns) == ("http://127.0.0.1:9", 4)  # type: ignore[attr-defined]
