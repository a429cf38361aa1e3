"""Training on the real model: rows from exact records, one GRPO step, run directory, resume, kill."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import journeyman as jm
import pytest
import torch
from _support import force_signal, recorded_choice, task_groups
from journeyman.backends.store import RunStore
from journeyman.training.rows import trajectory_rows
from openai.types.chat.chat_completion import Choice

pytestmark = pytest.mark.integration


def test_rows_join_calls_that_extend_each_other(chat_format) -> None:
    first = recorded_choice(prompt_token_ids=[1, 2, 3], token_ids=[4, 5])
    second = recorded_choice(
        prompt_token_ids=[1, 2, 3, 4, 5, 6, 7], token_ids=[8]
    )  # prompt = previous prompt + completion + tool turn
    side = recorded_choice(prompt_token_ids=[9, 9], token_ids=[10])  # unrelated prefix: its own row
    traj = jm.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "q"},
            first,
            {"role": "tool", "content": "r"},
            second,
            side,
        ]
    )
    rows = trajectory_rows(traj, chat_format, advantage=1.0)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 10]]
    assert rows[0].trained == [False, False, False, True, True, False, False, True]
    assert rows[0].rollout_logprobs[3:5] == [-0.5, -0.5]
    with pytest.raises(jm.NoTrainableTokensError) as e:
        trajectory_rows(
            jm.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}]),
            chat_format,
            1.0,
            where="groups[0].trajectories[1]",
        )
    assert e.value.field == "groups[0].trajectories[1]"


def test_groups_whose_rewards_barely_differ_are_dropped_when_asked(chat_format) -> None:
    from journeyman.training.trainer import build_rows

    def group(*rewards: float) -> jm.TrajectoryGroup:
        return jm.TrajectoryGroup(
            [
                jm.Trajectory(
                    messages_and_choices=[
                        {"role": "user", "content": "q"},
                        recorded_choice(prompt_token_ids=[1, 2], token_ids=[3]),
                    ],
                    reward=r,
                )
                for r in rewards
            ]
        )

    groups = [group(1.0, 0.0), group(-0.01, -0.02), group(0.5, 0.5)]
    rows, m = build_rows(groups, chat_format, jm.TrainConfig())
    assert len(rows) == 4 and m["groups_zero_signal"] == 1  # only exact ties carry nothing by default
    rows, m = build_rows(groups, chat_format, jm.TrainConfig(min_reward_spread=0.05))
    assert len(rows) == 2 and m["groups_zero_signal"] == 2  # a 0.01 length tie-break is not a signal


def test_names_that_escape_the_run_directory_are_refused() -> None:
    for bad in ["../x", "a/b", "..", ".hidden"]:
        with pytest.raises(jm.InvalidFieldError) as e:
            jm.TrainableModel(name=bad, project="p")
        assert e.value.field == "name"


async def test_a_token_id_outside_the_vocabulary_is_refused_before_anything_is_written(served) -> None:
    """A forged record whose id has no embedding row is refused (InvalidFieldError: a 400 on the
    server) by train, train_sft and log, naming where it sits and the id, with no file written."""
    model, backend = served
    vocab = backend.service(model).policy.model.get_input_embeddings().num_embeddings
    user = {"role": "user", "content": "q"}
    forged = jm.TrajectoryGroup(
        [
            jm.Trajectory(
                messages_and_choices=[user, recorded_choice(prompt_token_ids=[1, 2], token_ids=[3])],
                reward=1.0,
            ),
            jm.Trajectory(
                messages_and_choices=[user, recorded_choice(prompt_token_ids=[1, 2], token_ids=[3, vocab])],
                reward=0.0,
            ),
        ]
    )
    side = jm.Trajectory(
        messages_and_choices=[user, recorded_choice(prompt_token_ids=[1, 2], token_ids=[3])],
        additional_histories=[
            jm.History(messages_and_choices=[recorded_choice(prompt_token_ids=[vocab + 7, 2], token_ids=[3])])
        ],
    )
    files = sorted(p.relative_to(model.run_dir) for p in model.run_dir.rglob("*"))
    refused = []
    for call in (
        model.train([forged], idempotency_key="forged-id"),
        model.train_sft([side]),
        model.log([forged], split="val"),
    ):
        with pytest.raises(jm.InvalidFieldError) as e:
            await call
        refused.append((e.value.field, e.value.value))
    assert refused == [
        ("groups[0].trajectories[1].messages_and_choices[1].journeyman.token_ids[1]", vocab),
        (
            "trajectories[0].additional_histories[0].messages_and_choices[0].journeyman.prompt_token_ids[0]",
            vocab + 7,
        ),
        ("groups[0].trajectories[1].messages_and_choices[1].journeyman.token_ids[1]", vocab),
    ]
    assert sorted(p.relative_to(model.run_dir) for p in model.run_dir.rglob("*")) == files


async def test_the_groups_of_a_train_call_that_raised_are_kept_as_failed(served) -> None:
    """A step whose trainer raises commits nothing; its groups are kept in `<step>.failed-<id>.jsonl`,
    never in `<step>.jsonl`, which holds only what trained."""
    model, _ = served
    step = await model.get_step()
    # no assistant turn to train on: the trainer raises once the step has begun
    untrainable = jm.TrajectoryGroup(
        [
            jm.Trajectory(messages_and_choices=[{"role": "user", "content": "failed-step"}], reward=r)
            for r in (0, 1)
        ]
    )
    with pytest.raises(jm.NoTrainableTokensError) as e:
        await model.train([untrainable], idempotency_key="raises-in-trainer")
    assert e.value.field == "groups[0].trajectories[0]"
    assert await model.get_step() == step
    folder = model.run_dir / "trajectories" / "train"
    failed = folder / f"{step:04d}.failed-raises-in-trainer.jsonl"
    assert jm.TrajectoryGroup.model_validate_json(failed.read_text()) == untrainable
    trained = folder / f"{step:04d}.jsonl"
    assert not trained.exists() or "failed-step" not in trained.read_text()
    assert not list(folder.glob("*.attempt-*"))


async def _groups(model: jm.TrainableModel, n: int = 2, size: int = 4) -> list[jm.TrajectoryGroup]:
    return await task_groups(model, groups=n, size=size, max_tokens=12, signal=False)


def _sampled_step(groups: list[jm.TrajectoryGroup]) -> int:
    """The policy step that sampled the first trajectory's last turn, from its token record."""
    choice = groups[0].trajectories[0].messages_and_choices[-1]
    assert isinstance(choice, Choice)
    record = jm.record_of(choice)
    assert record is not None
    return record.step


