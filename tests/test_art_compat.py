"""Code written in ART's idiom runs on Journeyman with one import changed: `import journeyman.art as art`.

The rollouts, the training loop, RULER, LangGraph and the helpers below are written as an ART user
writes them (our own code, in ART's call shapes). The cheap ones run on the scripted backend; one
test trains the embedded model for a step, logs it, pushes the run to an S3-compatible server
started here (moto, on 127.0.0.1), pulls it into a fresh backend and resumes from the copy.
"""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import journeyman as jm
import journeyman.art as art
import openai
import pytest
from _support import RuleJudge, one_node_graph
from journeyman.art.langgraph import init_chat_model, wrap_rollout
from journeyman.art.rewards import ruler_score_group
from journeyman.art.utils import iterate_dataset, limit_concurrency
from pydantic import BaseModel

SCENARIOS = ["What is the capital of France?", "Name a colour.", "Say hi.", "Count to two."]


async def rollout(model: art.Model, scenario: str, k: int = 0) -> art.Trajectory:
    """An ART-style rollout: any `art.Model` (trainable or prompted) behind an OpenAI client."""
    client = model.openai_client()
    messages: list[Any] = [{"role": "user", "content": scenario}]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=6, seed=k
    )
    choice = completion.choices[0]
    return art.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=float(k),
        metrics={"chars": len(choice.message.content or "")},
    )


# -- helpers -------------------------------------------------------------------------------------------


def test_iterate_dataset_gives_ARTs_batches_and_resumes() -> None:
    batches = list(iterate_dataset(SCENARIOS, groups_per_step=3, num_epochs=2, use_tqdm=False))
    assert [(b.step, b.epoch, b.epoch_step, len(b.items)) for b in batches] == [
        (0, 0, 0, 3),
        (1, 0, 1, 1),
        (2, 1, 0, 3),
        (3, 1, 1, 1),
    ]
    assert sorted(batches[0].items + batches[1].items) == sorted(SCENARIOS)  # an epoch sees each once
    _, epoch, step, _ = batches[2]  # ART's older tuple form unpacks too
    assert (epoch, step) == (1, 2)
    resumed = list(
        iterate_dataset(SCENARIOS, groups_per_step=3, num_epochs=2, initial_step=2, use_tqdm=False)
    )
    assert resumed == batches[2:]


async def test_retry_and_limit_concurrency() -> None:
    calls: list[int] = []

    @art.retry(max_attempts=3, delay=0.0)
    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("try again")
        return "ok"

    assert await flaky() == "ok" and len(calls) == 3

    running, peak = 0, 0

    @limit_concurrency(2)
    async def work() -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1

    await asyncio.gather(*(work() for _ in range(6)))
    assert peak == 2


# -- models and settings ---------------------------------------------------------------------------------


def test_internal_config_is_translated_and_the_rest_warned_about_once() -> None:
    class RunConfig(BaseModel):  # the user's own settings, as ART examples keep them on the model
        groups_per_step: int = 2

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = art.TrainableModel(
            name="artcfg",
            project="art",
            base_model=jm.DEFAULT_BASE_MODEL,
            config=RunConfig(),
            _internal_config=art.dev.InternalModelConfig(
                peft_args={"r": 4, "lora_alpha": 8},
                trainer_args={"max_grad_norm": 0.5},
                engine_args={"gpu_memory_utilization": 0.6},
            ),
        )
        art.TrainableModel(
            name="again", project="art", _internal_config={"engine_args": {"gpu_memory_utilization": 0.6}}
        )
    assert (model.lora.r, model.lora.alpha) == (4, 8)
    assert model.config.groups_per_step == 2
    gpu = [str(w.message) for w in seen if "gpu_memory_utilization" in str(w.message)]
    assert len(gpu) == 1 and "not applied" in gpu[0]  # named, once per process

    cfg = model.train_config(None, {"epsilon": 0.1, "verbose": True})
    assert (cfg.learning_rate, cfg.eps, cfg.max_grad_norm) == (5e-6, 0.1, 0.5)  # ART's learning rate
    assert model.train_config(art.TrainConfig(learning_rate=1e-5, beta=0.1), {}).kl_coef == 0.1
    with pytest.raises(TypeError, match="learning_rat"):
        model.train_config(None, {"learning_rat": 1e-5})
    with pytest.raises(ValueError, match="inference_url"):
        art.TrainableModel(name="x", project="art", inference_url="http://x")  # type: ignore[call-arg]
    with pytest.warns(UserWarning, match="plot_tensors"):
        model.train_config(None, {"plot_tensors": True})


