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
import re
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
    hi: list[Any] = [{"role": "user", "content": "Hi"}]
    done = await client.chat.completions.create(model=pinned.get_inference_name(0), messages=hi, max_tokens=2)
    assert jm.record_of(done.choices[0]).step == 0  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="@0"):  # the 404 names the step that is served
        await client.chat.completions.create(model=pinned.get_inference_name(5), messages=hi, max_tokens=2)


def test_ARTs_current_names_work_and_the_ones_we_lack_say_what_to_use() -> None:
    """ART 0.5.23 as its docs write it: `run_name`, `lora_config`, `art.local.backend`, `art.TrainSFTConfig`,
    `art.utils.iterate_dataset` as a module; what Journeyman lacks raises a named error at the first touch."""
    from journeyman.art import ArtFeatureNotSupported
    from journeyman.art.local.backend import LocalBackend
    from journeyman.art.utils.iterate_dataset import iterate_dataset as from_module

    assert LocalBackend is art.local.LocalBackend and from_module is iterate_dataset
    model = art.TrainableModel(
        name="agent-001", run_name="agent-001", project="art", lora_config=art.LoRAConfig(rank=4, alpha=8)
    )
    assert (model.run_name, model.lora.r, model.lora.alpha, model.trainable) == ("agent-001", 4, 8, True)
    assert art.TrainableModel(name="agent", project="art").run_name == "agent"  # older ART code omits it
    with pytest.raises(ArtFeatureNotSupported, match=r"run_name=\).*use name=.* instead"):
        art.TrainableModel(name="agent", run_name="agent-002", project="art")
    # through journeyman serve the model goes as the plain config it is (its ART-only fields stay here)
    from journeyman.client.wire import RegisterBody

    assert RegisterBody.of({"model": model}).model.name == "agent-001"

    sft = art.TrainSFTConfig(learning_rate=1e-4, batch_size=4).journeyman()
    assert (sft.learning_rate, sft.batch_size) == (1e-4, 4)
    with pytest.raises(ArtFeatureNotSupported, match="learning_rate"):
        art.TrainSFTConfig(learning_rate=[1e-4, 5e-5]).journeyman()

    for reach in (
        lambda: art.ServerlessBackend,
        lambda: __import__("journeyman.art.serverless.backend"),
        lambda: art.dev.TinkerArgs,
        lambda: art.utils.get_model_step,
        lambda: art.rewards.ruler,
    ):
        with pytest.raises(
            ArtFeatureNotSupported, match=r"^art\.\S+ is not supported by journeyman.art: .* instead"
        ):
            reach()
    with pytest.raises(AttributeError):  # a name ART does not have either stays an AttributeError
        art.no_such_name  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]


async def test_ARTs_trajectory_timing_and_logging_helpers() -> None:
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}], reward=1.0)
    for _ in range(2):
        async with traj.track_duration("llm"):
            await asyncio.sleep(0.01)
    assert traj.finish() is traj and traj.metrics["duration"] >= traj.metrics["llm_duration"] >= 0.02
    logged = json.loads(json.dumps(traj.for_logging()))
    assert logged["reward"] == 1.0 and logged["messages"] == [
        {"role": "user", "content": "Hi", "trainable": False}
    ]