def _fake_adapter(directory: Path, step: int) -> None:
    (directory / "adapter_model.safetensors").write_bytes(bytes([step]) * 64)


def _same(a: list[torch.Tensor], b: Iterator[torch.Tensor] | list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class _Lifecycle:
    """What one model's life showed, step by step (recorded once; the tests below each read a part)."""

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}
        self.errors: dict[str, jm.JourneymanError] = {}
        self.history: list[dict[str, object]] = []
        self.warnings = ""


@pytest.fixture(scope="module")
async def lifecycle(tmp_path_factory: pytest.TempPathFactory) -> _Lifecycle:
    """Train, resume in a new backend, run two steps at once, prune, serve old steps, fill the disk,
    truncate the latest checkpoint and resume again: the whole life of a run directory, in order."""
    tmp_path = tmp_path_factory.mktemp("lifecycle")
    life = _Lifecycle()
    seen = life.seen
    backend = jm.LocalBackend(path=tmp_path)
    model = jm.TrainableModel(name="m", project="p")
    await model.register(backend)
    service = backend.service(model)

    flat = await _groups(model)
    for g in flat:
        for t in g.trajectories:
            t.reward = 0.5
    logged: list[logging.LogRecord] = []
    skip_log = logging.Handler(logging.WARNING)
    skip_log.emit = logged.append  # type: ignore[method-assign]
    logging.getLogger("journeyman").addHandler(skip_log)
    try:
        seen["skipped"] = await model.train(flat)
    finally:
        logging.getLogger("journeyman").removeHandler(skip_log)
    seen["skip_logged"] = [r.getMessage() for r in logged if "skipped" in r.getMessage()]
    try:
        await model.train(flat, config=jm.TrainConfig(on_no_signal="error"))
    except jm.NoLearningSignalError as e:
        life.errors["no_signal"] = e
    seen["step_after_no_signal"] = await model.get_step()

    groups = await _groups(model)
    force_signal(groups)
    before = [p.detach().clone() for p in service.policy.trainable_parameters()]
    seen["step1"] = await backend.train(
        model, groups, config=jm.TrainConfig(learning_rate=1e-3), trained_by="alice"
    )
    seen["adapter_changed"] = not _same(before, list(service.policy.trainable_parameters()))
    seen["served_after_train"] = _sampled_step(await _groups(model, n=1, size=1))
    await model.log(await _groups(model, n=1, size=1), split="val")
    run = model.run_dir
    seen["checkpoint_1"] = (run / "checkpoints" / "0001" / "adapter_model.safetensors").exists()
    saved = jm.TrajectoryGroup.model_validate_json(
        (run / "trajectories" / "train" / "0000.jsonl").read_text().splitlines()[0]
    )
    seen["saved_records"] = bool(saved.trajectories[0].records())
    life.history = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
    trained = [p.detach().clone() for p in service.policy.trainable_parameters()]
    backend.close()

    # a new process (here: a new backend) resumes at the last checkpoint with the trained adapter
    backend2 = jm.LocalBackend(path=tmp_path)
    model2 = jm.TrainableModel(name="m", project="p")
    await model2.register(backend2)
    policy2 = backend2.service(model2).policy
    seen["resumed_step"] = await model2.get_step()
    seen["resumed_weights"] = _same(trained, list(policy2.trainable_parameters()))
    groups = await _groups(model2)
    force_signal(groups)
    both = await asyncio.gather(
        model2.train(groups, idempotency_key="first"), model2.train(groups, idempotency_key="second")
    )
    seen["concurrent_steps"] = sorted(r.step for r in both)
    seen["pruned"] = await model2.delete_checkpoints("val/reward")

    latest = [p.detach().clone() for p in policy2.trainable_parameters()]
    await model2.serve_step(1)
    seen["step_1_weights"] = _same(trained, list(policy2.trainable_parameters()))
    await model2.serve_step(0)
    seen["step_0_is_base"] = all(
        p.abs().sum() == 0 for n, p in policy2.model.named_parameters() if "lora_B" in n
    )
    seen["served_at_0"] = _sampled_step(await _groups(model2, n=1, size=1))
    for key, call in (
        ("train_on_old", lambda: model2.train(groups)),
        ("serve_4", lambda: model2.serve_step(4)),
    ):
        try:
            await call()
        except jm.InvalidFieldError as e:
            life.errors[key] = e
    await model2.serve_step(3)
    seen["step_3_weights"] = _same(latest, list(policy2.trainable_parameters()))

    # the disk fills while checkpoint 4 is written (the adapter fits, the optimizer state does not)
    try:
        with _file_size_limit(12 << 20):
            await model2.train(groups)
    except jm.CheckpointError as e:
        life.errors["disk_full"] = e
    seen["step_after_full_disk"] = await model2.get_step()
    seen["half_written"] = [p.name for p in (model2.run_dir / "checkpoints").iterdir() if "4" in p.name]
    seen["weights_after_full_disk"] = _same(latest, list(policy2.trainable_parameters()))
    backend2.close()

    # the latest checkpoint is truncated on disk: the resume falls back to the newest good one
    adapter = model2.run_dir / "checkpoints" / "0003" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:1000])
    backend3 = jm.LocalBackend(path=tmp_path)
    model3 = jm.TrainableModel(name="m", project="p")
    logger = logging.getLogger("journeyman.backends.store")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        await model3.register(backend3)
    finally:
        logger.removeHandler(handler)
    life.warnings = "\n".join(r.getMessage() for r in records)
    seen["fallback_step"] = await model3.get_step()
    seen["corrupt_kept"] = (model3.run_dir / "checkpoints" / "0003.corrupt").is_dir()
    seen["trajectory_files"] = sorted(p.name for p in (model3.run_dir / "trajectories" / "train").iterdir())
    seen["history_after_fallback"] = [(h["split"], h["step"]) for h in await model3.history()]
    superseded = (model3.run_dir / "history.superseded.jsonl").read_text().splitlines()
    seen["superseded"] = [(json.loads(x)["split"], json.loads(x)["step"]) for x in superseded]
    seen["fallback_weights"] = _same(trained, list(backend3.service(model3).policy.trainable_parameters()))
    backend3.close()
    return life


