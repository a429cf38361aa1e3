"""Langfuse trace review, with the real Langfuse SDK against a local receiver of its wire calls.

A real Langfuse server cannot run here (containers only, ClickHouse 25+). `langfuse_receiver`
speaks the endpoints the SDK 5.x calls (OTLP traces, scores, v2 observations, v3 scores) and
decodes what it receives; the rollouts come from the real embedded model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from _support import function_tool, langfuse_receiver
from journeyman.app import tasks
from journeyman.integrations.langfuse import (
    META_KEY,
    TRACE_ID_KEY,
    LangfuseExporter,
    ReviewQuery,
    ReviewScore,
    export_to_langfuse,
    fetch_review_set,
)
from journeyman.rollout.observe import GroupContext, emit
from journeyman.training.rows import trajectory_rows

pytestmark = pytest.mark.integration

LangfuseReceiver = langfuse_receiver().LangfuseReceiver

TOOLS = [function_tool("get_time", "The current time in a time zone", {"tz": {"type": "string"}})]
# The 135M model copies this text reliably when greedy: a real sampled tool call.
COPY_TOOL_CALL = 'Repeat exactly, with nothing else: <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'


def _keys() -> tuple[str, str]:
    return f"pk-lf-{uuid.uuid4().hex[:8]}", f"sk-lf-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def receiver() -> Iterator[Any]:
    r = LangfuseReceiver(*_keys())
    yield r
    r.stop()


@pytest.fixture(scope="module")
async def exported(
    served: tuple[Any, Any], receiver: Any
) -> AsyncIterator[tuple[LangfuseExporter, list[jm.TrajectoryGroup]]]:
    """Two groups gathered from the real model (one with a tool call, a tool result and a side
    conversation), announced by gather and then by log (as `model.log` does), exported once each."""
    model, _ = served
    exporter = export_to_langfuse(
        receiver.public_key, receiver.secret_key, receiver.host, hold_s=60.0, tags=["test"]
    )
    client = model.openai_client()

    async def tool_rollout() -> jm.Trajectory:
        messages: list[Any] = [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": COPY_TOOL_CALL},
        ]
        side_msgs = [{"role": "user", "content": "Summarise in one word: the time is noon."}]
        first, side = await asyncio.gather(  # batched together by the engine
            client.chat.completions.create(
                model=model.name, messages=messages, tools=TOOLS, max_tokens=32, temperature=0.0
            ),
            client.chat.completions.create(model=model.name, messages=side_msgs, max_tokens=2, seed=2),
        )
        call = first.choices[0].message.tool_calls[0]
        history = [
            *messages,
            first.choices[0],
            {"role": "tool", "tool_call_id": call.id, "content": "12:00 UTC"},
        ]
        convo = [*messages, first.choices[0].message.model_dump(exclude_none=True), history[-1]]
        final = await client.chat.completions.create(
            model=model.name, messages=convo, tools=TOOLS, max_tokens=3, seed=1
        )
        return jm.Trajectory(
            messages_and_choices=[*history, final.choices[0]],
            tools=TOOLS,
            reward=0.5,
            metrics={"tool_calls": 1},
            metadata={"scenario_id": "time"},
            additional_histories=[
                jm.History(messages_and_choices=[*side_msgs, side.choices[0]], trainable=False)
            ],
        )

    async def plain_rollout(seed: int) -> jm.Trajectory:
        messages = [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": COPY_TOOL_CALL},
        ]
        done = await client.chat.completions.create(
            model=model.name, messages=messages, tools=TOOLS, max_tokens=3, seed=seed
        )
        return jm.Trajectory(
            messages_and_choices=[*messages, done.choices[0]],
            tools=TOOLS,
            reward=0.0,
            metadata={"scenario_id": "time"},
        )

    async def topic_rollout(seed: int) -> jm.Trajectory:
        t = await tasks.rollout(
            model, client, tasks.Scenario(topic="owl", prompt="What is an owl?"), max_tokens=3, seed=seed
        )
        t.metadata["scenario_id"] = "owl"
        return t

    groups = await jm.gather_trajectory_groups(
        [
            jm.TrajectoryGroup([topic_rollout(1), topic_rollout(2)]),
            jm.TrajectoryGroup([tool_rollout(), plain_rollout(3)]),
        ],
        pbar_desc=None,
    )
    # what the backend's `log` announces next (the run's context); the exporter merges both
    emit(groups, GroupContext(project="tests", model=model.name, step=0, split="val", source="log"))
    assert exporter.flush(60)
    yield exporter, groups
    exporter.close()


def _traj_spans(receiver: Any, trace_id: str) -> list[dict[str, Any]]:
    return sorted((s for s in receiver.spans if s["trace_id"] == trace_id), key=lambda s: s["start_ns"])


def _lf(span: dict[str, Any], key: str) -> Any:
    v = span["attributes"].get(key)
    return json.loads(v) if isinstance(v, str) and v[:1] in '[{"' else v


async def test_export_sends_one_trace_per_trajectory_with_generations_tools_and_reward(
    exported: Any, receiver: Any
) -> None:
    exporter, groups = exported
    trajectories = [t for g in groups for t in g.trajectories]
    assert exporter.stats.exported == 4 and exporter.stats.dropped == {}
    assert receiver.unknown == []
    assert {p for m, p, _ in receiver.requests} == {"/api/public/otel/v1/traces", "/api/public/scores"}
    roots = [s for s in receiver.spans if s["attributes"].get("langfuse.internal.as_root")]
    assert sorted(s["trace_id"] for s in roots) == sorted(
        t.metadata[TRACE_ID_KEY] for t in trajectories
    )  # no duplicates

    for group in groups:
        for t in group.trajectories:
            spans = _traj_spans(receiver, t.metadata[TRACE_ID_KEY])
            root = next(s for s in spans if s["attributes"].get("langfuse.internal.as_root"))
            a = root["attributes"]
            assert a["langfuse.trace.name"] == "shared" and a["langfuse.observation.type"] == "agent"
            assert {"journeyman", "split:val", "project:tests", "test"} <= set(a["langfuse.trace.tags"])
            assert a["session.id"] == group.metadata["langfuse_group_id"]
            assert json.loads(a["langfuse.trace.metadata.step"]) == 0
            assert json.loads(a["langfuse.observation.metadata.scenario_id"]) == t.metadata["scenario_id"]
            payload = json.loads(a[f"langfuse.observation.metadata.{META_KEY}"])
            assert (
                payload["split"] == "val" and payload["project"] == "tests" and payload["reward"] == t.reward
            )

            gens = [s for s in spans if s["attributes"].get("langfuse.observation.type") == "generation"]
            histories = [t, *t.additional_histories]
            choices = [
                (h, pos, c)
                for h in histories
                for pos, c in enumerate(h.messages_and_choices)
                if not isinstance(c, dict)
            ]
            assert len(gens) == len(choices)
            for span, (h, pos, choice) in zip(gens, choices, strict=True):
                record = jm.record_of(choice)
                assert record is not None
                request = _lf(span, "langfuse.observation.input")
                sent = request["messages"] if isinstance(request, dict) else request
                assert sent == h.messages()[:pos]
                assert _lf(span, "langfuse.observation.output") == h.messages()[pos]
                assert span["attributes"]["langfuse.observation.model.name"] == record.model == "shared@0"
                assert _lf(span, "langfuse.observation.usage_details") == {
                    "input": len(record.prompt_token_ids),
                    "output": len(record.token_ids),
                }
                exact = json.loads(span["attributes"][f"langfuse.observation.metadata.{META_KEY}"])["record"]
                assert jm.TokenRecord.model_validate(exact) == record

    tool_traj = next(t for t in trajectories if t.metrics.get("tool_calls"))  # groups keep completion order
    spans = _traj_spans(receiver, tool_traj.metadata[TRACE_ID_KEY])
    call_gen = next(s for s in spans if s["attributes"].get("langfuse.observation.type") == "generation")
    assert _lf(call_gen, "langfuse.observation.output")["tool_calls"][0]["function"]["name"] == "get_time"
    tool = next(s for s in spans if s["attributes"].get("langfuse.observation.type") == "tool")
    assert tool["name"] == "get_time" and _lf(tool, "langfuse.observation.input") == {"tz": "UTC"}
    assert tool["attributes"]["langfuse.observation.output"] == "12:00 UTC"
    assert any(
        s["name"] == "history 1" and s["attributes"]["langfuse.observation.type"] == "chain" for s in spans
    )

    posted = {s["traceId"]: s for batch in receiver.score_posts for s in batch}
    for t in trajectories:
        s = posted[t.metadata[TRACE_ID_KEY]]
        assert s["name"] == "reward" and s["value"] == t.reward and s["dataType"] == "NUMERIC"


@pytest.fixture(scope="module")
def reviewed(exported: Any, receiver: Any) -> dict[str, float]:
    """People review the traces in an annotation queue: a 'human' score each, two on one trace."""
    _, groups = exported
    expected = {}
    for group in groups:
        for i, t in enumerate(group.trajectories):
            tid = t.metadata[TRACE_ID_KEY]
            receiver.add_review_score(tid, "human", 1.0 - i)
            expected[tid] = 1.0 - i
    tid = groups[0].trajectories[0].metadata[TRACE_ID_KEY]
    receiver.add_review_score(tid, "human", 0.5, author="reviewer-2")
    expected[tid] = 0.75  # a second reviewer: the mean of 1.0 and 0.5
    return expected


def _rows(t: jm.Trajectory, chat_format: Any) -> list[tuple[list[int], list[bool], list[float | None]]]:
    return [
        (r.input_ids, r.trained, [None if math.isnan(x) else x for x in r.rollout_logprobs])
        for r in trajectory_rows(t, chat_format, 1.0)
    ]


async def test_import_rebuilds_identical_token_records_from_reviewed_traces(
    exported: Any, reviewed: dict[str, float], receiver: Any, chat_format: Any
) -> None:
    _, groups = exported
    review = await fetch_review_set(
        score="human", tags=["journeyman", "split:val"], score_source="ANNOTATION",
        public_key=receiver.public_key, secret_key=receiver.secret_key, host=receiver.host, progress=False,
    )  # fmt: skip
    assert (
        review.traces == 4 and review.trajectories == 4 and review.retokenized == 0 and review.skipped == {}
    )
    assert [g.metadata["group_key"] for g in review.groups] == [
        g.metadata["langfuse_group_id"] for g in groups
    ]
    originals = {t.metadata[TRACE_ID_KEY]: t for g in groups for t in g.trajectories}
    for group in review.groups:
        for t in group.trajectories:
            tid = t.metadata[TRACE_ID_KEY]
            o = originals[tid]
            assert t.reward == reviewed[tid]
            assert (
                t.metadata["retokenized"] is False and t.metadata["scenario_id"] == o.metadata["scenario_id"]
            )
            assert [r.model_dump() for r in t.records()] == [r.model_dump() for r in o.records()]
            assert t.messages() == o.messages() and t.tools == o.tools and t.metrics == o.metrics
            assert len(t.additional_histories) == len(o.additional_histories)
            for a, b in zip(t.additional_histories, o.additional_histories, strict=True):
                assert a.trainable == b.trainable and a.messages() == b.messages()
                assert [r.model_dump() for r in a.records()] == [r.model_dump() for r in b.records()]
            assert _rows(t, chat_format) == _rows(o, chat_format)  # what the trainer sees, token for token
    # v2 observations were read with our payloads unabridged; everything else stays truncated
    reads = [q for m, p, q in receiver.requests if p == "/api/public/v2/observations" and "traceId" in q]
    assert reads and all(q["expandMetadata"] == META_KEY for q in reads)


async def test_foreign_traces_are_retokenized_grouped_by_metadata_and_skips_are_counted(
    chat_format: Any, caplog: Any
) -> None:
    from langfuse import Langfuse
    from opentelemetry.sdk.trace import TracerProvider

    r = LangfuseReceiver(*_keys())
    try:
        # An app instrumented with Langfuse by hand: a span per request, generations, a tool.
        lf = Langfuse(
            public_key=r.public_key,
            secret_key=r.secret_key,
            base_url=r.host,
            tracer_provider=TracerProvider(),
        )
        system = {"role": "system", "content": "You answer support questions."}
        call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"order": 7}'}}

        def trace(scenario: str, with_generation: bool = True) -> str:
            user = {"role": "user", "content": f"Where is order 7? ({scenario})"}
            with lf.start_as_current_observation(
                name="support", as_type="span", input=user["content"], metadata={"scenario_id": scenario}
            ) as root:
                if with_generation:
                    with lf.start_as_current_observation(
                        name="llm",
                        as_type="generation",
                        model="gpt-x",
                        input=[system, user],
                        output={"role": "assistant", "content": None, "tool_calls": [call]},
                    ):
                        pass
                    with lf.start_as_current_observation(
                        name="lookup", as_type="tool", input={"order": 7}, output="shipped"
                    ):
                        pass
                    tool_msg = {"role": "tool", "tool_call_id": "c1", "content": "shipped"}
                    with lf.start_as_current_observation(
                        name="llm",
                        as_type="generation",
                        model="gpt-x",
                        input=[
                            system,
                            user,
                            {"role": "assistant", "content": None, "tool_calls": [call]},
                            tool_msg,
                        ],
                        output="It has shipped.",
                    ):
                        pass
                    with lf.start_as_current_observation(
                        name="judge", as_type="generation", model="gpt-y", input="rate it", output="9/10"
                    ):
                        pass
                return root.trace_id

        a, b, c, d, e = trace("s1"), trace("s1"), trace("s2"), trace("s2"), trace("s3", with_generation=False)
        for tid, human, thumbs in ((a, 0.2, True), (b, 0.8, False), (c, 0.5, None), (e, 1.0, None)):
            lf.create_score(name="human", value=human, trace_id=tid)
            if thumbs is not None:
                lf.create_score(name="thumbs", value=float(thumbs), trace_id=tid, data_type="BOOLEAN")
        lf.flush()
        del d  # never scored

        with caplog.at_level(logging.WARNING, logger="journeyman.langfuse"):
            review = await fetch_review_set(
                score=["human", "thumbs"], group_by="scenario_id", generation_name="llm",
                public_key=r.public_key, secret_key=r.secret_key, host=r.host, progress=False,
            )  # fmt: skip
        assert review.traces == 5
        assert review.skipped == {"no score": 1, "no policy generation": 1, "group of one": 1}
        assert len(review.groups) == 1 and review.groups[0].metadata["group_key"] == "s1"
        assert sorted(review.groups[0].rewards()) == [0.4, 0.6]  # mean(0.8, 0) and mean(0.2, 1)
        assert review.retokenized == 2 and "retokenized" in caplog.text
        t = review.groups[0].trajectories[0]
        assert t.metadata["retokenized"] is True and t.records() == [] and t.additional_histories == []
        assert [m["role"] for m in t.messages()] == ["system", "user", "assistant", "tool", "assistant"]
        assert t.messages()[2]["tool_calls"][0]["function"] == call["function"]
        rows = trajectory_rows(t, chat_format, 1.0)
        assert len(rows) == 1 and rows[0].retokenized and rows[0].num_trained > 0
    finally:
        r.stop()


async def test_cli_pulls_the_review_set_and_trains_one_step(
    exported: Any, reviewed: dict[str, float], receiver: Any, run_root: Path, tmp_path: Path
) -> None:
    from journeyman.app.langfuse_cli import app
    from typer.testing import CliRunner

    exporter, _ = exported
    env = {
        "LANGFUSE_PUBLIC_KEY": receiver.public_key,
        "LANGFUSE_SECRET_KEY": receiver.secret_key,
        "LANGFUSE_BASE_URL": receiver.host,
    }
    runner = CliRunner()
    out = tmp_path / "review.jsonl"
    pulled = await asyncio.to_thread(
        runner.invoke,
        app,
        ["pull", "--score", "human", "--tag", "journeyman", "--source", "ANNOTATION", "--output", str(out)],
        env=env,
    )
    assert pulled.exit_code == 0, pulled.output
    assert (
        "kept 4 trajectories in 2 groups from 4 traces" in pulled.output
        and len(out.read_text().splitlines()) == 2
    )

    roots_before, skipped_before = len(receiver.roots()), exporter.stats.skipped
    trained = await asyncio.to_thread(
        runner.invoke, app,
        ["train", "--input", str(out), "--model", "lf-review", "--project", "tests", "--path", str(run_root), "--learning-rate", "1e-4"],
        env=env,
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    assert "now at step 1" in trained.output and '"rows_retokenized": 0.0' in trained.output
    history = (run_root / "tests" / "models" / "lf-review" / "history.jsonl").read_text().splitlines()
    assert json.loads(history[-1])["train/rows_retokenized"] == 0.0
    # training announced the imported trajectories; they are Langfuse traces already: not re-exported
    assert exporter.flush(30)
    assert len(receiver.roots()) == roots_before and exporter.stats.skipped == skipped_before + 4

    dry = await asyncio.to_thread(
        runner.invoke, app, ["train", "--score", "nobody-uses-this", "--dry-run"], env=env
    )
    assert dry.exit_code == 1 and "skipped:" in dry.output and "no score" in dry.output


async def test_review_query_states_each_filter_once_and_keywords_still_work() -> None:
    one_each: dict[str, Any] = {"score": "human", "tags": "journeyman", "score_source": "ANNOTATION"}
    q = ReviewQuery(**one_each, since=datetime(2026, 1, 2))
    assert (q.score, q.tags, q.score_source) == (["human"], ["journeyman"], ["ANNOTATION"])
    assert q.since == datetime(2026, 1, 2, tzinfo=UTC)  # a naive time is UTC, as the CLI always said

    def best(scores: list[ReviewScore]) -> float | None:
        return max(s.value or 0.0 for s in scores)

    assert ReviewQuery(score=["h"], combine=best).combine is best  # a function stays a function
    for field, bad in [
        ("score", {"score": ""}),
        ("score", {"score": []}),
        ("combine", {"score": "h", "combine": "median"}),
        ("min_group_size", {"score": "h", "min_group_size": 0}),
    ]:
        with pytest.raises(jm.InvalidFieldError) as e:
            ReviewQuery(**bad)
        assert e.value.field == field
    # keywords build the query, and replace a given query's fields; refused before any request
    with pytest.raises(jm.InvalidFieldError) as e:
        await fetch_review_set(ReviewQuery(score=["human"]), min_group_size=0, host="http://127.0.0.1:9")
    assert e.value.field == "min_group_size"


async def test_two_programs_in_one_process_each_export_to_their_own(receiver: Any) -> None:
    """Export belongs to the context that turned it on: two task trees, two exporters, neither
    replacing the other, each exporting only the trajectories announced in its own tree."""

    async def program(tag: str, steps: int) -> LangfuseExporter:
        exporter = export_to_langfuse(receiver.public_key, receiver.secret_key, receiver.host, tags=[tag])
        for step in range(steps):
            group = jm.TrajectoryGroup(
                [
                    jm.Trajectory(
                        messages_and_choices=[
                            {"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a"},
                        ],
                        reward=float(i),
                    )
                    for i in range(2)
                ]
            )
            emit([group], GroupContext(project="p", model="m", step=step, split="val", source="log"))
            await asyncio.sleep(0.01)  # the other program runs in between
        assert exporter.flush(30)
        return exporter

    tags = [f"program-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    first, second = await asyncio.gather(
        asyncio.create_task(program(tags[0], 1)), asyncio.create_task(program(tags[1], 2))
    )
    try:
        assert not first.closed and not second.closed
        assert (first.stats.exported, second.stats.exported) == (2, 4)
        counts = [sum(tag in t["tags"] for t in receiver.traces.values()) for tag in tags]
        assert counts == [2, 4], counts
    finally:
        first.close()
        second.close()


# Last: enabling export again replaces (closes) the module's exporter.
async def test_unreachable_langfuse_never_blocks_or_breaks_training(caplog: Any) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = export_to_langfuse(
        *_keys(), f"http://127.0.0.1:{port}", max_queue=8, timeout_s=1.0, retry_after_s=5.0
    )
    try:
        with caplog.at_level(logging.WARNING, logger="journeyman.langfuse"):
            slowest = 0.0
            for step in range(20):
                group = jm.TrajectoryGroup(
                    [
                        jm.Trajectory(
                            messages_and_choices=[
                                {"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a"},
                            ],
                            reward=i,
                        )
                        for i in range(2)
                    ]
                )
                t0 = time.perf_counter()
                emit([group], GroupContext(project="p", model="m", step=step, source="train"))
                slowest = max(slowest, time.perf_counter() - t0)
                await asyncio.sleep(0.01)
            assert exporter.flush(30)
            t0 = time.perf_counter()
            exporter.close(timeout=10)
            assert time.perf_counter() - t0 < 10
        stats = exporter.stats
        assert slowest < 0.1, f"emit blocked for {slowest:.3f}s"
        assert stats.exported == 0 and stats.dropped_total == 40 and stats.queued == 0
        assert "trajectories dropped so far" in caplog.text and "training is not affected" in caplog.text
    finally:
        exporter.close()
