"""RULER with the embedded model as its own offline judge (judge="local").

The 135M judge is no oracle; these tests check the machinery on the real engine: its answers are
valid under the schema (constrained decoding), duplicates are judged once, a cached group costs no
generation (the engine's request count), and the judge answers groups of two to eight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import journeyman as jm
import jsonschema
import pytest
from journeyman.rewards.ruler import RulerConfig, build_prompt, ruler_score_group

pytestmark = pytest.mark.integration

QUESTION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
]


def answer(text: str) -> jm.Trajectory:
    return jm.Trajectory(messages_and_choices=[*QUESTION, {"role": "assistant", "content": text}])


def check_answer(group: jm.TrajectoryGroup, scored: jm.TrajectoryGroup, explanation_chars: int) -> None:
    """The judge's raw answer is valid under the schema it was asked with; rewards follow from it."""
    schema = build_prompt(group.trajectories, explanation_chars=explanation_chars).schema
    raw = json.loads(scored.metadata["ruler"]["answer"])
    jsonschema.validate(raw, schema)
    assert all(0.0 <= r <= 1.0 for r in scored.rewards())
    by_id = {s["trajectory_id"]: s["score"] / 10 for s in raw["scores"]}
    assert sorted(set(scored.rewards())) == sorted(set(by_id.values()))


async def test_local_judge_dedupe_and_cache(served: tuple[Any, Any], tmp_path: Path) -> None:
    model, backend = served
    engine = backend.service(model).engine
    group = jm.TrajectoryGroup([answer("Paris."), answer("Lyon, I think."), answer("Paris.")])
    before = engine.requests_served
    scored = await ruler_score_group(
        group, judge=f"local:{model.name}", explanation_chars=12, cache_dir=tmp_path
    )
    info = scored.metadata["ruler"]
    assert info["unique"] == 2 and info["judge"] == f"local:{model.name}@0"
    assert engine.requests_served == before + 1 + info["retries"]
    check_answer(group, scored, 12)
    assert scored.rewards()[0] == scored.rewards()[2]  # duplicates share one judgement

    # the same group again, the judge named by its model object: the same judge, so answered from
    # the disk cache, no generation at all
    served_before = engine.requests_served
    again = await ruler_score_group(
        group, judge=model, config=RulerConfig(explanation_chars=12, cache_dir=tmp_path)
    )
    assert engine.requests_served == served_before
    assert again.rewards() == scored.rewards()
    assert all(t.metrics["ruler_cached"] == 1 for t in again.trajectories)


async def test_local_judge_group_of_eight(served: tuple[Any, Any], tmp_path: Path) -> None:
    texts = ["Paris.", "Lyon.", "Marseille.", "Paris, France.", "I don't know.", "Berlin.", "Nice.", "Rome."]
    group = jm.TrajectoryGroup([answer(t) for t in texts])
    scored = await ruler_score_group(group, judge="local", explanation_chars=4, cache_dir=tmp_path)
    name = jm.current_backend().inference().model  # bare "local": the latest model registered here
    assert scored.metadata["ruler"]["judge"].startswith(f"local:{name}@")
    assert scored.metadata["ruler"]["unique"] == 8
    check_answer(group, scored, 4)