def test_groups_without_reward_spread_are_skipped(lifecycle: _Lifecycle) -> None:
    skipped = lifecycle.seen["skipped"]
    assert isinstance(skipped, jm.TrainResult)
    assert skipped.skipped and skipped.step == 0 and skipped.metrics["groups_zero_signal"] == 2
    # the result says why, and so does the log, in the same words
    assert skipped.skip_reason is not None and "rewards are all equal" in skipped.skip_reason
    assert lifecycle.seen["skip_logged"] == [f"step 0 skipped: {skipped.skip_reason}"]
    # on_no_signal="error" refuses the same groups by name, with their rewards; no step is made
    refused = lifecycle.errors["no_signal"]
    assert isinstance(refused, jm.NoLearningSignalError) and refused.field == "groups"
    assert refused.value == [[0.5] * 4, [0.5] * 4] and "on_no_signal='error'" in str(refused)
    assert lifecycle.seen["step_after_no_signal"] == 0


def test_a_step_changes_the_adapter_with_the_engines_own_logprobs(lifecycle: _Lifecycle) -> None:
    step1 = lifecycle.seen["step1"]
    assert isinstance(step1, jm.TrainResult)
    assert step1.step == 1 and not step1.skipped and lifecycle.seen["adapter_changed"]
    assert (
        step1.metrics["engine_trainer_logprob_gap"] < 1e-3
    )  # in-process fp32: same weights sampled and trained