def _base_model(model: Any) -> art.Model:
    """ART's comparison model: `art.Model` asking `model`'s endpoint for the base model by its name."""
    return art.Model(
        name="base",
        project="art",
        inference_base_url=model.inference_base_url,
        inference_api_key=model.inference_api_key,
        inference_model_name=model.base_model,
    )


async def test_a_prompted_model_asks_the_base_model_by_its_name(scripted: Any) -> None:
    """ART's comparison model: `art.Model` with `inference_model_name` set to the base model, which the
    endpoint serves under that name (a validator asking for it no longer gets a 404)."""
    model, backend = scripted
    base = _base_model(model)
    traj = await rollout(base, "Hi")
    assert backend.engine(model).requests[-1][1].base
    assert isinstance(art.TrainableModel(name="t", project="art"), art.Model)  # as in ART
    assert jm.record_of(traj.messages_and_choices[-1]).step == 0  # type: ignore[union-attr, arg-type]

    # ART's `get_inference_name(step)`: `name@step` is served while that step is; the bare name always
    # names the latest step
    pinned = base.model_copy(update={"inference_model_name": model.name})
    assert pinned.get_inference_name() == model.name and pinned.get_inference_name(0) == f"{model.name}@0"
    client = pinned.openai_client()
    hi = [{"role": "user", "content": "Hi"}]
    done = await client.chat.completions.create(model=pinned.get_inference_name(0), messages=hi, max_tokens=2)
    assert jm.record_of(done.choices[0]).step == 0  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="@0"):  # the 404 names the step that is served
        await client.chat.completions.create(model=pinned.get_inference_name(5), messages=hi, max_tokens=2)


# -- RULER and LangGraph ---------------------------------------------------------------------------------


rule_judge = RuleJudge.module_fixture("rule_judge")


def answers(*texts: str) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": t},
            ]
        )
        for t in texts
    )


async def test_ruler_with_ARTs_arguments(
    rule_judge: RuleJudge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOURNEYMAN_CACHE", str(tmp_path))
    litellm = {"api_base": rule_judge.base_url, "api_key": "unused"}
    scored = await ruler_score_group(
        answers("Paris.", "Lyon."), "openai/rule", extra_litellm_params=litellm, debug=True
    )
    assert scored is not None and [t.reward for t in scored] == [1.0, 0.2]
    assert rule_judge.requests[-1]["model"] == "rule"

    # swallow_exceptions: a failed judge gives None, and gather's after_each drops that group (ART's semantics)
    rule_judge.plan = ["prose", "prose"]

    async def judged(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        return await ruler_score_group(group, "openai/rule", litellm, swallow_exceptions=True)

    kept = await art.gather_trajectory_groups([answers("Rome.", "Oslo.")], pbar_desc=None, after_each=judged)
    assert kept == []


async def test_wrap_rollout_records_a_langgraph_graph(scripted: Any) -> None:
    from langgraph.graph import MessagesState

    model, backend = scripted
    backend.engine(model).script = ["Paris.", "Lyon."]

    async def graph_rollout(scenario: str) -> art.Trajectory:
        llm = init_chat_model(model.name, max_tokens=4)

        async def answer(state: MessagesState) -> dict[str, Any]:
            return {"messages": [await llm.ainvoke(state["messages"])]}

        out = await one_node_graph(answer, "answer").ainvoke({"messages": [("user", scenario)]})  # pyright: ignore[reportArgumentType]
        said = str(out["messages"][-1].content)
        return art.Trajectory(messages_and_choices=[], reward=1.0 if "Paris" in said else 0.0)

    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(wrap_rollout(model, graph_rollout)(s) for _ in range(2)) for s in SCENARIOS[:2]),
        pbar_desc=None,
    )
    assert [len(g) for g in groups] == [2, 2]
    for t in (t for g in groups for t in g):
        assert len(t.records()) == 1  # the exact tokens of the graph's policy call
        assert t.messages()[0]["content"] in SCENARIOS
    with pytest.raises(ValueError, match="model_name"):
        init_chat_model("another-model")  # outside a wrapped rollout


