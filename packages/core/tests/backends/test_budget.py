"""Budgets (`ModelConfig.budget`, `data/budget.py`): hard caps on what a run spends, counted across
restarts; at a limit the work that would spend more is refused before it starts, naming the budget,
the limit and how far past it the run is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import journeyman as jm
import openai
import pytest
from _support import tiny_model_dir

pytestmark = pytest.mark.integration


def _model(**budget: Any) -> jm.TrainableModel:
    return jm.TrainableModel(
        name="capped",
        project="budget",
        base_model=str(tiny_model_dir()),
        lora=jm.LoraConfig(r=4),
        max_tokens=4,
        budget=jm.Budget(**budget) if budget else None,
    )


async def _ask(model: jm.TrainableModel) -> int:
    done = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi."}], max_tokens=4, temperature=1.0
    )
    return done.usage.completion_tokens if done.usage else 0


async def _group(model: jm.TrainableModel) -> jm.TrajectoryGroup:
    client, ask = model.openai_client(), [{"role": "user", "content": "Count."}]
    done = await client.chat.completions.create(model=model.name, messages=ask, max_tokens=4, n=2)  # pyright: ignore[reportArgumentType]
    return jm.TrajectoryGroup(
        jm.Trajectory(messages_and_choices=[*ask, c], reward=float(i)) for i, c in enumerate(done.choices)
    )


async def test_sampling_past_its_budget_is_refused_and_the_spend_survives_a_restart(tmp_path: Path) -> None:
    backend = jm.LocalBackend(path=tmp_path)
    model = _model(sampled_tokens=10)
    try:
        await model.register(backend)
        spent = 0
        while spent < 10:
            spent += await _ask(model)
        with pytest.raises(openai.APIStatusError) as refused:
            await _ask(model)
        assert refused.value.status_code == 402
        assert "budget.sampled_tokens" in str(refused.value) and f"spent {spent} of its limit 10" in str(
            refused.value
        )
    finally:
        backend.close()
    # a restart goes on counting from spend.json: still refused
    again = jm.LocalBackend(path=tmp_path)
    try:
        await model.register(again)
        assert again.service(model).meter.spent()["sampled_tokens"] == spent  # pyright: ignore[reportOptionalMemberAccess]
        with pytest.raises(openai.APIStatusError, match=r"budget\.sampled_tokens"):
            await _ask(model)
        raised = _model(sampled_tokens=spent + 100)  # a person raises it: spent stays counted
        await raised.register(again)
        assert await _ask(raised) > 0
    finally:
        again.close()


async def test_a_step_past_the_trained_tokens_budget_is_refused_and_the_rows_record_the_spend(
    tmp_path: Path,
) -> None:
    backend = jm.LocalBackend(path=tmp_path)
    model = _model(trained_tokens=1)
    try:
        await model.register(backend)
        first = await model.train([await _group(model)], config=jm.TrainConfig(learning_rate=1e-3))
        assert first.step == 1  # under the limit when it began
        with pytest.raises(jm.BudgetExceededError) as e:
            await model.train([await _group(model)])
        assert e.value.budget == "trained_tokens" and e.value.limit == 1 and e.value.spent > 1
        assert await model.get_step() == 1  # nothing trained, nothing half-written
        (row,) = [r for r in await model.history() if r.get("split") == "train"]
        assert row["train/spend_trained_tokens"] == e.value.spent and row["train/spend_sampled_tokens"] > 0
    finally:
        backend.close()


async def test_wall_time_is_a_budget_too(tmp_path: Path) -> None:
    backend = jm.LocalBackend(path=tmp_path)
    try:
        unbudgeted = _model()
        await unbudgeted.register(backend)
        group = await _group(unbudgeted)  # sampled before the budget
        model = _model(wall_s=0.001)  # registered again with one: its clock began at the first
        await model.register(backend)
        with pytest.raises(openai.APIStatusError, match=r"budget\.wall_s"):
            await _ask(model)
        with pytest.raises(jm.BudgetExceededError, match=r"budget\.wall_s"):
            await model.train([group])
    finally:
        backend.close()


def test_a_bad_budget_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="sampled_tokens"):
        jm.Budget(sampled_tokens=0)
    with pytest.raises(ValueError, match="warn_at"):
        jm.Budget(warn_at=1.5)
