"""The Backend contract, one suite for every backend: `LocalBackend` in this process and
`RemoteBackend` talking to `journeyman serve` in a child process, through public API only.

Each backend runs one short run once per module (`run`): register, a captured request whose two
samples make the group every step trains on, a step, its retry under the same idempotency key, an
evaluation logged, another step, two prunes.
The tests each check one promise of that run, so a failure names the promise broken.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from journeyman.chat.formats import ChatFormat
from openai.types.chat import ChatCompletion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPT = [{"role": "user", "content": "Name one colour."}]


@dataclass
class Run:
    """What one backend did in the module's run, for the tests to check."""

    backend: Any
    model: jm.TrainableModel
    step_at_start: int = -1
    response: ChatCompletion | None = None
    captured: list[jm.CapturedCall] = field(default_factory=list)
    groups: list[jm.TrajectoryGroup] = field(default_factory=list)
    first: jm.TrainResult | None = None
    step_after_first: int = -1
    retried: jm.TrainResult | None = None
    step_after_retry: int = -1
    train_rows_after_retry: int = -1
    logged: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    kept_best: list[int] = field(default_factory=list)
    kept_latest: list[int] = field(default_factory=list)


async def _run(backend: Any, name: str) -> Run:
    model = jm.TrainableModel(name=name, project="contract")
    await model.register(backend)
    await model.register(backend)  # again: a no-op
    run = Run(backend, model, step_at_start=await model.get_step())
    async with model.capture() as cap:  # one request, two samples: the group every step trains on
        run.response = await model.openai_client().chat.completions.create(
            model=model.name, messages=PROMPT, n=2, seed=5, max_tokens=6
        )
    run.captured = cap.calls
    run.groups = [
        jm.TrajectoryGroup(
            jm.Trajectory(messages_and_choices=[*PROMPT, c], reward=float(i))  # rewards apart: a step trains
            for i, c in enumerate(run.response.choices)
        )
    ]
    config = jm.TrainConfig(learning_rate=1e-3)
    run.first = await model.train(run.groups, config=config, idempotency_key="contract-step-0")
    run.step_after_first = await model.get_step()
    run.retried = await model.train(run.groups, config=config, idempotency_key="contract-step-0")
    run.step_after_retry = await model.get_step()
    run.train_rows_after_retry = sum(h["split"] == "train" for h in await model.history())
    run.logged = await model.log(run.groups, split="val")  # at step 1: the best (the only) val/reward
    await model.train(run.groups, config=config)
    run.history = await model.history()
    run.kept_best = await model.delete_checkpoints("val/reward")  # 1 is the best, 2 the latest
    run.kept_latest = await model.delete_checkpoints("no/such_metric")  # no best: the latest alone
    return run


@pytest.fixture(scope="module", params=["local", "remote"])
async def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Run]:
    if request.param == "local":
        backend: Any = jm.LocalBackend(path=tmp_path_factory.mktemp("contract-local"))
    else:
        server = request.getfixturevalue("remote_server")
        backend = jm.RemoteBackend(server.url, token=server.token, progress=False)
    try:
        yield await _run(backend, f"contract-{request.param}")
    finally:
        backend.close()


def test_a_registered_model_is_served_at_step_0(run: Run) -> None:
    assert run.step_at_start == 0


def test_inference_names_the_endpoint_key_and_model(run: Run) -> None:
    info = run.backend.inference(run.model.name)
    assert isinstance(info, jm.Inference) and info.model == run.model.name
    assert info.base_url.startswith("http") and info.base_url.endswith("/v1") and info.api_key
    assert run.model.inference() == info


async def test_the_openai_client_lists_the_model(run: Run) -> None:
    listed = await run.model.openai_client().models.list()
    assert run.model.name in [m.id for m in listed.data]


def test_a_rollout_records_the_exact_prompt_and_sampled_ids(run: Run, chat_format: ChatFormat) -> None:
    assert run.response is not None
    choice = run.response.choices[0]
    record = jm.record_of(choice)
    assert record.prompt_token_ids == chat_format.prompt_ids(PROMPT)[0]  # the template, rendered once
    assert chat_format.parse(chat_format.completion_text(record.token_ids)).content == choice.message.content
    assert len(record.logprobs) == len(record.token_ids) and all(lp <= 0 for lp in record.logprobs)
    assert record.step == 0


def test_a_captured_call_holds_the_response_and_its_record(run: Run) -> None:
    assert run.response is not None
    (call,) = run.captured
    assert call.request_messages == PROMPT
    records = [jm.record_of(c).model_dump() for c in run.response.choices]
    assert [c["journeyman"] for c in call.response["choices"]] == records


def test_train_returns_the_new_step_and_serves_it(run: Run) -> None:
    assert run.first is not None and run.first.step == 1 and not run.first.skipped
    assert run.first.metrics  # the step's numbers come back with it
    assert run.step_after_first == 1


