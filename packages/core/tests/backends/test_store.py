"""The run directory on its own (no model): what its files hold through failures, kills and rollbacks."""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from journeyman.backends.store import RunStore
from openai.types.chat.chat_completion import Choice


def _record(**changes: Any) -> dict[str, Any]:
    record = {
        "prompt_token_ids": [1, 2, 3],
        "token_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
        "model": "m@0",
        "step": 0,
        "finish_reason": "stop",
    }
    return {**record, **changes}


def _choice(**changes: Any) -> dict[str, Any]:
    return {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": "x"},
        "journeyman": _record(**changes),
    }


def _group(tag: str, n: int = 2) -> jm.TrajectoryGroup:
    return jm.TrajectoryGroup(
        [
            jm.Trajectory(
                messages_and_choices=[{"role": "user", "content": tag}, Choice.model_validate(_choice())],
                reward=float(i),
            )
            for i in range(n)
        ]
    )


def _tags(path: Path) -> list[str]:
    """The user message of each group's first trajectory, one per line of `path`."""
    out = []
    for line in path.read_text().splitlines():
        group = jm.TrajectoryGroup.model_validate_json(line)
        out.append(group.trajectories[0].messages()[0]["content"])
    return out


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _fake_checkpoint(store: RunStore, step: int) -> None:
    def save(d: Path) -> None:
        (d / "adapter_model.safetensors").write_bytes(bytes([step]) * 64)

    store.write_checkpoint(step, save)


def _commit(store: RunStore, step: int, attempt: Any, key: str | None = None, **metrics: float) -> None:
    result = {"step": step, "metrics": metrics, "skipped": False}
    store.write_state(step, request=(key, result) if key else None, attempt=attempt, base_model="b")


