"""SFT on the real model: the loss by hand, one step sequence with GRPO, the remote route, and the
W&B offline run read back from its own transaction log."""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import struct
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
import torch
from journeyman.app import tasks
from journeyman.app.cli import app as cli
from journeyman.training.packing import Pack
from journeyman.training.rows import Row
from journeyman.training.sft import SFTTrainer, lr_factor
from safetensors.torch import load_file
from typer.testing import CliRunner

pytestmark = pytest.mark.integration

TOKEN = "sft-test-token-0123456789"


def test_lr_schedule_warms_up_then_decays() -> None:
    cfg = jm.SFTConfig(warmup_ratio=0.2, lr_schedule="cosine", min_lr_ratio=0.1)
    f = [lr_factor(s, 10, cfg) for s in range(10)]
    assert f[:2] == [1 / 3, 2 / 3]  # 2 warmup steps; the first already moves
    assert f[2] == 1.0 and all(a > b for a, b in itertools.pairwise(f[2:]))
    assert f[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    linear = jm.SFTConfig(warmup_ratio=0.0, lr_schedule="linear")
    assert [lr_factor(s, 4, linear) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert lr_factor(0, 1, jm.SFTConfig()) == 1.0  # a one-step call trains at the peak


def test_bad_settings_and_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(jm.InvalidFieldError) as e:
        jm.SFTConfig(epochs=0)
    assert e.value.field == "epochs" and e.value.value == 0
    with pytest.raises(jm.InvalidFieldError, match="at most 100") as e:  # one call holds the lock: bounded
        jm.SFTConfig(epochs=101)
    assert e.value.field == "epochs"
    with pytest.raises(jm.InvalidFieldError) as e:
        jm.SFTConfig(warmup_ratio=1.5)
    assert e.value.field == "warmup_ratio"

    good = jm.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=1.0)
    path = tmp_path / "data.jsonl"
    path.write_text(good.model_dump_json() + "\n" + '{"messages_and_choices": [], "reward": "high"}\n')
    with pytest.raises(jm.InvalidFieldError) as e:
        jm.read_trajectories(path)
    assert e.value.field == "data.jsonl:2 reward" and e.value.value == "high", e.value
    path.write_text('{"trajectories": [' + good.model_dump_json() + "]}\n\n" + good.model_dump_json() + "\n")
    assert len(jm.read_trajectories(path)) == 2
    with pytest.raises(jm.InvalidFieldError) as e:
        jm.read_trajectories(path, min_reward=2.0)
    assert e.value.field == "path" and "reward >= 2.0" in str(e.value)

    # the CLI says what is wrong in one line, before it loads any model
    path.write_text("not json\n")
    out = CliRunner().invoke(cli, ["sft", str(path), "--path", str(tmp_path)])
    assert out.exit_code == 2 and "data.jsonl:1" in out.output and "not JSON" in out.output, out.output
    path.write_text(good.model_dump_json() + "\n")
    out = CliRunner().invoke(cli, ["sft", str(path), "--lr-schedule", "wavy"])
    assert out.exit_code == 2 and "lr_schedule" in out.output, out.output


@dataclass
class Run:
    backend: jm.LocalBackend
    model: jm.TrainableModel
    results: list[jm.TrainResult]
    retried: jm.TrainResult
    served_after_sft: int
    refused: list[jm.InvalidFieldError]


@pytest.fixture(scope="module")
async def registered(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[jm.LocalBackend, jm.TrainableModel]]:
    # W&B never reaches the network here: offline mode writes the run to <run_dir>/wandb
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    backend = jm.LocalBackend(path=tmp_path_factory.mktemp("sft-runs"), report_to=["wandb"])
    model = jm.TrainableModel(name="m", project="p", max_tokens=8)
    await model.register(backend)
    yield backend, model
    backend.close()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _rows(tok: Any, pairs: list[tuple[str, str]]) -> list[Row]:
    rows = []
    for prompt, answer in pairs:
        r = Row()
        r.extend(tok.encode(prompt), trained=False)
        r.extend(tok.encode(answer), trained=True)
        r.extend(tok.encode(" Then a tool said: ok."), trained=False)  # masked, as tool results are
        r.extend(tok.encode(" Done."), trained=True)
        rows.append(r)
    return rows


def test_sft_loss_is_the_masked_cross_entropy_of_each_row_alone(registered: tuple[Any, Any]) -> None:
    """Two rows packed into one sequence: the loss is the mean cross-entropy of their trained
    tokens, computed here from each row's own full forward pass (so neither row saw the other)."""
    backend, model = registered
    service = backend.service(model)
    policy = service.policy
    rows = _rows(
        policy.tokenizer, [("What is the capital of France?", " Paris."), ("Name a color.", " Blue, mostly.")]
    )
    trainer = SFTTrainer(policy, service.chat_format)
    packed = jm.SFTConfig(micro_batch_tokens=256)
    (pack,) = trainer.micro_batches(rows, packed)
    assert isinstance(pack, Pack) and len(pack.rows) == 2

    by_hand_sum, by_hand_n = 0.0, 0
    with torch.no_grad(), policy.editing():
        for r in rows:
            ids = torch.tensor([r.input_ids], device=policy.device)
            logits = policy.model(input_ids=ids).logits[0].double()  # (T, V)
            ce = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
            # token t is predicted at t - 1
            mask = torch.tensor(r.trained[1:], dtype=torch.float64, device=policy.device)
            by_hand_sum += float((ce * mask).sum())
            by_hand_n += int(mask.sum())
        by_hand = by_hand_sum / by_hand_n
        loss_packed, micro, padded = trainer.loss(rows, packed)
        loss_padded, _, padded_tokens = trainer.loss(rows, jm.SFTConfig(packing=False))
    assert micro == 1 and padded == 0 and padded_tokens > 0
    assert loss_packed == pytest.approx(by_hand, abs=1e-4), (loss_packed, by_hand)
    assert loss_padded == pytest.approx(by_hand, abs=1e-4), (loss_padded, by_hand)


class _Server:
    """`journeyman serve`'s app (token guard included) on 127.0.0.1, in a thread of this process,
    around the test's own LocalBackend: the model is loaded once for both routes."""

    def __init__(self, backend: jm.LocalBackend) -> None:
        import uvicorn
        from journeyman.backends.server import DEFAULT_MAX_BODY_BYTES, Guard, create_app

        app = Guard(create_app(backend, TOKEN), TOKEN, DEFAULT_MAX_BODY_BYTES)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def _rollouts(model: jm.TrainableModel, n: int) -> jm.TrajectoryGroup:
    client = model.openai_client()
    (scenario,) = tasks.scenarios("train", 1)
    (group,) = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup(tasks.rollout(model, client, scenario, max_tokens=8) for _ in range(n))],
        pbar_desc=None,
    )
    return group


