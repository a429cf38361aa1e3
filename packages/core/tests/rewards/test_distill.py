"""On-policy distillation: per-token advantages from a teacher's logprobs, on the embedded model.

The teacher here is another model registered on the same backend (its base shared) or the embedded
base loaded by the backend; the vLLM teacher is tested in `engine/test_vllm.py`. A teacher server
whose tokenizer differs or whose answer lacks logprobs cannot be run here (no other model's weights
are at hand), so those answers come from a wire-level stand-in speaking `/v1/completions`.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import journeyman as jm
import pytest
import torch
from _support import recorded_choice, task_groups
from journeyman.training.loss import policy_loss
from journeyman.training.trainer import build_rows

pytestmark = pytest.mark.integration


def _group(*rewards: float, teacher: list[float] | None = None) -> jm.TrajectoryGroup:
    trajectories = []
    for r in rewards:
        choice = recorded_choice(prompt_token_ids=[1, 2], token_ids=[3, 4])
        if teacher is not None:
            (choice.model_extra or {})["journeyman"]["teacher_logprobs"] = teacher
        trajectories.append(
            jm.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=r)
        )
    return jm.TrajectoryGroup(trajectories)


DISTILL = jm.DistillConfig(teacher=jm.Teacher(model="teacher"))


def test_distillation_trains_groups_whose_rewards_are_equal_and_needs_every_token_scored(chat_format) -> None:
    equal = _group(1.0, 1.0, teacher=[-0.1, -0.2])
    rows, m = build_rows([equal], chat_format, jm.TrainConfig())
    assert rows == [] and m["groups_zero_signal"] == 1  # GRPO alone: nothing to learn
    rows, m = build_rows([equal], chat_format, jm.TrainConfig(distill=DISTILL))
    assert len(rows) == 2 and all(r.advantage == 0.0 for r in rows)  # the teacher's signal alone
    assert rows[0].teacher_logprobs[2:] == [-0.1, -0.2] and math.isnan(rows[0].teacher_logprobs[0])
    mixed = jm.DistillConfig(teacher=jm.Teacher(model="teacher"), reward_weight=0.5)
    rows, _ = build_rows([_group(1.0, 0.0, teacher=[-0.1, -0.2])], chat_format, jm.TrainConfig(distill=mixed))
    assert [r.advantage for r in rows] == pytest.approx([0.5, -0.5], abs=1e-5)  # GRPO's ±1, weighted
    with pytest.raises(jm.TeacherLogprobsError) as e:
        build_rows([_group(1.0, 0.0)], chat_format, jm.TrainConfig(distill=DISTILL))
    assert e.value.field == "groups[0].trajectories[0].token[2]"


def test_a_token_the_teacher_likes_more_than_the_student_is_pushed_up() -> None:
    """The per-token advantage log π_teacher - log π_student through the PPO loss: the gradient
    raises the student's logprob where the teacher's is higher and lowers it where it is lower."""
    logp = torch.tensor([[-2.0, -1.0, -3.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -1.0, -4.0]])
    advantages = teacher - logp.detach()  # [1.5, 0, -1]
    loss, _ = policy_loss(logp, logp.detach(), advantages, torch.ones(1, 3), 3)
    loss.backward()
    assert logp.grad is not None
    ascent = -logp.grad[0]
    assert ascent[0] > 0 and ascent[1] == 0 and ascent[2] < 0


def test_teacher_settings_are_checked_by_name() -> None:
    with pytest.raises(jm.InvalidFieldError) as e:
        jm.Teacher()
    assert e.value.field == "teacher.model"
    with pytest.raises(jm.InvalidFieldError) as e:
        jm.Teacher(model="t", checkpoint="/x")
    assert e.value.field == "teacher.checkpoint"
    with pytest.raises(jm.InvalidFieldError) as e:
        jm.Teacher(base_url="http://127.0.0.1:1/v1", base_model="smollm2-135m-instruct")
    assert e.value.field == "teacher.base_url"


@pytest.fixture(scope="module")
async def two(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A student and a teacher registered on one backend (one copy of the base)."""
    backend = jm.LocalBackend(path=tmp_path_factory.mktemp("distill"))
    student = jm.TrainableModel(name="student", project="distill")
    teacher = jm.TrainableModel(name="teacher", project="distill")
    await student.register(backend)
    await teacher.register(backend)
    yield student, teacher, backend
    backend.close()


