"""RULER against a real OpenAI-compatible judge server on 127.0.0.1 that follows a fixed rule.

The server speaks /v1/chat/completions over HTTP and reads the request the way any judge would:
it finds the trajectories in the prompt and the ids in the response schema. It can be told to
answer wrongly (too few scores, unknown ids, prose) for its next requests, which exercises the
retry and error paths end to end. Tests with the embedded model as judge are in test_ruler_local.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from _support import RuleJudge, function_tool
from journeyman.rewards.ruler import (
    DEFAULT_RUBRIC,
    RulerConfig,
    RulerJudgeError,
    build_prompt,
    ruler_score_group,
    truncate,
)

rule_judge = RuleJudge.module_fixture("rule_judge")


@pytest.fixture
def judge(rule_judge: RuleJudge, tmp_path: Path) -> Any:
    rule_judge.requests.clear()
    rule_judge.plan.clear()
    config = RulerConfig(judge_model="rule", cache_dir=tmp_path / "ruler")
    return functools.partial(ruler_score_group, judge=rule_judge.base_url, config=config)


def answer(text: str, reward: float = 0.0) -> jm.Trajectory:
    return jm.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": text},
        ],
        reward=reward,
    )


def group() -> jm.TrajectoryGroup:
    return jm.TrajectoryGroup([answer("Paris.", 0.3), answer("Lyon.", 0.7), answer("I am not sure.", 0.1)])


async def test_scores_replace_rewards_and_keep_the_old_ones(rule_judge: RuleJudge, judge: Any) -> None:
    g = group()
    out = await judge(g)
    assert out is not g and out.rewards() == [1.0, 0.2, 0.2]
    assert g.rewards() == [0.3, 0.7, 0.1]  # the input group is left as it was
    assert [t.metrics["independent_reward"] for t in out.trajectories] == [0.3, 0.7, 0.1]
    assert out.trajectories[0].metadata["ruler_explanation"] == "names Paris"
    assert out.metadata["ruler"]["unique"] == 3 and not out.metadata["ruler"]["cached"]
    assert len(rule_judge.requests) == 1
    # scoring a scored group again keeps the first independent reward
    again = await judge(out, use_cache=False)
    assert [t.metrics["independent_reward"] for t in again.trajectories] == [0.3, 0.7, 0.1]


async def test_request_is_bounded_schema_with_rubric(rule_judge: RuleJudge, judge: Any) -> None:
    await judge(group(), rubric="Shorter is better.", explanation_chars=50)
    body = rule_judge.requests[-1]
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema"
    scores = fmt["json_schema"]["schema"]["properties"]["scores"]
    assert scores["minItems"] == scores["maxItems"] == 3
    item = scores["items"]["properties"]
    assert item["trajectory_id"]["enum"] == ["1", "2", "3"]
    assert item["explanation"]["maxLength"] == 50
    assert item["score"]["enum"] == list(range(11))
    assert "Shorter is better." in body["messages"][0]["content"]
    assert DEFAULT_RUBRIC not in body["messages"][0]["content"]
    assert body["temperature"] == 0.0 and body["max_tokens"] >= 3 * 50
    # the shared start is shown once, in the context
    user = body["messages"][1]["content"]
    assert user.count("What is the capital of France?") == 1
    assert user.index("What is the capital") < user.index('<trajectory id="1">')


async def test_identical_trajectories_are_judged_once(rule_judge: RuleJudge, judge: Any) -> None:
    g = jm.TrajectoryGroup([answer("Paris."), answer("Lyon."), answer("Paris."), answer("Paris.")])
    out = await judge(g)
    schema = rule_judge.requests[-1]["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["scores"]["items"]["properties"]["trajectory_id"]["enum"] == ["1", "2"]
    assert rule_judge.requests[-1]["messages"][1]["content"].count("Paris.") == 1
    assert out.rewards() == [1.0, 0.2, 1.0, 1.0] and out.metadata["ruler"]["unique"] == 2


async def test_cache_hit_makes_no_request(rule_judge: RuleJudge, judge: Any, tmp_path: Path) -> None:
    first = await judge(group())
    assert len(rule_judge.requests) == 1
    second = await judge(group())
    reordered = await judge(jm.TrajectoryGroup(list(reversed(group().trajectories))))
    assert len(rule_judge.requests) == 1  # both answered from disk
    assert second.rewards() == first.rewards() and reordered.rewards() == first.rewards()[::-1]
    assert all(t.metrics["ruler_cached"] == 1 for t in second.trajectories)
    assert len(list((tmp_path / "ruler").glob("*.json"))) == 1
    await judge(group(), rubric="Another rubric.")  # the rubric is part of the key
    await judge(group(), judge_model="rule-2")  # and so is the judge
    assert len(rule_judge.requests) == 3


async def test_default_cache_dir_honours_journeyman_cache(
    rule_judge: RuleJudge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOURNEYMAN_CACHE", str(tmp_path / "jm"))
    await ruler_score_group(group(), judge=rule_judge.base_url, judge_model="rule")
    assert len(list((tmp_path / "jm" / "ruler").glob("*.json"))) == 1


async def test_wrong_number_of_scores_is_retried_once(rule_judge: RuleJudge, judge: Any) -> None:
    rule_judge.plan = ["short"]
    out = await judge(group())
    assert len(rule_judge.requests) == 2
    assert out.rewards() == [1.0, 0.2, 0.2]
    assert all(t.metrics["ruler_retries"] == 1 for t in out.trajectories)
    retry = rule_judge.requests[1]["messages"]
    assert [m["role"] for m in retry] == ["system", "user", "assistant", "user"]
    assert "expected one score for each id ['1', '2', '3']" in retry[3]["content"]


async def test_wrong_twice_raises_a_named_error(rule_judge: RuleJudge, judge: Any, tmp_path: Path) -> None:
    rule_judge.plan = ["bad_ids", "short"]
    with pytest.raises(RulerJudgeError) as err:
        await judge(group())
    assert len(rule_judge.requests) == 2
    assert len(err.value.problems) == 2 and "'99'" in err.value.problems[0]
    assert "rule" in str(err.value) and "answered wrongly 2 times" in str(err.value)
    assert not list((tmp_path / "ruler").glob("*.json"))  # nothing wrong was cached


async def test_swallow_exceptions_skips_the_group_and_counts_it(rule_judge: RuleJudge, judge: Any) -> None:
    rule_judge.plan = ["prose", "prose"]
    g = group()
    out = await judge(g, swallow_exceptions=True)
    assert len(rule_judge.requests) == 2
    mean = sum(g.rewards()) / 3
    assert out.rewards() == pytest.approx([mean] * 3)  # no learning signal left in it
    assert [t.metrics["ruler_skipped"] for t in out.trajectories] == [1, 1, 1]
    assert [t.metrics["independent_reward"] for t in out.trajectories] == [0.3, 0.7, 0.1]
    assert out.metadata["ruler"]["skipped"] and "not JSON" in out.metadata["ruler"]["error"]


async def test_tools_calls_and_truncated_outputs_are_shown(rule_judge: RuleJudge, judge: Any) -> None:
    tools = [function_tool("get_weather", "Weather for a city", {"city": {"type": "string"}})]
    long_output = "sunny " * 1000 + "END-OF-REPORT"

    def run(city: str) -> jm.Trajectory:
        return jm.Trajectory(
            tools=tools,
            messages_and_choices=[
                {"role": "user", "content": "Weather in the capital of France?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{city}",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"call_{city}", "content": long_output},
                {"role": "assistant", "content": f"It is sunny in {city}."},
            ],
        )

    out = await judge(jm.TrajectoryGroup([run("Paris"), run("Lyon")]), max_tool_output_chars=300)
    user = rule_judge.requests[-1]["messages"][1]["content"]
    assert user.count('"name": "get_weather"') == 1  # tool definitions, shared, shown once
    assert '<tool_call name="get_weather">{"city": "Paris"}</tool_call>' in user
    assert '<tool_result name="get_weather">' in user
    assert "characters truncated" in user and "END-OF-REPORT" in user  # head + tail kept
    assert long_output not in user and len(user) < 3000
    assert out.rewards() == [1.0, 0.2]


async def test_after_each_of_gather(rule_judge: RuleJudge, judge: Any) -> None:
    async def rollout(text: str) -> jm.Trajectory:
        await asyncio.sleep(0)
        return answer(text)

    groups = await jm.gather_trajectory_groups(
        (
            jm.TrajectoryGroup(rollout(a) for a in answers)
            for answers in (["Paris.", "Nice."], ["Rome?", "Paris"])
        ),
        pbar_desc=None,
        after_each=judge,
    )
    assert [sorted(g.rewards()) for g in groups] == [[0.2, 1.0], [0.2, 1.0]]
    assert all("independent_reward" in t.metrics for g in groups for t in g.trajectories)


async def test_judge_specs() -> None:
    with pytest.raises(jm.InvalidFieldError) as err:
        await ruler_score_group(group(), judge="http://127.0.0.1:9/v1", swallow_exceptions=True)
    assert err.value.field == "judge_model"
    with pytest.raises(jm.InvalidFieldError) as err:
        await ruler_score_group(group(), judge="")
    assert err.value.field == "judge"
    with pytest.raises(jm.InvalidFieldError) as err:  # nothing of that name is served in this process
        await ruler_score_group(group(), judge="local:no-such-model")
    assert err.value.field == "judge"
    with pytest.MonkeyPatch.context() as mp:  # an install without the litellm extra
        mp.setitem(sys.modules, "litellm", None)
        with pytest.raises(ImportError, match=r'pip install "journeyman\[litellm\]"'):
            await ruler_score_group(group(), judge="openai/gpt-4o", swallow_exceptions=True)


async def test_config_values_are_checked_by_name() -> None:
    with pytest.raises(jm.InvalidFieldError) as err:
        await ruler_score_group(group(), judge="http://127.0.0.1:9/v1", explanation_chars=-1)
    assert err.value.field == "explanation_chars"
    with pytest.raises(jm.InvalidFieldError) as err:  # a typo is refused, never ignored
        await ruler_score_group(group(), judge="http://127.0.0.1:9/v1", judge_modle="rule")
    assert err.value.field == "judge_modle" and "judge_model" in err.value.reason
    with pytest.raises(jm.InvalidFieldError) as err:
        RulerConfig(timeout_s=0)
    assert err.value.field == "timeout_s"
    with pytest.raises(jm.InvalidFieldError) as err:
        await ruler_score_group(group(), config={"judge_model": "rule"})  # type: ignore[arg-type]
    assert err.value.field == "config"
    # keyword options override the config's fields; the config itself is left as it was
    base = RulerConfig(judge_model="a", explanation_chars=10)
    assert base.with_options(explanation_chars=20) == RulerConfig(judge_model="a", explanation_chars=20)
    assert base.explanation_chars == 10 and "api_key" not in repr(RulerConfig(api_key="k"))


async def test_unreachable_judge_is_swallowed_on_request(tmp_path: Path) -> None:
    config = RulerConfig(judge_model="rule", cache_dir=tmp_path, timeout_s=5)
    out = await ruler_score_group(group(), "http://127.0.0.1:9/v1", swallow_exceptions=True, config=config)
    assert out.metadata["ruler"]["skipped"] and out.metadata["ruler"]["judge"] == "http://127.0.0.1:9/v1"
    with pytest.raises(Exception, match="Connection"):
        await ruler_score_group(group(), "http://127.0.0.1:9/v1", config=config)


def test_truncate_and_prompt_shape() -> None:
    text = "a" * 50 + "b" * 50
    cut = truncate(text, 30)
    assert cut.startswith("a" * 20) and cut.endswith("b" * 10) and "70 of 100 characters truncated" in cut
    assert truncate("short", 30) == "short"
    # one trajectory alone: its answer is still shown as the trajectory, not folded into the context
    prompt = build_prompt([answer("Paris.")])
    assert (
        prompt.ids == ["1"]
        and '<trajectory id="1">\n<message role="assistant">\nParis.' in prompt.messages[1]["content"]
    )


@pytest.mark.integration
async def test_train_one_step_on_ruler_rewards(rule_judge: RuleJudge, judge: Any, tmp_path: Path) -> None:
    """The policy's own samples, scored by a judge endpoint, train one real GRPO step."""
    question = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    async with jm.LocalBackend(path=tmp_path / "runs") as backend:
        model = jm.TrainableModel(name="ruler-train", project="tests")
        await model.register(backend)
        out = await model.openai_client().chat.completions.create(
            model=model.name, messages=question, n=6, max_tokens=12, temperature=1.3, seed=5
        )
        group = jm.TrajectoryGroup([jm.Trajectory(messages_and_choices=[*question, c]) for c in out.choices])
        scored = await judge(group)
        assert len(set(scored.rewards())) > 1, [c.message.content for c in out.choices]
        result = await model.train([scored], config=jm.TrainConfig(learning_rate=1e-4))
        assert not result.skipped and result.step == 1 and result.metrics["trained_tokens"] > 0
        assert await model.get_step() == 1