def test_the_endpoint_serves_the_new_step(lifecycle: _Lifecycle) -> None:
    assert lifecycle.seen["served_after_train"] == 1


def test_the_run_directory_records_the_step_and_who_trained_it(lifecycle: _Lifecycle) -> None:
    history = lifecycle.history
    assert lifecycle.seen["checkpoint_1"] and lifecycle.seen["saved_records"]
    assert [h["split"] for h in history] == ["train", "train", "val"]
    assert history[1]["train/grad_norm"] > 0 and history[1]["trained_by"] == "alice"  # type: ignore[operator]
    assert "trained_by" not in history[0]
    # what the endpoint holds in memory is in every step's metrics: the turn cache, unpopped captures
    assert history[1]["train/endpoint_turn_cache_tokens"] > 0  # type: ignore[operator]
    assert history[1]["train/endpoint_captures_dropped"] == 0


def test_a_new_backend_resumes_at_the_last_checkpoint_with_its_adapter(lifecycle: _Lifecycle) -> None:
    assert lifecycle.seen["resumed_step"] == 1 and lifecycle.seen["resumed_weights"]


def test_concurrent_steps_run_one_after_the_other_and_pruning_keeps_best_and_latest(
    lifecycle: _Lifecycle,
) -> None:
    assert lifecycle.seen["concurrent_steps"] == [2, 3]  # never both from step 1
    assert lifecycle.seen["pruned"] == [2]  # step 1 is best (the only val), step 3 latest


def test_an_older_checkpoint_is_served_exactly_and_never_trained_on(lifecycle: _Lifecycle) -> None:
    seen, errors = lifecycle.seen, lifecycle.errors
    assert seen["step_1_weights"] and seen["step_0_is_base"] and seen["served_at_0"] == 0
    assert isinstance(errors["train_on_old"], jm.InvalidFieldError) and errors["train_on_old"].field == "step"
    out_of_range = errors["serve_4"]
    assert isinstance(out_of_range, jm.InvalidFieldError)
    assert out_of_range.field == "step" and "0..3" in str(out_of_range)
    assert seen["step_3_weights"]


def test_a_full_disk_is_a_named_error_and_the_last_step_stays(lifecycle: _Lifecycle) -> None:
    full = lifecycle.errors["disk_full"]
    assert isinstance(full, jm.CheckpointError) and full.step == 4, full
    seen = lifecycle.seen
    assert (
        seen["step_after_full_disk"] == 3 and seen["half_written"] == [] and seen["weights_after_full_disk"]
    )


def test_a_truncated_checkpoint_is_named_and_the_resume_falls_back(lifecycle: _Lifecycle) -> None:
    warning = lifecycle.warnings
    assert "step 3" in warning and "0003/adapter_model.safetensors" in warning and "truncated" in warning
    seen = lifecycle.seen
    assert seen["fallback_step"] == 1 and seen["corrupt_kept"] and seen["fallback_weights"]