@pytest.fixture(scope="module")
async def run(registered: tuple[jm.LocalBackend, jm.TrainableModel]) -> Run:
    """SFT through `journeyman serve` (RemoteBackend), a GRPO step here, a val log: three history
    rows of one run. The backend is closed at the end, which finishes the W&B run."""
    backend, model = registered
    refused = []
    no_answer = jm.Trajectory(messages_and_choices=[{"role": "user", "content": "no answer"}])
    for bad in ([], [no_answer], no_answer):
        with pytest.raises(jm.InvalidFieldError) as e:
            await model.train_sft(bad)
        refused.append(e.value)

    rendered = jm.Trajectory(  # no token records: rendered with the chat template
        messages_and_choices=[
            {"role": "system", "content": tasks.SYSTEM},
            {"role": "user", "content": "Tell me about a lighthouse."},
            {"role": "assistant", "content": "A lighthouse guides ships."},
        ],
        reward=1.0,
    )
    sampled = await _rollouts(model, 2)  # exact token records
    server = _Server(backend)
    try:
        remote = jm.TrainableModel(name="m", project="p", max_tokens=8)
        await remote.register(jm.RemoteBackend(server.url, token=TOKEN, progress=False))
        config = jm.SFTConfig(epochs=2, batch_size=2, learning_rate=1e-3, warmup_ratio=0.5)
        sft = await remote.train_sft([rendered, sampled], config=config, idempotency_key="sft-1")
        retried = await remote.train_sft([rendered, sampled], config=config, idempotency_key="sft-1")
    finally:
        server.stop()
    probe = await _rollouts(model, 1)
    served = jm.record_of(probe.trajectories[0].messages_and_choices[-1])
    assert served is not None

    groups = [await _rollouts(model, 2)]
    for i, t in enumerate(groups[0].trajectories):
        t.reward = float(i)  # rewards that differ: the step always trains
    grpo = await model.train(groups, config=jm.TrainConfig(learning_rate=1e-3))
    await model.log(groups, split="val")
    backend.close()  # finishes the W&B run
    return Run(backend, model, [sft, grpo], retried, served.step, refused)