def _sampled_logprobs(policy: Any, groups: list[jm.TrajectoryGroup]) -> list[float]:
    out: list[float] = []
    for g in groups:
        for t in g.trajectories:
            for rec in t.records():
                out += policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids)
    return out


async def test_a_distillation_step_moves_the_student_toward_its_teacher(two) -> None:
    """The teacher is pushed away from the base by a GRPO step of its own; the student is the base.
    One step of pure distillation, on groups whose rewards are all equal, brings the student's
    logprobs of its own samples closer to the teacher's, and the run file keeps the teacher's
    logprobs beside the student's."""
    student, teacher, backend = two
    away = await task_groups(teacher, groups=2, size=2, max_tokens=8)
    assert not (await teacher.train(away, config=jm.TrainConfig(learning_rate=3e-3))).skipped
    groups = await task_groups(student, groups=2, size=2, max_tokens=8, signal=False)
    for g in groups:
        for t in g.trajectories:
            t.reward = 0.5
    policy, teacher_policy = backend.service("student").policy, backend.service("teacher").policy
    teacher_lp = _sampled_logprobs(teacher_policy, groups)
    before = sum(abs(a - b) for a, b in zip(_sampled_logprobs(policy, groups), teacher_lp, strict=True))
    config = jm.TrainConfig(learning_rate=3e-4, distill=DISTILL)
    result = await student.train(groups, config=config)
    assert not result.skipped and result.step == 1
    m = result.metrics
    # teacher_kl: an estimate from 4 samples, a KL in expectation only (one run here read -0.03)
    assert m["teacher_sequences"] == 4 and m["teacher_tokens"] > 0 and math.isfinite(m["teacher_kl"])
    after = sum(abs(a - b) for a, b in zip(_sampled_logprobs(policy, groups), teacher_lp, strict=True))
    assert after < 0.9 * before, (before, after)  # 0.72-0.81 in runs here
    lines = (student.run_dir / "trajectories" / "train" / "0000.jsonl").read_text().splitlines()
    kept = [
        c["journeyman"]
        for line in lines
        for t in json.loads(line)["trajectories"]
        for c in t["messages_and_choices"]
        if "journeyman" in c
    ]
    assert len(kept) == 4
    for rec in kept:
        assert len(rec["teacher_logprobs"]) == len(rec["token_ids"])
    scored = [lp for r in kept for lp in r["teacher_logprobs"]]
    assert max(abs(a - b) for a, b in zip(scored, teacher_lp, strict=True)) < 1e-3
    # the viewer's token rows carry the teacher's logprob beside the student's, trained tokens only
    from journeyman.app.view.server import ViewerServer

    server = ViewerServer([student.run_dir.parents[2]]).start()
    try:
        with urllib.request.urlopen(server.url + "api/runs", timeout=30) as r:
            (run,) = [x for x in json.loads(r.read()) if x["name"] == "student"]
        url = server.url + f"api/runs/{run['id']}/trajectory/train/0000/0/0"
        with urllib.request.urlopen(url, timeout=30) as r:
            (row,) = json.loads(r.read())["rows"]
    finally:
        server.close()
    shown = [t for t, trained in zip(row["teacher_logprobs"], row["trained"], strict=True) if trained]
    assert shown == kept[0]["teacher_logprobs"]
    assert all(
        t is None for t, trained in zip(row["teacher_logprobs"], row["trained"], strict=True) if not trained
    )