# -- the training loop on the embedded model, and the run through object storage ---------------------------


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An S3-compatible server (moto) on 127.0.0.1 with an empty bucket; the AWS settings point at it."""
    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for k, v in {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    boto3.client("s3").create_bucket(Bucket="art-runs")
    yield "art-runs"
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def test_a_run_directory_goes_to_s3_and_back_and_to_a_path(tmp_path: Path, s3: str) -> None:
    """`push_dir`/`pull_dir` (under `push_run`/`pull_run`), without a model: same files, same bytes;
    `delete` mirrors; a URL with nothing stored is a CheckpointError naming it."""
    from journeyman.data.object_store import pull_dir, push_dir
    from journeyman.errors import CheckpointError

    run = tmp_path / "run"
    (run / "checkpoints" / "0001").mkdir(parents=True)
    (run / "checkpoints" / "0001" / "adapter.bin").write_bytes(bytes(range(256)) * 64)
    (run / "history.jsonl").write_text('{"step": 0}\n')
    for url in (f"s3://{s3}/exp/p/models/m", str(tmp_path / "mirror")):
        assert push_dir(run, url) == 2
        back = tmp_path / f"back-{len(url)}"
        (back / "stale.txt").parent.mkdir(parents=True)
        (back / "stale.txt").write_text("old")
        assert pull_dir(url, back, delete=True) == 2
        files = sorted(p.relative_to(back).as_posix() for p in back.rglob("*") if p.is_file())
        assert files == ["checkpoints/0001/adapter.bin", "history.jsonl"]
        assert (back / "checkpoints" / "0001" / "adapter.bin").read_bytes() == bytes(range(256)) * 64
    with pytest.raises(CheckpointError, match="nothing stored"):
        pull_dir(f"s3://{s3}/never-pushed", tmp_path / "none")


@pytest.mark.slow
async def test_an_ART_training_loop_trains_logs_and_resumes_from_object_storage(
    tmp_path: Path, s3: str
) -> None:
    with art.local.LocalBackend(path=tmp_path / "a") as backend:
        model = art.TrainableModel(name="agent", project="art", base_model=jm.DEFAULT_BASE_MODEL)
        await model.register(backend)
        batch = next(
            iterate_dataset(
                SCENARIOS[:2], groups_per_step=2, initial_step=await model.get_step(), use_tqdm=False
            )
        )
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, s, k) for k in range(2)) for s in batch.items),  # pyright: ignore[reportArgumentType]  # a TrainableModel is an art.Model
            pbar_desc=None,
        )
        result = await backend.train(model, groups, learning_rate=1e-4)
        await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        assert (
            result.step == 1 and result.checkpoint_path is not None and Path(result.checkpoint_path).is_dir()
        )

        base = _base_model(model)
        val = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(base, SCENARIOS[0], k) for k in range(2))], pbar_desc=None
        )
        await model.log(val, split="val", step=await model.get_step())
        history = await model.history()
        assert [r["split"] for r in history] == [
            "train",
            "val",
        ]  # log(split="train") after train: no second row
        assert history[0]["train/reward"] == 0.5 and "val/reward" in history[1]

        await backend._experimental_push_to_s3(model, s3_bucket=s3, prefix="exp")
        pushed = sorted(
            p.relative_to(model.run_dir).as_posix() for p in model.run_dir.rglob("*") if p.is_file()
        )

    fresh = art.local.LocalBackend(path=tmp_path / "b")
    try:
        again = art.TrainableModel(name="agent", project="art", base_model=jm.DEFAULT_BASE_MODEL)
        await fresh._experimental_pull_from_s3(again, s3_bucket=s3, prefix="exp")
        run = fresh.run_dir(again)
        assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == pushed
        await again.register(fresh)
        assert await again.get_step() == 1  # resumed from the pulled checkpoint
        assert [r["split"] for r in await again.history()] == ["train", "val"]
        traj = await rollout(again, SCENARIOS[1])  # pyright: ignore[reportArgumentType]  # a TrainableModel is an art.Model
        assert jm.record_of(traj.messages_and_choices[-1]).step == 1  # type: ignore[union-attr, arg-type]
    finally:
        await fresh.close()
    assert json.loads((tmp_path / "b" / "art" / "models" / "agent" / "state.json").read_text())["step"] == 1
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