def test_a_torn_last_history_line_is_dropped_and_repaired(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A kill mid-append leaves a partial last line: the reader drops it with a warning and cuts it
    from the file, so the next append is a line of its own; a bad middle line is skipped, not fatal."""
    store = RunStore(tmp_path)
    store.append_history({"step": 0, "split": "train", "train/reward": 0.5})
    store.append_history({"step": 1, "split": "val", "val/reward": 0.7})
    path = tmp_path / "history.jsonl"
    whole = path.read_bytes()
    with path.open("ab") as f:
        f.write(b'{"step": 2, "split": "tr')  # the power went out here
    with caplog.at_level(logging.WARNING, logger="journeyman.backends.store"):
        assert [r["step"] for r in store.history()] == [0, 1]
    assert "torn last line" in caplog.text
    assert path.read_bytes() == whole  # repaired on disk
    assert store.delete_checkpoints() == []  # no longer raises on the torn line

    # a torn line the reader has not seen yet: the next append repairs it before writing
    with path.open("ab") as f:
        f.write(b'{"step": 2, "spl')
    store.append_history({"step": 2, "split": "train", "train/reward": 0.9})
    assert [r["step"] for r in store.history()] == [0, 1, 2]
    assert all(isinstance(json.loads(line), dict) for line in path.read_text().splitlines())

    # a row that lost only its newline is kept; a garbled middle line is skipped with a warning
    path.write_bytes(whole + b'garbage\n{"step": 3, "split": "val"}')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="journeyman.backends.store"):
        assert [r["step"] for r in store.history()] == [0, 1, 3]
    assert "line 3 is not a JSON object" in caplog.text
    assert path.read_bytes().endswith(b'{"step": 3, "split": "val"}\n')


def test_concurrent_appends_never_interleave(tmp_path: Path) -> None:
    """Rows appended from several threads at once (a `log` beside a train step) each land whole."""
    store = RunStore(tmp_path)
    pad = "x" * 5000  # rows longer than a pipe buffer, so a split write would show

    def append(t: int) -> None:
        for i in range(40):
            store.append_history({"step": i, "split": f"t{t}", "pad": pad})

    threads = [threading.Thread(target=append, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(lines) == 240 and all(json.loads(line)["pad"] == pad for line in lines)


def test_every_file_the_store_writes_is_strict_json(tmp_path: Path) -> None:
    """NaN and infinite metrics are written as null (strict JSON) in history rows, state.json,
    request results, manifests and trajectory files; the readers take the nulls."""
    store = RunStore(tmp_path)
    _fake_checkpoint(store, 1)
    group = _group("a")
    group.trajectories[0].metrics["judge_score"] = math.nan  # a judge that failed
    attempt = store.begin_attempt([group], "train", 0, key="k1")
    store.write_state(
        1,
        request=("k1", {"step": 1, "metrics": {"loss": math.nan, "kl": math.inf}, "skipped": False}),
        attempt=attempt,
        base_model="b",
    )
    row = store.append_history({"step": 0, "split": "train", "train/loss": math.nan, "nested": [-math.inf]})
    assert row["train/loss"] is None and row["nested"] == [None]
    store.append_history({"step": 1, "split": "val", "val/reward": math.nan})
    for path in [
        tmp_path / "history.jsonl",
        tmp_path / "state.json",
        tmp_path / "requests" / "k1.json",
        tmp_path / "checkpoints" / "0001" / "manifest.json",
        tmp_path / "trajectories" / "train" / "0000.jsonl",
    ]:
        for line in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
            _strict(line)
    (back,) = store.read_groups("train", 0)  # the null reads back as NaN
    assert math.isnan(back.trajectories[0].metrics["judge_score"])
    assert store.request_result("k1") == {"step": 1, "metrics": {"loss": None, "kl": None}, "skipped": False}
    assert [r.get("train/loss", 0) for r in store.history()] == [None, 0]
    assert store.delete_checkpoints("val/reward") == []  # a null metric is no candidate for "best"

    from journeyman.app.plot import plot_history

    assert plot_history(store.history(), tmp_path / "reward.png", metric="loss").stat().st_size > 0


def test_groups_of_failed_abandoned_and_committed_calls_are_kept_apart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`<step>.jsonl` holds exactly the groups that trained (after those of skipped calls at the
    step); a call that raised leaves `failed-`, one in flight at a kill `abandoned-`, and a retry
    of the killed key takes its file back instead of writing the groups again."""
    store = RunStore(tmp_path)
    d = tmp_path / "trajectories" / "train"

    skipped = store.begin_attempt([_group("skipped")], "train", 0)
    assert (d / skipped.file("attempt")).exists() and not (d / "0000.jsonl").exists()
    _commit(store, 0, skipped)  # a skipped step commits at the same step
    failed = store.begin_attempt([_group("failed")], "train", 0, key="f")
    assert store.fail_attempt(failed) == d / "0000.failed-f.jsonl"
    again = store.begin_attempt([_group("failed again")], "train", 0, key="f")
    assert store.fail_attempt(again) == d / "0000.failed-f.2.jsonl"  # never overwrites the first
    trained = store.begin_attempt([_group("trained"), _group("trained 2")], "train", 0)
    _fake_checkpoint(store, 1)
    _commit(store, 1, trained)
    assert store.fail_attempt(trained) is None  # an error after the commit does not un-train it
    assert _tags(d / "0000.jsonl") == ["skipped", "trained", "trained 2"]
    assert [g.trajectories[0].messages()[0]["content"] for g in store.read_groups("train", 0)] == [
        "skipped",
        "trained",
        "trained 2",
    ]

    # killed mid-step: the resume names the leftover abandoned; the retry (same key, same groups)
    # takes it back, so the groups are on disk once
    sent = [_group("killed")]  # a retry sends the very same groups
    killed = store.begin_attempt(sent, "train", 1, key="k")
    inode = (d / killed.file("attempt")).stat().st_ino
    with caplog.at_level(logging.WARNING, logger="journeyman.backends.store"):
        assert RunStore(tmp_path).resume_step() == 1
    assert "in flight" in caplog.text and (d / "0001.abandoned-k.jsonl").exists()
    with pytest.raises(jm.InvalidFieldError):
        store.read_groups("train", 1)  # nothing trained at step 1 yet
    retried = store.begin_attempt(sent, "train", 1, key="k")
    assert (d / retried.file("attempt")).stat().st_ino == inode  # the same file, not a second copy
    _fake_checkpoint(store, 2)
    _commit(store, 2, retried, key="k")
    assert sorted(p.name for p in d.iterdir()) == [
        "0000.failed-f.2.jsonl",
        "0000.failed-f.jsonl",
        "0000.jsonl",
        "0001.jsonl",
    ]
    assert _tags(d / "0001.jsonl") == ["killed"]

    # an abandoned attempt with other groups is not taken back: the retry writes its own
    other = store.begin_attempt([_group("other")], "train", 2, key="o")
    RunStore(tmp_path).resume_step()
    retry = store.begin_attempt([_group("changed")], "train", 2, key="o")
    assert _tags(d / retry.file("attempt")) == ["changed"] and (d / other.file("abandoned")).exists()


def test_a_commit_cut_off_by_a_kill_is_finished_by_the_resume(tmp_path: Path) -> None:
    """Killed after state.json committed a step but before its groups were promoted (or mid-merge
    with a skipped call's groups) and its key copied: the resume finishes both, exactly once."""
    store = RunStore(tmp_path)
    d = tmp_path / "trajectories" / "train"
    skipped = store.begin_attempt([_group("skipped")], "train", 0)
    _commit(store, 0, skipped)
    store.begin_attempt([_group("trained")], "train", 0, key="t")
    _fake_checkpoint(store, 1)
    result = {"step": 1, "metrics": {"loss": 1.0}, "skipped": False}
    state = {
        "step": 1,
        "base_model": "b",
        "last": {"key": "t", "result": result, "split": "train", "step": 0, "attempt": "t"},
    }
    (tmp_path / "state.json").write_text(json.dumps(state))  # committed; the follow-ups never ran
    assert store.request_result("t") == result  # answered from the state already
    # the kill came mid-merge: the combined file was written, the attempt not yet removed
    (d / "0000.combined-t.jsonl").write_text(
        (d / "0000.jsonl").read_text() + (d / "0000.attempt-t.jsonl").read_text()
    )
    assert RunStore(tmp_path).resume_step() == 1
    assert _tags(d / "0000.jsonl") == ["skipped", "trained"]
    assert sorted(p.name for p in d.iterdir()) == ["0000.jsonl"]
    assert json.loads((tmp_path / "requests" / "t.json").read_text()) == result


def test_idempotency_results_are_kept_for_good_and_forgotten_on_rollback(tmp_path: Path) -> None:
    """Every committed key answers its result after the store is reopened, however many came after
    (not only the last 64); old runs' `requests` map in state.json is still read; a rollback forgets
    the keys of the steps it loses."""
    store = RunStore(tmp_path)
    (tmp_path / "state.json").write_text(
        json.dumps({"step": 0, "base_model": "b", "requests": {"old": {"step": 0, "metrics": {}}}})
    )
    assert RunStore(tmp_path).request_result("old") == {"step": 0, "metrics": {}}
    for step in range(1, 71):
        if step in (1, 2, 3, 70):
            _fake_checkpoint(store, step)
        attempt = store.begin_attempt([_group(f"s{step}")], "train", step - 1, key=f"key-{step}")
        _commit(store, step, attempt, key=f"key-{step}", loss=float(step))
    reopened = RunStore(tmp_path)
    assert reopened.request_result("key-1") == {"step": 1, "metrics": {"loss": 1.0}, "skipped": False}
    assert reopened.request_result("old") == {"step": 0, "metrics": {}}  # moved out of state.json
    assert "requests" not in reopened.state()
    assert reopened.request_result("never") is None

    # checkpoint 70 corrupt, 4..69 pruned: back to step 3; keys of steps 4.. are forgotten
    (tmp_path / "checkpoints" / "0070" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    assert RunStore(tmp_path).resume_step() == 3
    assert reopened.request_result("key-3") is not None
    assert reopened.request_result("key-4") is None and reopened.request_result("key-70") is None
    with pytest.raises(jm.InvalidFieldError):
        reopened.request_result("../escape")


def test_an_idempotency_key_is_scoped_to_its_operation(tmp_path: Path) -> None:
    """Issue 53: one key used by `train` and by `train_sft` names two calls: each answers its own
    result (`requests/<key>.json`, `requests/sft/<key>.json`), also from state.json when the copy
    was cut off; a rollback forgets the lost step's key in either place."""
    store = RunStore(tmp_path)
    for step, split in ((1, "train"), (2, "sft")):
        _fake_checkpoint(store, step)
        _commit(store, step, store.begin_attempt([_group(split)], split, step - 1, key="K"), key="K")
    assert store.request_result("K")["step"] == 1 == store.request_result("K", "train")["step"]  # pyright: ignore[reportOptionalSubscript]
    assert store.request_result("K", "sft")["step"] == 2  # pyright: ignore[reportOptionalSubscript]
    assert (tmp_path / "requests" / "sft" / "K.json").is_file()
    (tmp_path / "requests" / "sft" / "K.json").unlink()  # as if a kill cut the copy off
    assert RunStore(tmp_path).request_result("K", "sft")["step"] == 2  # pyright: ignore[reportOptionalSubscript]
    assert RunStore(tmp_path).request_result("K", "val") is None
    (tmp_path / "checkpoints" / "0002" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    assert RunStore(tmp_path).resume_step() == 1
    assert store.request_result("K", "sft") is None and store.request_result("K")["step"] == 1  # pyright: ignore[reportOptionalSubscript]


def test_a_rollback_moves_the_lost_steps_history_rows_aside(tmp_path: Path) -> None:
    """Rolling back to step 2 moves train/sft rows of steps >= 2 and other splits' rows of steps
    > 2 to history.superseded.jsonl, so training on from step 2 never leaves two rows of a step."""
    store = RunStore(tmp_path)
    for step in (1, 2, 3):
        _fake_checkpoint(store, step)
        store.append_history({"step": step - 1, "split": "train" if step != 2 else "sft"})
        store.append_history({"step": step, "split": "val"})
    store.append_history({"step": 0, "split": "val", "val/loss": math.nan})
    store.write_state(3, base_model="b")
    (tmp_path / "checkpoints" / "0003" / "adapter_model.safetensors").write_bytes(b"half")
    assert store.resume_step() == 2
    assert [(r["split"], r["step"]) for r in store.history()] == [
        ("train", 0),
        ("val", 1),
        ("sft", 1),
        ("val", 2),
        ("val", 0),
    ]
    lost = [json.loads(x) for x in (tmp_path / "history.superseded.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in lost] == [("train", 2), ("val", 3)]
    store.append_history({"step": 2, "split": "train"})  # step 2 trained again: one row of it
    assert [r["step"] for r in store.history() if r["split"] == "train"] == [0, 2]


def test_forged_token_records_are_refused_by_field_when_parsed() -> None:
    """A record with a negative id, a non-finite logprob, or a logprob count that is not its token
    count is refused when a trajectory is built or parsed, naming the field; the engine's pass."""
    good = jm.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, _choice()])
    assert good.records()[0].token_ids == [4, 5]
    cases = {
        "token_ids[1]": _record(token_ids=[4, -1]),
        "prompt_token_ids[0]": _record(prompt_token_ids=[-7, 2]),
        "logprobs[1]": _record(logprobs=[-0.5, math.nan]),
        "logprobs": _record(logprobs=[-0.5]),
        "step": _record(step=-1),
    }
    for field, record in cases.items():
        forged = {**_choice(), "journeyman": record}
        with pytest.raises(jm.InvalidFieldError) as built:
            jm.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, forged])
        assert built.value.field == f"messages_and_choices[1].journeyman.{field}", built.value
        if field == "logprobs":
            assert built.value.reason == "has 1 entries for 2 token_ids: one logprob per sampled id"
        body = json.dumps({"trajectories": [{"messages_and_choices": [forged]}]})
        with pytest.raises(ValueError) as parsed:  # pydantic's ValidationError, as the server sees it
            jm.TrajectoryGroup.model_validate_json(body)
        assert f"messages_and_choices[0].journeyman.{field}" in str(parsed.value)
    with pytest.raises(ValueError):
        jm.TokenRecord.model_validate(_record(logprobs=[-0.5, math.inf]))


def test_the_run_layout_names_every_path_once(tmp_path: Path) -> None:
    from journeyman.data.paths import RunLayout, RunRoot

    layout = RunLayout.of(tmp_path, "p", "m")
    assert layout.root == tmp_path / "p" / "models" / "m"
    assert layout.checkpoint(3) == layout.root / "checkpoints" / "0003"
    assert layout.groups_file("val", 2) == layout.root / "trajectories" / "val" / "0002.jsonl"
    assert layout.request("k1") == layout.root / "requests" / "k1.json"
    assert (layout.history.name, layout.state.name) == ("history.jsonl", "state.json")
    assert RunRoot(tmp_path).tokens == tmp_path / "tokens.json"
    for bad in ("../up", "a/b"):
        with pytest.raises(jm.InvalidFieldError):
            RunLayout.of(tmp_path, bad, "m")
    with pytest.raises(jm.InvalidFieldError):
        layout.split_dir("../x")
    # the store writes where the layout says
    store = RunStore(layout.root)
    store.append_history({"step": 0, "split": "val"})
    store.write_groups([_group("a")], "val", 0)
    assert layout.history.is_file() and layout.groups_file("val", 0).is_file()