async def test_a_base_model_teacher_is_loaded_and_its_scores_cached_with_the_groups(two) -> None:
    student, _, backend = two
    groups = await task_groups(student, groups=1, size=2, max_tokens=6)
    config = jm.TrainConfig(distill=jm.DistillConfig(teacher=jm.Teacher(base_model=jm.DEFAULT_BASE_MODEL)))
    from journeyman.backends.teachers import score_for_step

    s = backend.service("student")
    counts = await score_for_step(s, groups, config.distill.teacher)  # type: ignore[union-attr]
    assert counts["teacher_sequences"] == 2
    again = await score_for_step(s, groups, config.distill.teacher)  # type: ignore[union-attr]
    assert again["teacher_sequences"] == 0  # kept on the records: asked once
    with backend.service("teacher").policy.base_only():
        base = _sampled_logprobs(backend.service("teacher").policy, groups)
    scored = [
        lp for g in groups for t in g.trajectories for r in t.records() for lp in r.teacher_logprobs or []
    ]
    assert max(abs(a - b) for a, b in zip(scored, base, strict=True)) < 1e-3


class TeacherStandIn:
    """`/v1/completions` as a teacher server answers it, wrong on request: `plan` holds what the next
    answers do (other_text: another tokenizer's reading; none: a logprob missing; nan: a NaN)."""

    def __init__(self, vocab_text: Any) -> None:
        from fastapi import FastAPI, Request
        from fastapi.responses import Response
        from journeyman.serving.endpoint import ServerThread

        self.plan: list[str] = []
        app = FastAPI()

        async def complete(request: Request) -> Response:
            body = await request.json()
            how = self.plan.pop(0) if self.plan else "ok"
            choices = []
            for i, ids in enumerate(body["prompt"]):
                lps: list[Any] = [None, *[-1.0] * (len(ids) - 1)]
                if how == "none":  # the last token: a sampled one
                    lps[-1] = None
                if how == "nan":
                    lps[-1] = "NaN"
                text = vocab_text(ids) if how != "other_text" else vocab_text(ids).upper()
                choices.append({"index": i, "text": text, "logprobs": {"token_logprobs": lps}})
            raw = json.dumps({"choices": choices}).replace('"NaN"', "NaN")
            return Response(raw, media_type="application/json")

        complete.__annotations__ = {"request": Request, "return": Response}
        app.post("/v1/completions")(complete)
        self.server = ServerThread(app)
        self.base_url = self.server.base_url


@pytest.fixture(scope="module")
def stand_in(chat_format) -> Iterator[TeacherStandIn]:
    server = TeacherStandIn(lambda ids: chat_format.tokenizer.decode(ids))
    yield server
    server.server.stop()


@pytest.mark.parametrize(
    ("plan", "error", "says"),
    [
        (["other_text"], jm.TeacherTokenizerError, "its tokenizer is another one"),
        (["ok", "none"], jm.TeacherLogprobsError, "is not a finite number"),
        (["ok", "nan"], jm.TeacherLogprobsError, "is not a finite number"),
        (None, jm.TeacherUnreachableError, "teacher.base_url='http://127.0.0.1:9/v1'"),
    ],
)
async def test_a_bad_teacher_is_a_named_error_and_the_groups_are_kept(
    two, stand_in: TeacherStandIn, plan: list[str] | None, error: type[Exception], says: str
) -> None:
    student, _, _ = two
    step = await student.get_step()
    groups = await task_groups(student, groups=1, size=2, max_tokens=6)
    before = [g.model_dump_json() for g in groups]
    base_url = stand_in.base_url if plan is not None else "http://127.0.0.1:9/v1"
    stand_in.plan = list(plan or [])
    teacher = jm.Teacher(base_url=base_url, model=f"teacher-{'-'.join(stand_in.plan)}", timeout_s=5)
    with pytest.raises(error) as e:
        await student.train(groups, config=jm.TrainConfig(distill=jm.DistillConfig(teacher=teacher)))
    assert says in str(e.value)
    assert [g.model_dump_json() for g in groups] == before  # nothing half-scored
    assert await student.get_step() == step
    attempts = list((student.run_dir / "trajectories" / "train").glob(f"{step:04d}.*"))
    assert attempts == [], attempts  # nothing written: the caller still holds every group


