"""Open episodes' calls on disk (`Captures.keep_on_disk`): what a restarted server files again."""

from __future__ import annotations

from pathlib import Path

from journeyman.rollout import capture
from journeyman.rollout.capture import CapturedCall, Captures


def _call(i: int) -> CapturedCall:
    return CapturedCall(
        request_messages=[{"role": "user", "content": f"turn {i}"}],
        response={"id": f"c{i}", "choices": [{"message": {"role": "assistant", "content": str(i)}}]},
    )


def test_a_restart_files_again_the_calls_no_outcome_took(tmp_path: Path) -> None:
    path = tmp_path / "open_calls.jsonl"
    before = Captures()
    before.add("early", _call(0))  # filed before the journal: written when it starts
    assert before.keep_on_disk(path) == 0
    for i in (1, 2, 3):
        before.add("ep", _call(i))
    before.add("gone", _call(4))
    before.take("ep", 1)  # an outcome took the first call; two came after it
    before.pop("gone")
    before.add("gone", _call(5))
    with path.open("a") as f:
        f.write('{"add": "ep", "call": {"request_mess')  # the line a kill cut off
    # the process dies here: nothing is closed
    after = Captures()
    assert after.keep_on_disk(path) == 4
    assert after.peek("early") == [_call(0)]
    assert after.peek("ep") == [_call(2), _call(3)]
    assert after.peek("gone") == [_call(5)]
    assert after.keep_on_disk(path) == 0  # the same file again: nothing twice
    # the file was compacted to what is held, and goes on from there
    assert len(path.read_text().splitlines()) == 4
    after.take("ep", 2)
    assert Captures().keep_on_disk(path) == 2


def test_a_long_journal_is_compacted_to_what_is_held(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(capture, "COMPACT_LINES", 20)
    path = tmp_path / "open_calls.jsonl"
    held = Captures()
    held.keep_on_disk(path)
    held.add("open", _call(0))
    for i in range(30):  # episodes filed and taken: their lines go at a compaction
        held.add(f"ep{i}", _call(i))
        held.take(f"ep{i}", 1)
    assert len(path.read_text().splitlines()) < 20
    assert Captures().keep_on_disk(path) == 1
