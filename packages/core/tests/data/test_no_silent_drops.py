"""Nothing given to Journeyman's public models is dropped without a word: a group reads as its
trajectories (iteration, len, indexing), keeps its own metrics and logs, and every public model
refuses an argument it does not know, naming it."""

from __future__ import annotations

from typing import Any

import journeyman as jm
import pytest
from journeyman.errors import InvalidFieldError
from pydantic import BaseModel, ValidationError


def traj(reward: float) -> jm.Trajectory:
    return jm.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward)


def test_a_group_iterates_over_its_trajectories_and_has_a_length() -> None:
    group = jm.TrajectoryGroup([traj(0.0), traj(1.0)])
    assert [t.reward for t in group] == [0.0, 1.0]  # not pydantic's (field, value) pairs
    assert len(group) == 2 and group[1].reward == 1.0
    assert list(group) == group.trajectories


def test_a_group_keeps_its_metrics_and_logs_through_json() -> None:
    group = jm.TrajectoryGroup([traj(1.0)], metrics={"difficulty": 3}, logs=["scenario 7"])
    again = jm.TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert again.metrics == {"difficulty": 3} and again.logs == ["scenario 7"]


def test_an_exception_given_in_a_group_is_kept_on_exceptions() -> None:
    group = jm.TrajectoryGroup([traj(1.0), RuntimeError("tool down")])  # as ART's groups take them
    assert len(group) == 1
    assert [(e.type, e.message) for e in group.exceptions] == [("RuntimeError", "tool down")]


def test_group_metrics_reach_the_history_row() -> None:
    from journeyman.backends.train_step import group_metrics

    groups = [jm.TrajectoryGroup([traj(1.0)], metrics={"hard": 1}), jm.TrajectoryGroup([traj(0.0)])]
    assert group_metrics(groups)["group_hard"] == 1.0


def _vllm_config() -> type[BaseModel]:
    from journeyman.engine.vllm_server import VLLMConfig

    return VLLMConfig


# (model, the arguments it needs, a foreign argument an ART user would pass)
PUBLIC_MODELS: list[tuple[Any, dict[str, Any], str]] = [
    (jm.TrajectoryGroup, {"trajectories": [{"messages_and_choices": []}]}, "trajectory_count"),
    (jm.Trajectory, {}, "reward_fn"),
    (jm.History, {}, "reward"),
    (
        jm.TokenRecord,
        {
            "prompt_token_ids": [1],
            "token_ids": [],
            "logprobs": [],
            "model": "m",
            "step": 0,
            "finish_reason": "stop",
        },
        "text",
    ),
    (jm.TrainableModel, {"name": "m", "project": "p"}, "config"),
    (jm.ModelConfig, {"name": "m", "project": "p"}, "_internal_config"),
    (jm.LoraConfig, {}, "lora_alpha"),
    (jm.TrainConfig, {}, "beta"),
    (jm.SFTConfig, {}, "num_epochs"),
    (jm.TrainerConfig, {}, "world"),
    (jm.TrainResult, {"step": 1}, "checkpoint_path"),
    (jm.RulerConfig, {}, "extra_litellm_params"),
    (_vllm_config, {}, "gpu_memory"),
]


@pytest.mark.parametrize(
    ("model", "needs", "foreign"), PUBLIC_MODELS, ids=lambda x: getattr(x, "__name__", "")
)
def test_every_public_model_refuses_an_unknown_argument_by_name(
    model: Any, needs: dict[str, Any], foreign: str
) -> None:
    cls = model() if model is _vllm_config else model
    cls(**needs)  # the arguments alone are fine
    with pytest.raises((ValidationError, InvalidFieldError, TypeError)) as e:
        cls(**needs, **{foreign: 1})
    assert foreign in str(e.value)


async def test_ruler_refuses_a_dict_where_its_rubric_goes() -> None:
    group = jm.TrajectoryGroup([traj(0.0), traj(1.0)])
    with pytest.raises(InvalidFieldError, match="rubric") as e:
        await jm.ruler_score_group(group, "openai/o3", {"temperature": 0})  # type: ignore[arg-type]  # ART's order
    assert e.value.field == "rubric"