async def test_what_the_teacher_reads_counts_against_the_judge_budget(two) -> None:
    _, _, backend = two
    model = jm.TrainableModel(name="budgeted", project="distill", budget=jm.Budget(judge_tokens=20))
    await model.register(backend)
    config = jm.TrainConfig(distill=DISTILL)
    first = await model.train(await task_groups(model, groups=1, size=2, max_tokens=6), config=config)
    assert first.metrics["spend_judge_tokens"] == first.metrics["teacher_tokens"] > 20
    groups = await task_groups(model, groups=1, size=2, max_tokens=6)
    with pytest.raises(jm.BudgetExceededError) as e:
        await model.train(groups, config=config)
    assert e.value.budget == "judge_tokens" and await model.get_step() == 1
    assert all(r.teacher_logprobs is None for g in groups for t in g.trajectories for r in t.records())


async def test_live_training_distills_from_the_teacher(two) -> None:
    """Live training's step is a step like any: with `LiveConfig(train=...distill)` its episodes are
    scored by the teacher, trained, and the candidate's history row counts what the teacher read."""
    _, _, backend = two
    model = jm.TrainableModel(name="live-student", project="distill", max_tokens=6)
    await model.register(backend)
    train = jm.TrainConfig(advantages="given", distill=DISTILL)
    config = jm.LiveConfig(
        episodes_per_step=2, settle_s=0.0, train=train, gate=jm.GateConfig(canary_share=0.0)
    )
    await model.live(config)
    client = model.openai_client()
    for i, reward in enumerate((1.0, 1.0)):  # equal rewards: the teacher's signal alone
        with model.episode(f"ep-{i}"):
            await client.chat.completions.create(
                model=model.name,
                messages=[{"role": "user", "content": f"Name a colour ({i})."}],
                max_tokens=6,
            )
        await model.report_outcome(f"ep-{i}", reward)
    for _ in range(600):
        if (status := await model.live_status()).candidate is not None or status.error:
            break
        await asyncio.sleep(0.1)
    assert status.candidate == 1 and status.error is None, status
    (row,) = [r for r in await model.history() if r.get("split") == "train"]
    assert row["train/teacher_sequences"] == 2 and row["train/teacher_tokens"] > 0, row
    await model.live(config.model_copy(update={"enabled": False}))


async def test_the_pipeline_trainer_distills_from_the_teacher(two, tmp_path) -> None:
    """The PipelineTrainer's steps go through the same backend step: rollouts of equal reward train
    on the teacher's signal, and each step's metrics count what the teacher read."""
    _, _, backend = two
    model = jm.TrainableModel(name="pipe-student", project="distill", max_tokens=6)
    await model.register(backend)

    async def rollout(m: jm.TrainableModel, prompt: str) -> jm.Trajectory:
        ask = [{"role": "user", "content": prompt}]
        done = await m.openai_client().chat.completions.create(model=m.name, messages=ask, max_tokens=6)  # pyright: ignore[reportArgumentType]
        return jm.Trajectory(messages_and_choices=[*ask, done.choices[0]], reward=1.0)

    config = jm.PipelineConfig(
        group_size=2,
        groups_per_step=1,
        journal=tmp_path / "journal",
        progress=False,
        train=jm.TrainConfig(tis_cap=2.0, distill=DISTILL),
    )
    prompts = iter(["Name a fruit.", "Name a tree.", "Name a bird."])
    result = await jm.PipelineTrainer(model, rollout, prompts, config).train(1)
    assert result.steps == 1 and result.skipped_steps == 0 and result.zero_variance_groups == 0
    assert await model.get_step() == 1
    (metrics,) = result.history
    assert metrics["teacher_sequences"] == 2 and metrics["teacher_tokens"] > 0, metrics