async def test_train_sft_from_file_runs_one_SFT_step_with_ARTs_schedule(
    scripted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journeyman.art import ArtFeatureNotSupported
    from journeyman.art.utils.sft import train_sft_from_file

    model, backend = scripted
    calls: list[tuple[list[jm.Trajectory], jm.SFTConfig]] = []

    async def train_sft(model: Any, trajectories: Any, config: jm.SFTConfig, **_: Any) -> jm.TrainResult:
        calls.append((list(trajectories), config))
        return jm.TrainResult(step=1, metrics={"loss": 0.5})

    monkeypatch.setattr(backend, "train_sft", train_sft)
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in (("2+2?", "4"), ("Capital of France?", "Paris"))
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    await train_sft_from_file(
        model=model, file_path=str(path), epochs=3, batch_size=1, peak_lr=1e-4, schedule_type="cosine"
    )
    [(trajectories, config)] = calls
    assert [t.messages()[-1]["content"] for t in trajectories] == ["4", "Paris"]
    assert (config.epochs, config.batch_size, config.learning_rate, config.lr_schedule) == (
        3,
        1,
        1e-4,
        "cosine",
    )
    with pytest.raises(ArtFeatureNotSupported, match="initial_step"):
        await train_sft_from_file(model=model, file_path=str(path), initial_step=2)


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


# -- the surface of ART's latest release, read from its wheel ------------------------------------------------
#
# `journeyman.art` is checked against what the latest `openpipe-art` release's docs and examples use: the
# wheel is fetched from PyPI (no dependencies; cached under the Journeyman cache) and read with `ast`,
# never imported (its imports pull torch, vLLM, Unsloth; it also needs Python 3.12). Every module path,
# name and keyword argument it uses either works on `journeyman.art` or raises `ArtFeatureNotSupported`,
# which names the ART feature and what to use instead.

ART_RELEASE = "0.5.23"

# What ART's docs site and GitHub examples use beyond the docs shipped in the wheel (its README and skills
# pages, read at run time): `art.X(kw=)` a keyword argument, `module:art.x` a module path. Each must exist in
# the release (so the list cannot drift from it).
_LISTED = """
module:art.local.backend module:art.utils module:art.langgraph module:art.rewards module:art.gather
module:art.trajectories module:art.mcp module:art.utils.s3 module:art.utils.litellm module:art.guided_completion
module:art.utils.benchmarking.load_trajectories module:art.utils.benchmarking.charts
art.local.backend.LocalBackend art.local.backend.LocalBackend(path=) art.local.backend.LocalBackend(in_process=)
art.TrainableModel(run_name=) art.TrainableModel(name=) art.TrainableModel(project=)
art.TrainableModel(base_model=) art.TrainableModel(config=) art.TrainableModel(_internal_config=)
art.TrainableModel.openai_client art.TrainableModel.get_inference_name art.TrainableModel.name
art.TrainableModel.inference_base_url art.TrainableModel.inference_api_key art.TrainableModel.trainable
art.Model art.Model(name=) art.Model(project=) art.Model(config=) art.Model(inference_api_key=)
art.Model(inference_base_url=) art.Model(inference_model_name=) art.Model.register
art.Trajectory(messages_and_choices=) art.Trajectory(reward=) art.Trajectory(metrics=) art.Trajectory(metadata=)
art.Trajectory.messages art.Trajectory.messages_and_choices art.Trajectory.reward art.Trajectory.metrics
art.Trajectory.metadata art.Trajectory.tools art.Trajectory.logs art.Trajectory.finish
art.Trajectory.for_logging art.Trajectory.track_duration art.trajectories.TrajectoryGroup
art.TrajectoryGroup(metadata=) art.TrainConfig(learning_rate=) art.Messages art.MessagesAndChoices art.Tools
art.gather_trajectories(pbar_desc=) art.gather_trajectories(max_exceptions=) art.trajectory_group_batches
art.gather_trajectory_groups(pbar_desc=) art.gather_trajectory_groups(max_exceptions=)
art.gather_trajectory_groups(after_each=) art.gather.GatherContext art.gather.set_gather_context
art.gather.wrap_group_awaitable art.retry art.utils.iterate_dataset(groups_per_step=)
art.utils.iterate_dataset(num_epochs=) art.utils.iterate_dataset(initial_step=) art.utils.iterate_dataset(use_tqdm=)
art.utils.limit_concurrency(derive_key=) art.langgraph.wrap_rollout art.langgraph.init_chat_model
art.rewards.ruler_score_group(judge_model=) art.rewards.ruler_score_group(extra_litellm_params=)
art.rewards.ruler_score_group(swallow_exceptions=) art.rewards.ruler_score_group(debug=)
art.local.LocalBackend.train(learning_rate=) art.local.LocalBackend.close
art.local.LocalBackend._experimental_push_to_s3(s3_bucket=) art.local.LocalBackend._experimental_pull_from_s3(s3_bucket=)
art.local.LocalBackend._experimental_pull_from_s3(verbose=) art.utils.s3.pull_model_from_s3
art.dev.InternalModelConfig(init_args=) art.dev.InternalModelConfig(engine_args=)
art.dev.InternalModelConfig(trainer_args=) art.dev.InitArgs(max_seq_length=) art.dev.InitArgs(gpu_memory_utilization=)
art.dev.EngineArgs(gpu_memory_utilization=) art.dev.EngineArgs(enforce_eager=) art.dev.PeftArgs(lora_alpha=)
art.dev.TrainerArgs(max_grad_norm=) art.ServerlessBackend art.TrainableModel.train_sft
art.mcp.MCPTool art.mcp.MCPResource art.mcp.generate_scenarios art.utils.litellm.convert_litellm_choice_to_openai
art.guided_completion.get_guided_completion_params
art.utils.benchmarking.load_trajectories.load_trajectories art.utils.benchmarking.charts.percentage_comparison_bar_chart
art.utils.benchmarking.charts.training_progress_chart
"""
ART_DOCS_AND_EXAMPLES = _LISTED.split()

# ART's public modules whose `__all__` is part of the surface: `art` and those its docs import from.
ART_PUBLIC_MODULES = (
    "art",
    "art.dev",
    "art.langgraph",
    "art.local",
    "art.mcp",
    "art.rewards",
    "art.serverless",
    "art.utils",
)

# Variables ART's docs call methods on without showing where they came from.
DOC_VARIABLES = {"model": "art.TrainableModel", "backend": "art.local.LocalBackend"}


def art_wheel() -> Path:
    """The release's wheel, fetched from PyPI once (its sha256 checked) and kept in the Journeyman cache."""
    import hashlib

    import httpx
    from journeyman.data.paths import cache_dir

    wheel = cache_dir() / "art" / f"openpipe_art-{ART_RELEASE}-py3-none-any.whl"
    if wheel.is_file():
        return wheel
    try:
        index = httpx.get(  # PyPI's simple API (PEP 691), as pip reads it
            "https://pypi.org/simple/openpipe-art/",
            headers={"Accept": "application/vnd.pypi.simple.v1+json"},
            timeout=30,
        ).json()
        [file] = [f for f in index["files"] if f["filename"] == wheel.name]
        data = httpx.get(file["url"], timeout=120, follow_redirects=True).content
    except httpx.TransportError as e:
        pytest.skip(f"PyPI unreachable, no cached {wheel.name}: {e}")
    assert hashlib.sha256(data).hexdigest() == file["hashes"]["sha256"]
    wheel.parent.mkdir(parents=True, exist_ok=True)
    part = wheel.with_suffix(".part")
    part.write_bytes(data)
    part.replace(wheel)
    return wheel


def parse_use(text: str) -> tuple[str, str, str]:
    """`module:art.x` -> ("module", "art.x", ""); `art.X(kw=)` -> ("keyword", "art.X", "kw"); else a name."""
    if text.startswith("module:"):
        return ("module", text.removeprefix("module:"), "")
    if text.endswith("=)"):
        name, _, kw = text[:-2].partition("(")
        return ("keyword", name, kw)
    return ("name", text, "")


def show_use(use: tuple[str, str, str]) -> str:
    kind, name, kw = use
    return f"{name}({kw}=)" if kind == "keyword" else f"module:{name}" if kind == "module" else name


def code_uses(source: str) -> set[tuple[str, str, str]]:
    """The ART modules, names and keyword arguments a piece of ART code uses (`import art` assumed)."""
    import ast
    import textwrap

    source = re.sub(r"<[A-Z_]+>", "_", textwrap.dedent(source))  # the skills pages' placeholders
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = ast.parse("if True:\n" + source)  # a snippet cut from inside a function
    alias, found = {"art": "art"}, set[tuple[str, str, str]]()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in (a for a in node.names if a.name.split(".")[0] == "art"):
                found.add(("module", a.name, ""))
                alias[a.asname or "art"] = a.name if a.asname else "art"
        elif (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "art" and not node.level
        ):
            found.add(("module", str(node.module), ""))
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                found.add(("name", f"{node.module}.{a.name}", ""))
    typed = dict(DOC_VARIABLES)

    def dotted(e: ast.expr) -> str | None:
        if isinstance(e, ast.Name):
            return alias.get(e.id) or typed.get(e.id)
        if isinstance(e, ast.Attribute):
            d = dotted(e.value)
            return d and f"{d}.{e.attr}"
        return None

    for node in ast.walk(tree):  # `x = art.Class(...)`: `x.method(...)` later is that class's method
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1:
            target, called = node.targets[0], dotted(node.value.func)
            if isinstance(target, ast.Name) and called and called.rsplit(".", 1)[-1][:1].isupper():
                typed[target.id] = called
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (d := dotted(node)):
            found.add(("name", d, ""))
        elif isinstance(node, ast.Call) and (d := dotted(node.func)):
            found.add(("name", d, ""))
            found |= {("keyword", d, k.arg) for k in node.keywords if k.arg}
    return found


class ArtRelease:
    """The release's `art` package read with `ast`: its modules, what each defines, classes' members,
    callables' keyword arguments."""

    def __init__(self, wheel: Path) -> None:
        import zipfile

        self.zip = zipfile.ZipFile(wheel)
        self.modules: dict[str, str] = {}
        for n in self.zip.namelist():
            if n.startswith("art/") and n.endswith(".py"):
                parts = n.removesuffix(".py").split("/")
                self.modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = n
        self.trees: dict[str, Any] = {}

    def docs(self) -> list[str]:
        """The docs shipped in the wheel: the README (its METADATA) and the skills pages."""
        names = sorted(n for n in self.zip.namelist() if n.endswith(("dist-info/METADATA", ".md")))
        return [self.zip.read(n).decode() for n in names]

    def tree(self, module: str) -> Any:
        import ast

        if module not in self.trees:
            source = self.zip.read(self.modules[module]).decode()
            # ART needs Python 3.12: its 3.12-only syntax (`type X = ...`, `def f[T](...)`) made 3.11's
            source = re.sub(r"^(\s*)type (\w+)(?:\[[^\]=]*\])? =", r"\1\2 =", source, flags=re.M)
            source = re.sub(r"\b(def|class) (\w+)\[[^\]]*\]\(", r"\1 \2(", source)
            self.trees[module] = ast.parse(source)
        return self.trees[module]

    def exported(self, module: str) -> list[str]:
        """A module's `__all__`."""
        import ast

        for node in self.tree(module).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                return list(ast.literal_eval(node.value))
        return []

    def absolute(self, module: str, node: Any) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.modules[module].endswith("__init__.py") else module.rsplit(".", 1)[0]
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        return f"{base}.{node.module}" if node.module else base

    def definition(self, module: str, name: str, depth: int = 0) -> tuple[str, Any] | None:
        """Where `module.name` is defined, following re-exports; a submodule is `(its name, None)`."""
        import ast

        for node in self.tree(module).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, node
            if isinstance(node, ast.ImportFrom):
                for a in (a for a in node.names if (a.asname or a.name) == name):
                    src = self.absolute(module, node)
                    if src in self.modules and depth < 8 and (d := self.definition(src, a.name, depth + 1)):
                        return d
                    return (f"{src}.{a.name}", None) if f"{src}.{a.name}" in self.modules else None
        return (f"{module}.{name}", None) if f"{module}.{name}" in self.modules else None

    def member(self, module: str, cls: Any, name: str, depth: int = 0) -> tuple[str, Any] | None:
        """A method or field of a class, or of one of its bases."""
        import ast

        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return module, node
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                return module, node
        for where, base in self.bases(module, cls) if depth < 8 else []:
            if found := self.member(where, base, name, depth + 1):
                return found
        return None

    def bases(self, module: str, cls: Any) -> list[tuple[str, Any]]:
        import ast

        out = []
        for b in cls.bases:
            b = b.value if isinstance(b, ast.Subscript) else b
            if (
                isinstance(b, ast.Name)
                and (d := self.definition(module, b.id))
                and isinstance(d[1], ast.ClassDef)
            ):
                out.append(d)
        return out

    def resolve(self, name: str, callable: bool = False) -> tuple[str, Any] | None:
        """The definition of a dotted ART name: `(module, None)` for a module, else `(module, node)`.
        Tried from each module the name starts with, longest first (`art.utils.iterate_dataset` is
        both a module and, re-exported, a function: `callable` picks the function)."""
        import ast

        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) not in self.modules:
                continue
            found: tuple[str, Any] | None = (".".join(parts[:i]), None)
            for attr in parts[i:]:
                where, node = found
                if node is None:
                    found = self.definition(where, attr)
                elif isinstance(node, ast.ClassDef):
                    found = self.member(where, node, attr)
                else:
                    found = None
                if found is None:
                    break
            if found is not None and not (callable and found[1] is None):
                return found
        return None

    def takes(self, name: str, keyword: str) -> bool:
        """Whether the callable `name` takes `keyword` (a parameter, or a field of a model or TypedDict)."""
        import ast

        found = self.resolve(name, callable=True)
        if found is None:
            return False
        module, node = found
        if isinstance(node, ast.ClassDef):
            init = self.member(module, node, "__init__")
            if init is None:
                fields, stack = set[str](), [(module, node)]
                while stack:
                    m, c = stack.pop()
                    fields |= {
                        s.target.id
                        for s in c.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    }
                    stack += self.bases(m, c)
                return keyword in fields
            node = init[1]
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return False
        a = node.args
        return keyword in {x.arg for x in [*a.args, *a.kwonlyargs]} or (
            a.kwarg is not None and not (a.kwarg.annotation and ast.unparse(a.kwarg.annotation) == "Never")
        )

    def has(self, use: tuple[str, str, str]) -> bool:
        kind, name, kw = use
        if kind == "module":  # a package without `__init__.py` too
            return name in self.modules or any(m.startswith(f"{name}.") for m in self.modules)
        if kind == "keyword":
            return self.takes(name, kw)
        return self.resolve(name) is not None