def test_a_retried_idempotency_key_returns_the_result_without_training_again(run: Run) -> None:
    assert run.retried == run.first
    assert run.step_after_retry == 1 and run.train_rows_after_retry == 1


def test_log_returns_the_groups_metrics(run: Run) -> None:
    assert run.logged["reward"] == pytest.approx(0.5) and run.logged["trajectories"] == 2


def test_history_lists_every_step_and_evaluation_in_order(run: Run) -> None:
    rows = [(h["split"], h["step"]) for h in run.history]
    assert rows == [("train", 0), ("val", 1), ("train", 1)]
    assert run.history[1]["val/reward"] == pytest.approx(0.5)


def test_delete_checkpoints_keeps_the_best_and_the_latest(run: Run) -> None:
    assert run.kept_best == []  # step 1 has the best val/reward, step 2 is the latest
    assert run.kept_latest == [1]  # by a metric never logged, only the latest is kept


async def test_the_latest_step_is_served_after_pruning(run: Run) -> None:
    assert await run.model.get_step() == 2


async def test_an_unknown_model_is_an_unknown_model_error(run: Run) -> None:
    stranger = jm.TrainableModel(name="never-registered", project="contract")
    with pytest.raises(jm.UnknownModelError) as e:
        await run.backend.get_step(stranger)
    assert e.value.name == "never-registered"


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda m, groups: m.serve_step(1), "step"),  # pruned
        (lambda m, groups: m.log(groups, split="train"), "split"),  # holds what trained
        (lambda m, groups: m.train([]), "groups"),
    ],
    ids=["deleted-step", "training-split", "no-groups"],
)
async def test_a_bad_value_is_an_invalid_field_error_naming_the_field(
    run: Run, call: Any, field: str
) -> None:
    with pytest.raises(jm.InvalidFieldError) as e:
        await call(run.model, run.groups)
    assert e.value.field == field


async def test_a_step_with_nothing_to_learn_says_why_or_is_refused(run: Run) -> None:
    assert run.response is not None
    flat = [  # both samples equally good: GRPO has no difference to learn from
        jm.TrajectoryGroup(
            jm.Trajectory(messages_and_choices=[*PROMPT, c], reward=1.0) for c in run.response.choices
        )
    ]
    step = await run.model.get_step()
    skipped = await run.model.train(flat)
    assert skipped.skipped and skipped.step == step and skipped.skip_reason is not None
    assert skipped.skip_reason.startswith("in each of the 1 groups the rewards are all equal")
    with pytest.raises(jm.NoLearningSignalError) as e:
        await run.model.train(flat, config=jm.TrainConfig(on_no_signal="error"))
    assert e.value.field == "groups" and "on_no_signal='error'" in str(e.value)
    assert await run.model.get_step() == step


_UNCLOSED = """
import asyncio, signal, sys
import journeyman as jm

# Ctrl-C as a terminal delivers it: a suite started in the background by a non-interactive shell
# (CI) hands its children SIGINT ignored, and the interrupted child then never hears it.
signal.signal(signal.SIGINT, signal.default_int_handler)

async def main() -> None:
    backend = jm.LocalBackend(path=sys.argv[1])  # never closed
    model = jm.TrainableModel(name="unclosed", project="exit")
    await model.register(backend)
    ask = [{"role": "user", "content": "Tell a long story."}]
    stream = await model.openai_client().chat.completions.create(
        model=model.name, messages=ask, max_tokens=1000, temperature=1.0, stream=True
    )
    async for _ in stream:  # the engine is decoding now, with ~1,000 tokens to go
        print("decoding", flush=True)
        if sys.argv[2] == "raise":
            raise RuntimeError("the program failed")
        await asyncio.sleep(600)  # until Ctrl-C

asyncio.run(main())
"""


def test_a_program_that_never_closes_its_backend_exits_cleanly(tmp_path: Path) -> None:
    """However it ends (an exception, Ctrl-C) with the engine mid-request and the backend never
    closed, the process exits with its own status: no native abort ("terminate called without an
    active exception", status 134) from the engine's thread still in torch as the interpreter exits."""
    script = tmp_path / "unclosed.py"
    script.write_text(_UNCLOSED)
    procs = {
        how: subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / how), how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for how in ("raise", "interrupt")
    }
    interrupted = procs["interrupt"]
    assert interrupted.stdout is not None and interrupted.stdout.readline() == "decoding\n"
    interrupted.send_signal(signal.SIGINT)
    ends = {how: p.communicate(timeout=300) for how, p in procs.items()}
    for how, (_, err) in ends.items():
        assert "terminate called" not in err, (how, err[-2000:])
    assert procs["raise"].returncode == 1 and "RuntimeError: the program failed" in ends["raise"][1]
    assert interrupted.returncode == -signal.SIGINT and "KeyboardInterrupt" in ends["interrupt"][1]