def test_steps_lost_to_a_fallback_move_aside_with_their_history(lifecycle: _Lifecycle) -> None:
    names = lifecycle.seen["trajectory_files"]
    assert isinstance(names, list)
    assert names[0].startswith("0000.failed-")  # the groups on_no_signal="error" refused
    assert names[1:4] == ["0000.jsonl", "0001.superseded.jsonl", "0002.superseded.jsonl"], names
    assert len(names) == 5 and names[4].startswith("0003.failed-")  # the step the full disk cut off
    # the history rows of the lost steps 1 and 2 moved aside with their groups; step 1's eval stays
    assert lifecycle.seen["history_after_fallback"] == [("train", 0), ("train", 0), ("val", 1)]
    assert lifecycle.seen["superseded"] == [("train", 1), ("train", 2)]


def test_checkpoints_are_whole_and_a_bad_one_is_named_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = RunStore(tmp_path)
    for step in (1, 2):
        store.write_checkpoint(step, lambda d, step=step: _fake_adapter(d, step))
    store.write_state(2, base_model="b")

    def fails(d: Path) -> None:
        (d / "adapter_model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device", str(d / "optimizer.pt"))

    with pytest.raises(jm.CheckpointError) as full:
        store.write_checkpoint(3, fails)
    assert full.value.step == 3 and full.value.file.endswith("optimizer.pt"), full.value
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["0001", "0002"]

    # one flipped byte (same size) is caught by the manifest's sha256
    (tmp_path / "checkpoints" / "0002" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with caplog.at_level(logging.WARNING, logger="journeyman.backends.store"):
        assert store.resume_step() == 1
    assert "step 2" in caplog.text and "sha256" in caplog.text
    assert store.state()["step"] == 1 and store.state()["base_model"] == "b"

    # an unreadable state.json: a named error to readers, and a resume from the newest good checkpoint
    (tmp_path / "state.json").write_text('{"step": 1, "requ')
    with pytest.raises(jm.CheckpointError) as unreadable:
        store.latest_step()
    assert unreadable.value.file.endswith("state.json")
    assert store.resume_step() == 1 and store.latest_step() == 1


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """A real full disk, for this process: writes past `limit` bytes fail (EFBIG) instead of killing it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_shared_prefix_runs_once_with_the_same_logprobs_and_gradients(served) -> None:
    """Rows that share an untrained prefix (system prompt, tools) run it once per micro-batch; the
    logprobs and the LoRA gradients equal those of running every row in full."""
    from journeyman.training.packing import micro_batches, pad_rows, shared_prefix_length, trained_logprobs
    from journeyman.training.rows import Row

    model, backend = served
    service = backend.service(model)
    tok = service.policy.tokenizer
    prefix = tok.encode("You are an agent with tools. " * 12)
    rows = []
    for i, (user, answer) in enumerate(
        [("Add milk", "Added milk."), ("Remove rent", "Done, rent is gone now.")]
    ):
        r = Row(advantage=1.0 - 2 * i)
        r.extend(prefix + tok.encode(f" {user}."), trained=False)
        r.extend(tok.encode(answer), trained=True, logprobs=[-1.0] * len(tok.encode(answer)))
        rows.append(r)
    shared = shared_prefix_length(rows)
    assert shared >= len(prefix) - 1 and shared < rows[0].trained.index(True)
    assert [
        len(b) for b in micro_batches(rows, budget=2 * (len(rows[1].input_ids) - shared), shared=shared)
    ] == [2]

    device = service.policy.device
    ids, attn, trained, _ = (t.to(device) for t in pad_rows(rows))
    rows_idx, pos_idx = trained[:, 1:].nonzero(as_tuple=True)
    targets = ids[:, 1:][rows_idx, pos_idx]
    params = service.policy.trainable_parameters()
    results = []
    with service.policy.editing():  # unmerged: the shared model may be merged from sampling
        for n in (0, shared):
            logp = trained_logprobs(service.policy.model, ids, attn, rows_idx, pos_idx, targets, n)
            weights = torch.linspace(-1, 1, len(logp), device=device)
            grads = torch.autograd.grad((logp * weights).sum(), params)
            results.append((logp.detach(), grads))
    (full, g_full), (once, g_once) = results
    assert (full - once).abs().max() < 1e-4
    num = sum(float((a - b).norm() ** 2) for a, b in zip(g_full, g_once, strict=True)) ** 0.5
    den = sum(float(a.norm() ** 2) for a in g_full) ** 0.5
    assert den > 0 and num / den < 1e-3


def test_packed_rows_give_the_logprobs_and_gradients_of_padded_rows(served) -> None:
    """Rows of different lengths packed into sequences (no padding, each shared prefix once per
    sequence, trained turns that rows share included) give every row's logprobs and the LoRA
    gradients that the same rows right-padded and run in full give, to fp32 rounding."""
    from journeyman.training.packing import pack_rows, packed_logprobs, pad_rows, trained_logprobs
    from journeyman.training.rows import Row

    model, backend = served
    policy = backend.service(model).policy
    tok = policy.tokenizer
    system = tok.encode("You are an agent with tools. " * 6)

    def row(prompt: str, *turns: str, advantage: float, system: list[int] = system) -> Row:
        r = Row(advantage=advantage)
        r.extend(system + tok.encode(prompt), trained=False)
        for i, turn in enumerate(turns):  # assistant turns trained, tool results between them not
            ids = tok.encode(turn)
            r.extend(ids, trained=i % 2 == 0, logprobs=[-1.0] * len(ids) if i % 2 == 0 else None)
        return r

    rows = [
        row(" Add milk.", "Added milk.", advantage=1.0),
        row(" Add milk.", "Milk is on the list now, next to the eggs and the bread.", advantage=-1.0),
        row(" Add milk.", "Added milk.", advantage=0.5),  # the same sample twice: no token of its own
        row(" Remove rent.", "Done.", " Tool said: ok.", " Rent is gone.", advantage=1.0),
        row(
            " Remove rent.", "Done.", " Tool said: ok.", " Anything else?", advantage=-0.5
        ),  # shares a trained turn
        row("Name a color.", " Blue.", advantage=-1.0, system=[]),  # nothing in common with the others
    ]
    total, budget = sum(len(r.input_ids) for r in rows), max(len(r.input_ids) for r in rows) + 8
    packs = pack_rows(rows, budget)
    assert len(packs) >= 2 and sorted(id(r) for p in packs for r in p.rows) == sorted(map(id, rows))
    assert all(p.length <= budget for p in packs)
    assert sum(p.length for p in packs) < total - len(system)  # shared prefixes once per sequence

    # per-token weights fixed per row, so a logprob landing on another row or token changes the sum
    device = policy.device
    weights = {
        id(r): torch.linspace(-1, 1, sum(r.trained[1:]), device=device) * (i + 1) for i, r in enumerate(rows)
    }
    params = policy.trainable_parameters()
    with policy.editing():  # unmerged: the shared model may be merged from sampling
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():  # lora_B starts at 0, which leaves lora_A without gradient
            for p in params:
                p.add_(torch.randn_like(p) * 0.02)
        try:
            ids, attn, trained, _ = (t.to(device) for t in pad_rows(rows))
            rows_idx, pos_idx = trained[:, 1:].nonzero(as_tuple=True)
            targets = ids[:, 1:][rows_idx, pos_idx]
            logp = trained_logprobs(policy.model, ids, attn, rows_idx, pos_idx, targets)
            padded = dict(zip(map(id, rows), logp.split([sum(r.trained[1:]) for r in rows]), strict=True))
            packed: dict[int, torch.Tensor] = {}
            for p in packs:
                rows_idx, pos_idx = pad_rows(p.rows)[2][:, 1:].to(device).nonzero(as_tuple=True)
                logp = packed_logprobs(policy.model, p.inputs(device), rows_idx, pos_idx)
                packed |= zip(map(id, p.rows), logp.split([sum(r.trained[1:]) for r in p.rows]), strict=True)
            grads = [
                torch.autograd.grad(
                    torch.stack([(weights[k] * lp).sum() for k, lp in logps.items()]).sum(), params
                )
                for logps in (padded, packed)
            ]
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
    # fp32 rounding only: the two paths sum in different orders (matmuls of other shapes)
    gap = max(float((padded[k] - packed[k]).detach().abs().max()) for k in padded)
    assert gap < 3e-5, gap
    num = sum(float((a - b).norm() ** 2) for a, b in zip(*grads, strict=True)) ** 0.5
    den = sum(float(a.norm() ** 2) for a in grads[0]) ** 0.5
    assert den > 0 and num / den < 1e-5, num / den
    assert all(float(g.norm()) > 0 for g in grads[0])  # lora_A and lora_B of every layer