def ours(name: str, callable: bool = False) -> Any:
    """`art.x.Y.z` on `journeyman.art`, reached as ART code reaches it: the longest module path the name
    starts with (`art.utils.iterate_dataset` is a module and a function: `callable` picks the function),
    then attributes. Raises what `journeyman.art` raises (ArtFeatureNotSupported for what it refuses)."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module("journeyman." + ".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if isinstance(obj, type) and issubclass(obj, BaseModel) and attr in obj.model_fields:
                obj = obj.model_fields[attr]
            else:
                obj = getattr(obj, attr)
        if not (callable and isinstance(obj, type(importlib))):
            return obj
    raise ModuleNotFoundError(name)


def keywords_of(obj: Any) -> set[str]:
    """The keyword arguments `obj` takes by name: parameters, a model's fields, a TypedDict's keys, and
    what a callable declares it takes through `**kwargs` (`art_keywords`, e.g. ART's train settings)."""
    import inspect

    if isinstance(obj, type) and issubclass(obj, BaseModel):
        fields = set(obj.model_fields) | {f.alias for f in obj.model_fields.values() if f.alias}
        params = inspect.signature(obj.__init__).parameters.values()
        return fields | {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    if isinstance(obj, type) and hasattr(obj, "__required_keys__"):  # a TypedDict
        return set(obj.__annotations__)
    params = inspect.signature(obj).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named | set(getattr(obj, "art_keywords", ()))


def on_journeyman(use: tuple[str, str, str]) -> str:
    """How `journeyman.art` answers one use: works, refused (ArtFeatureNotSupported naming the ART
    feature and what to use instead), or missing (anything else)."""
    import importlib
    import inspect

    from journeyman.art import ArtFeatureNotSupported

    kind, name, kw = use
    try:
        if kind == "module":
            importlib.import_module(f"journeyman.{name}")
            return "works"
        obj = ours(name, callable=kind == "keyword")
        if kind == "name":
            return "works"
        if kw in keywords_of(obj):
            return "works"
        out = obj(**{kw: None})  # what refuses a keyword refuses it before doing anything else
        if inspect.iscoroutine(out):
            out.close()
        return "missing"
    except ArtFeatureNotSupported as e:
        # the error names the use, or the ART feature it belongs to (`art.mcp` for `art.mcp.MCPTool`)
        parts = name.split(".")
        named = [show_use(use), *(".".join(parts[:i]) for i in range(len(parts), 1, -1))]
        return (
            "refused"
            if any(f"{n} is not supported" in str(e) for n in named) and "instead" in str(e)
            else "missing"
        )
    except Exception:
        return "missing"


def test_the_latest_ART_releases_surface_works_or_is_refused_by_name() -> None:
    """Every module path, name and keyword argument the latest ART release's docs and examples use:
    each one works on `journeyman.art` or raises ArtFeatureNotSupported naming it and what to use."""
    release = ArtRelease(art_wheel())
    shipped = {
        u
        for doc in release.docs()
        for block in re.findall(r"```python\n(.*?)```", doc, re.S)
        for u in code_uses(block)
    }
    listed = {parse_use(t) for t in ART_DOCS_AND_EXAMPLES}
    assert len(shipped) > 40 and ("keyword", "art.TrainableModel", "run_name") in shipped
    not_in_release = sorted(show_use(u) for u in listed if not release.has(u))
    assert not not_in_release, f"not in openpipe-art {ART_RELEASE}: {not_in_release}"
    from journeyman.art._unsupported import NOT_SUPPORTED

    refused = {parse_use(n) for n in NOT_SUPPORTED}  # each refusal names something ART has
    not_art = [show_use(u) for u in refused if not (release.has(u) or release.has(("module", u[1], "")))]
    assert not not_art, f"refused but not in openpipe-art {ART_RELEASE}: {not_art}"
    exported = {("name", f"{m}.{n}", "") for m in ART_PUBLIC_MODULES for n in release.exported(m)}
    surface = {u for u in shipped | listed | exported if release.has(u)}
    missing = sorted(show_use(u) for u in surface if on_journeyman(u) == "missing")
    assert not missing, (
        f"{len(missing)} of {len(surface)} ART names neither work nor raise a named error: {missing}"
    )