def test_sft_then_grpo_continue_one_step_sequence(run: Run) -> None:
    empty, no_answer, bare = run.refused
    assert empty.field == "trajectories" and bare.field == "trajectories" and "list" in bare.reason
    assert isinstance(no_answer, jm.NoTrainableTokensError) and no_answer.field == "trajectories[0]"

    sft, grpo = run.results
    assert sft.step == 1 and grpo.step == 2 and run.retried == sft  # a retried key trains once
    assert run.served_after_sft == 1  # the endpoint served the SFT step right away
    m = sft.metrics
    assert m["trajectories"] == 3 and m["rows"] == 3 and m["rows_retokenized"] == 1
    assert m["optimizer_steps"] == 4 and m["loss"] < m["loss_first_epoch"], m

    root = run.backend.run_dir(run.model)
    state = json.loads((root / "state.json").read_text())
    assert state["step"] == 2
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["0001", "0002"]
    assert [len(p.read_text().splitlines()) for p in (root / "trajectories" / "sft").iterdir()] == [2]
    history = [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]
    assert [(h["step"], h["split"]) for h in history] == [(0, "sft"), (1, "train"), (2, "val")]
    assert history[0]["sft/loss"] == pytest.approx(m["loss"])

    # RL started from the SFT adapter and moved it; SFT moved it off the base model (B = 0)
    one, two = (
        load_file(str(root / "checkpoints" / s / "adapter_model.safetensors")) for s in ("0001", "0002")
    )
    assert any(v.abs().sum() > 0 for k, v in one.items() if "lora_B" in k)
    assert any(not torch.equal(one[k], two[k]) for k in one)
    # the checkpoint after SFT keeps the GRPO optimizer's state (none yet), not SFT's moments
    assert not (root / "checkpoints" / "0001" / "optimizer.pt").exists()
    assert (root / "checkpoints" / "0002" / "optimizer.pt").exists()


BLOCK = 32768  # the transaction log's block size (LevelDB's log format, as W&B writes it)


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a `.wandb` file, decoded with W&B's own protobuf schema.

    wandb 0.31 ships no Python reader of its transaction log (its `sdk.internal.datastore` reader
    was removed with the move to wandb-core; a LocalApi is not released), so the framing is read
    here: a 7-byte header, then 32 KiB blocks of chunks, each crc32 + length + type + data.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), data[:7]
    at, buf = 7, b""
    while at + 7 <= len(data):
        if BLOCK - at % BLOCK < 7:  # a block's tail too short for a chunk header is zero padding
            at += BLOCK - at % BLOCK
            continue
        crc, n, kind = struct.unpack_from("<IHB", data, at)
        chunk = data[at + 7 : at + 7 + n]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad crc at byte {at}"
        at, buf = at + 7 + n, buf + chunk
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_wandb_offline_run_holds_every_history_key_at_every_step(run: Run) -> None:
    root = run.backend.run_dir(run.model)
    (log,) = (root / "wandb").glob("offline-run-*/run-*.wandb")
    rows, config = [], {}
    for r in _wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {it.key or ".".join(it.nested_key): json.loads(it.value_json) for it in r.history.item}
            )
        elif kind in ("run", "config"):
            items = r.run.config.update if kind == "run" else r.config.update
            config.update({u.key: json.loads(u.value_json) for u in items})
    history = [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]
    assert len(rows) == len(history) == 3
    for logged, written in zip(rows, history, strict=True):
        for key, value in written.items():
            assert key in logged, (key, sorted(logged))
            assert logged[key] == (pytest.approx(value) if isinstance(value, float) else value), key
        assert logged[f"{written['split']}/samples._type"] == "table-file"  # sample trajectories
    assert config["model"]["name"] == "m"
    assert config["sft"]["epochs"] == 2 and config["train"]["learning_rate"] == 1e-3
