"""verifiers environments through the bridge, with the real package from PyPI (verifiers 0.3.1 in
its own interpreter: it pins mcp<2, this workspace has mcp 2) on the embedded model: a multi-turn
`vf.MultiTurnEnv` module, verifiers' own `ReasoningGymEnv`, and what goes wrong named."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from _support import pinned_venv
from journeyman.environments import Sampling, evaluate, load, run_task

pytestmark = pytest.mark.integration

REQUIREMENTS = Path(__file__).with_name("verifiers-requirements.txt")
SHORT = Sampling(temperature=1.0, max_tokens=8)

# A multi-turn environment as a verifiers user writes one: the model answers, the environment asks
# again, the model answers once more; the rubric scores the whole completion and reports a metric.
MULTI_TURN = """
import verifiers as vf
from datasets import Dataset


class SayItTwice(vf.MultiTurnEnv):
    def __init__(self, fail_on=None, **kwargs):
        super().__init__(**kwargs)
        self.fail_on = fail_on

    async def env_response(self, messages, state, **kwargs):
        if state["answer"] == str(self.fail_on):
            raise ValueError(f"the environment breaks on {self.fail_on}")
        return [vf.UserMessage(content="Say it once more.")]


def load_environment(n=6, fail_on=None, nan_on=None):
    rows = [{"question": f"Say {i}.", "answer": str(i)} for i in range(n)]

    def said(completion, answer, **kwargs):
        if answer == str(nan_on):
            return float("nan")
        text = " ".join(str(m.content or "") for m in completion if m.role == "assistant")
        return float(answer in text)

    def turns(state, **kwargs):
        return float(len(state["trajectory"]))

    rubric = vf.Rubric(funcs=[said])
    rubric.add_metric(turns)
    return SayItTwice(
        fail_on=fail_on,
        dataset=Dataset.from_list(rows[:-2]), eval_dataset=Dataset.from_list(rows[-2:]), rubric=rubric, max_turns=2
    )
"""


@pytest.fixture(scope="module")
def python() -> str:
    return pinned_venv(REQUIREMENTS)


async def test_a_multi_turn_verifiers_environment_with_its_rubric_splits_and_metrics(
    served: tuple[Any, Any], python: str, tmp_path: Path
) -> None:
    model, _ = served
    (tmp_path / "say_twice.py").write_text(MULTI_TURN)
    env = load(f"verifiers:{tmp_path / 'say_twice.py'}:n=6,python={python}")
    try:
        assert env.kind == "SayItTwice" and env.version == "0.3.1"  # type: ignore[attr-defined]
        assert len(env.tasks("train")) == 4 and len(env.tasks("eval")) == 2
        trajectory = await run_task(env, model, env.tasks("eval")[0], SHORT)
        # both completions the environment asked for are on the trajectory, token-exactly
        records = trajectory.records()
        assert len(records) == 2 and all(r.token_ids and len(r.logprobs) == len(r.token_ids) for r in records)
        assert trajectory.metrics["turns"] == 2.0 and trajectory.reward in (0.0, 1.0)
        assert trajectory.metrics["said"] == trajectory.reward  # verifiers reports each reward function
        user_turns = [m["content"] for m in trajectory.messages() if m["role"] == "user"]
        assert user_turns == ["Say 4.", "Say it once more."]
    finally:
        env.close()  # type: ignore[attr-defined]


async def test_verifiers_reasoning_gym_env_trains_and_evaluates(
    served: tuple[Any, Any], python: str, tmp_path: Path
) -> None:
    _, backend = served
    model = jm.TrainableModel(name="vf-tiny", project="tests-verifiers")
    await model.register(backend)
    spec = f"verifiers:verifiers.ReasoningGymEnv:gym=basic_arithmetic,num_train_examples=8,num_eval_examples=3,python={python}"
    env = load(spec)
    try:
        assert len(env.tasks("train")) == 8 and len(env.tasks("eval")) == 3
        steps = await jm.environments.train(
            model, env, steps=1, groups_per_step=2, group_size=2, sampling=Sampling(max_tokens=12)
        )
        assert len(steps) == 1 and steps[0].rollouts == 4 and steps[0].failed == 0
        report = await evaluate(
            model, env, steps=["latest"], sampling=Sampling(temperature=0.0, max_tokens=12)
        )
        (result,) = report.steps
        assert result.tasks == 3 and not result.failures and math.isfinite(result.mean)
    finally:
        env.close()  # type: ignore[attr-defined]


async def test_what_goes_wrong_in_a_verifiers_environment_is_named(
    served: tuple[Any, Any], python: str, tmp_path: Path
) -> None:
    model, _ = served
    (tmp_path / "say_twice.py").write_text(MULTI_TURN)
    (tmp_path / "no_env.py").write_text("def make():\n    return None\n")
    with pytest.raises(jm.InvalidFieldError, match="has no load_environment") as raised:
        load(f"verifiers:{tmp_path / 'no_env.py'}:python={python}")
    assert raised.value.field == "spec"
    with pytest.raises(jm.InvalidFieldError, match="no such interpreter"):
        load(f"verifiers:{tmp_path / 'say_twice.py'}:python={tmp_path / 'nope'}")
    # the environment raises on one task and its rubric gives NaN on the other: each rollout is an
    # EnvironmentRolloutError naming the task and what went wrong, counted, never fatal
    env = load(f"verifiers:{tmp_path / 'say_twice.py'}:n=6,fail_on=4,nan_on=5,python={python}")
    try:
        report = await evaluate(model, env, steps=[0], sampling=SHORT)
        (result,) = report.steps
        assert result.episodes == 0 and [f.task for f in result.failures] == ["eval-0", "eval-1"]
        assert "the environment breaks on 4" in result.failures[0].error
        assert "reward" in result.failures[1].error and "nan" in result.failures[1].error
        # a worker that dies fails what waits on it with a named error, and says so for later calls
        env._worker._proc.kill()  # type: ignore[attr-defined]
        with pytest.raises(jm.EnvironmentRolloutError) as died:
            await run_task(env, model, env.tasks("eval")[0], SHORT)
        assert isinstance(died.value.error, jm.EnvironmentWorkerError)
    finally:
        env.close()  # type: ignore[attr-defined]


async def test_through_journeyman_serve_with_the_pipeline_trainer(
    remote_server: Any, python: str, tmp_path: Path
) -> None:
    """The worker reaches the model through `journeyman serve` (its URL and token), and the
    PipelineTrainer trains on what the server captured for each episode."""
    backend = jm.RemoteBackend(remote_server.url, token=remote_server.token, progress=False)
    model = jm.TrainableModel(name="vf-remote", project="tests-verifiers")
    await model.register(backend)
    (tmp_path / "say_twice.py").write_text(MULTI_TURN)
    env = load(f"verifiers:{tmp_path / 'say_twice.py'}:n=6,python={python}")
    try:
        trajectory = await run_task(env, model, env.tasks("eval")[0], SHORT)
        records = trajectory.records()
        assert len(records) == 2 and all(r.token_ids and len(r.logprobs) == len(r.token_ids) for r in records)
        steps = await jm.environments.train(
            model, env, steps=1, groups_per_step=2, group_size=2, sampling=SHORT, pipeline=True
        )
        assert len(steps) == 1 and steps[0].rollouts == 4 and steps[0].failed == 0
        assert await model.get_step() == (0 if steps[0].skipped else 1)
    finally:
        env.close()  # type: ignore[attr-defined]
