"""The run viewer in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright
through its own executable, never a downloaded build) on a run this module trains.

The run: a random-weight 2-layer Llama beside the embedded model's tokenizer, on a LocalBackend
(the real engine, endpoint, grammar, trainer and run store, no 135M weights): each rollout makes a
forced `add_task` call, gets the tool's answer (an error for an empty title), and answers. One step
trains before the browser opens; while the page is open the model logs an evaluation (a history row
and a val trajectories file, through the backend), and the page shows it without a reload. Screenshots of every page go to `<pytest tmp>/viewer-shots/` (printed).

The hostile-input tests need no model: hand-written runs whose every field holds odd JSON values
(objects, arrays, nulls, huge numbers, markup), and the viewer's session cookie under `serve` seen
from a page on another port of the same host.
"""

from __future__ import annotations

import asyncio
import copy
import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import journeyman as jm
import pytest
from _support import function_tool, tiny_model_dir
from journeyman.app.view.api import handle
from journeyman.app.view.runs import RunFiles
from journeyman.app.view.server import ViewerServer
from journeyman.data.config import DEFAULT_BASE_MODEL
from journeyman.serving.api_tokens import TokenBook
from journeyman.serving.guard import (
    DEFAULT_MAX_BODY_BYTES,
    VIEW_COOKIE,
    VIEW_SESSION_MAX_S,
    Guard,
    ViewSessions,
)

pytestmark = pytest.mark.timeout(900)  # setup included: a training run on a loaded 2-core machine

TOOLS = [
    function_tool(
        "add_task", "Add a task to the to-do list.", {"title": {"type": "string", "maxLength": 6}}, ["title"]
    )
]


async def _rollout(model: jm.TrainableModel, task: str) -> jm.Trajectory:
    client = model.openai_client()
    traj = jm.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "You manage a to-do list."},
            {"role": "user", "content": f"Add the task '{task}'."},
        ],
        tools=TOOLS,
    )
    first = await client.chat.completions.create(
        model=model.name, messages=traj.messages(), tools=TOOLS, tool_choice="required", max_tokens=96
    )
    choice = first.choices[0]
    traj.messages_and_choices.append(choice)
    for call in choice.message.tool_calls or []:
        title = str(json.loads(call.function.arguments).get("title", "")).strip()  # pyright: ignore[reportAttributeAccessIssue]
        answer = f"Added '{title}'." if title else "Error: title must not be empty"
        traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    second = await client.chat.completions.create(
        model=model.name, messages=traj.messages(), tools=TOOLS, tool_choice="none", max_tokens=6
    )
    traj.messages_and_choices.append(second.choices[0])
    called = " ".join(c.function.arguments for c in choice.message.tool_calls or [])  # pyright: ignore[reportAttributeAccessIssue]
    answer_chars = len(second.choices[0].message.content or "")
    traj.reward = round(len(called) / 100 + answer_chars / 1000, 4)  # random text: the rewards differ
    return traj


async def _train_step(model: jm.TrainableModel, step: int) -> None:
    groups = [
        jm.TrajectoryGroup(_rollout(model, task) for _ in range(2))
        for task in (f"milk {step}", f"call mom {step}")
    ]
    gathered = await jm.gather_trajectory_groups(groups, pbar_desc=None)
    await model.train(gathered, config=jm.TrainConfig(learning_rate=1e-3))


class _Run:
    """The trained run, its backend and an event loop on a thread (the second step trains on it
    while the browser watches)."""

    def __init__(self, root: Path) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.backend = jm.LocalBackend(path=root)
        self.model = jm.TrainableModel(
            name="tiny", project="viewer", base_model=str(tiny_model_dir()), lora=jm.LoraConfig(r=4)
        )
        self.call(self.model.register(self.backend))
        self.run_dir = Path(self.model.run_dir)

    def call(self, coro: Any, timeout_s: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Run]:
    run = _Run(tmp_path_factory.mktemp("viewer-runs"))
    run.call(_train_step(run.model, 0))
    yield run
    run.close()


def _first_groups(run_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(x) for x in (run_dir / "trajectories" / "train" / "0000.jsonl").read_text().splitlines()
    ]


def _get(url: str, host: str | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={**({"Host": host} if host else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()) if "json" in r.headers["Content-Type"] else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()) if "json" in (e.headers["Content-Type"] or "") else None


def test_viewer_api_pages_a_run_and_refuses_bad_input(tmp_path: Path) -> None:
    """No browser, no model: a hand-written run of 30 groups with a torn last line (a writer mid-append)."""
    run = tmp_path / "proj" / "models" / "m"
    (run / "trajectories" / "train").mkdir(parents=True)
    group = {
        "trajectories": [
            {"messages_and_choices": [{"role": "user", "content": "hi"}], "reward": r}
            for r in (1.0, 0.0, 0.5)
        ]
    }
    lines = [json.dumps(group)] * 30
    (run / "trajectories" / "train" / "0000.jsonl").write_text("\n".join(lines) + "\n" + '{"trajectories": [')
    (run / "trajectories" / "train" / "0001.attempt-ab12.jsonl").write_text(lines[0] + "\n")
    (run / "history.jsonl").write_text(
        json.dumps({"step": 0, "split": "train", "train/loss": float("nan")}) + "\n"
    )
    server = ViewerServer([tmp_path]).start()
    try:
        status, runs = _get(server.url + "api/runs")
        assert status == 200 and [(r["project"], r["name"]) for r in runs] == [("proj", "m")]
        api = server.url + f"api/runs/{runs[0]['id']}/"
        assert _get(api + "history")[1] == [{"step": 0, "split": "train", "train/loss": None}]  # strict JSON
        steps = _get(api + "steps?split=train")[1]
        assert [(s["name"], s["status"]) for s in steps["items"]] == [
            ("0001.attempt-ab12", "attempt"),
            ("0000", "committed"),
        ]
        page = _get(api + "step/train/0000?offset=20&limit=20")[1]
        assert page["total_groups"] == 30 and [g["index"] for g in page["groups"]] == list(range(20, 30))
        advantages = [t["advantage"] for t in page["groups"][0]["trajectories"]]
        assert advantages == pytest.approx([1.2247, -1.2247, 0.0], abs=1e-4)  # (r - mean) / std
        assert _get(api + "trajectory/train/0000/29/2")[1]["reward"] == 0.5
        assert _get(api + "trajectory/train/0000/30/0")[0] == 400  # the torn line is not a group
        assert _get(api + "trajectory/train/0000/0/3")[0] == 400
        assert _get(api + "step/train/..%2F..%2Fetc")[0] == 404
        assert _get(api + "steps?split=train&limit=100000")[0] == 400
        assert _get(server.url + "api/runs/nope/history")[0] == 404
        assert _get(server.url + "..%2Fapi.py")[0] == 404
        assert _get(server.url + "api/runs", host="evil.example:80")[0] == 403  # DNS rebinding
    finally:
        server.close()


def test_viewer_shows_a_runs_spend_against_its_budget(tmp_path: Path) -> None:
    """Issue 57: the run's page shows its spend (spend.json, as the backend's Meter writes it) against
    each limit of its budget; a run with no spend.json, or a damaged one, shows none."""
    from journeyman.data.budget import Meter

    run = tmp_path / "proj" / "models" / "m"
    meter = Meter("m", run / "spend.json", jm.Budget(sampled_tokens=1000, judge_usd=2.0))
    meter.add(sampled_tokens=250, judge_usd=0.125, judge_tokens=900)
    meter.flush()
    (run / "history.jsonl").write_text(json.dumps({"step": 0, "split": "train"}) + "\n")
    other = tmp_path / "proj" / "models" / "n"
    other.mkdir(parents=True)
    (other / "history.jsonl").write_text(json.dumps({"step": 0, "split": "train"}) + "\n")
    (other / "spend.json").write_text('{"sampled_tokens": ')
    server = ViewerServer([tmp_path]).start()
    try:
        runs = {r["name"]: r for r in _get(server.url + "api/runs")[1]}
        assert runs["m"]["spend"].startswith(  # wall time: from the budget's start to the last write
            "sampled_tokens 250/1000 (25%), judge_usd 0.125/2 (6%), judge_tokens 900, wall_s "
        )
        assert runs["n"]["spend"] == ""
    finally:
        server.close()


def test_viewer_in_chromium(trained: _Run, chromium: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    from playwright.sync_api import expect, sync_playwright

    shots = tmp_path_factory.mktemp("viewer-shots")
    groups = _first_groups(trained.run_dir)
    # the best trajectory of group 0: the page sorts by reward, highest first
    traj = max(groups[0]["trajectories"], key=lambda t: t["reward"])
    call = traj["messages_and_choices"][2]["message"]["tool_calls"][0]["function"]
    records = [m["journeyman"] for m in traj["messages_and_choices"] if "journeyman" in m]
    sampled = sum(len(r["token_ids"]) for r in records)

    server = ViewerServer([trained.run_dir.parents[2]]).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url)
            page.locator("#runs tbody tr", has_text="tiny").click()  # runs -> the run
            expect(
                page.locator(".chart[data-title=reward] polyline, .chart[data-title=reward] circle").first
            ).to_be_visible()
            page.screenshot(path=shots / "run.png", full_page=True)
            expect(page.locator("#steps .step-row")).to_have_count(1)

            # live: an evaluation is logged while the page is open (a history row and a val file,
            # written by the backend as a training run writes them); its curve appears unreloaded
            val = [
                jm.TrajectoryGroup([jm.Trajectory.model_validate(t) for t in g["trajectories"]])
                for g in groups
            ]
            trained.call(trained.model.log(val, split="val"))
            expect(page.locator(".chart[data-title=reward] .legend")).to_contain_text(
                "val/reward", timeout=20_000
            )
            expect(page.locator(".tabs button", has_text="val")).to_be_visible()

            page.locator("#steps .step-row").first.click()  # the run -> step 0
            expect(page.locator(".group")).to_have_count(2)
            page.screenshot(path=shots / "step.png", full_page=True)
            page.locator(".group[data-group='0'] .traj-row").first.click()  # -> its best trajectory

            expect(page.locator("#reward")).to_have_text(f"{traj['reward']:.4f}")
            toolcall = page.locator(".toolcall").first
            expect(toolcall.locator(".fn")).to_have_text(call["name"])
            expect(toolcall.locator(".args")).to_contain_text(json.loads(call["arguments"])["title"])
            expect(page.locator(".msg.tool")).to_have_count(1)
            page.screenshot(path=shots / "trajectory.png", full_page=True)

            page.click("#tab-tokens")
            expect(page.locator(".tokens .trained")).to_have_count(sampled)
            masked = page.locator(".tokens .masked").count()
            assert masked > sampled  # system, user, tools and the tool's answer: all masked
            assert "background" in (page.locator(".tokens .trained").first.get_attribute("style") or "")
            page.screenshot(path=shots / "tokens.png", full_page=True)

            page.click("text=group: best vs worst")
            expect(page.locator(".compare .side")).to_have_count(2)
            page.screenshot(path=shots / "compare.png", full_page=True)
            assert not errors, errors
            browser.close()
    finally:
        server.close()
    print(f"viewer screenshots: {shots}")


def test_viewer_behind_serve_token(trained: _Run, chromium: str) -> None:
    """Under `journeyman serve` the same pages need a token of scope train: `?token=` once, then a cookie."""
    from journeyman.app.view.mount import add_viewer
    from journeyman.backends.server import create_app
    from journeyman.serving.endpoint import ServerThread
    from playwright.sync_api import expect, sync_playwright

    book = TokenBook(
        trained.run_dir.parents[2] / "viewer-tokens.json", admin_secret=secrets.token_urlsafe(16)
    )
    sample = book.add("agent", "sample")
    app = create_app(trained.backend, book, routes=lambda a: add_viewer(a, trained.backend.path))
    thread = ServerThread(Guard(app, book, DEFAULT_MAX_BODY_BYTES))
    url = f"http://127.0.0.1:{thread.port}/view/"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page()
            assert page.goto(url).status == 401  # pyright: ignore[reportOptionalMemberAccess]
            assert page.goto(url + f"?token={sample}").status == 403  # pyright: ignore[reportOptionalMemberAccess]
            page.goto(url + f"?token={book.add('reviewer', 'train')}")
            assert "token=" not in page.url  # moved into an HttpOnly cookie
            expect(page.locator("#runs tbody tr", has_text="tiny")).to_be_visible()
            assert page.evaluate("document.cookie") == ""
            browser.close()
    finally:
        thread.stop()


# -- hostile input: any JSON value in any field ------------------------------------------------------
MARKUP = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'
NAME_MARKUP = "<img src=x onerror=window.__pwned=1>"  # a directory name: no slash
HUGE_FLOAT = "<1e400>"  # written as the JSON number 1e400 (Python reads it as inf)
ODD_VALUES: list[Any] = [
    None,
    {},
    {"a": [1, {"b": None}]},
    [],
    [1, "x", None, {"k": []}],
    True,
    10**400,
    HUGE_FLOAT,
    1.7e308,  # finite, but its square is not
    float("nan"),
    -1.5,
    "",
    MARKUP,
]


def _dumps(x: Any) -> str:
    return json.dumps(x).replace(json.dumps(HUGE_FLOAT), "1e400")


def _hostile_group() -> dict[str, Any]:
    """A group as a run writes it, every field the viewer shows filled in."""
    traj = {
        "messages_and_choices": [
            {"role": "system", "content": "You manage a to-do list."},
            {"role": "user", "content": [{"type": "text", "text": "Add milk."}]},
            {
                "message": {
                    "role": "assistant",
                    "content": "ok",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"t": 1}'}}
                    ],
                },
                "finish_reason": "tool_calls",
                "index": 0,
                "journeyman": {
                    "prompt_token_ids": [1, 2],
                    "token_ids": [3, 4],
                    "logprobs": [-0.1, -2.0],
                    "step": 0,
                },
            },
            {"role": "tool", "tool_call_id": "c1", "content": "Error: no"},
        ],
        "reward": 0.5,
        "metrics": {"m": 1, MARKUP: 2},
        "metadata": {"ruler_explanation": "fine", MARKUP: "v"},
        "logs": ["a log line"],
        "error": {"type": "ValueError", "message": "bad", "traceback": "tb"},
        "tools": [{"type": "function", "function": {"name": "add"}}],
    }
    return {
        "trajectories": [traj, {"messages_and_choices": [], "reward": 0.0}],
        "exceptions": [{"type": "E", "message": "m"}],
        "dropped": [{}],
        "metadata": {"k": "v"},
    }


def _paths(x: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every node under `x` (dict keys and list indices), parents first."""
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else []
    for k, v in items:
        yield (*at, k)
        yield from _paths(v, (*at, k))


def _replace(x: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(x)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _leaves(x: Any, value: Any) -> Any:
    """`x` with every scalar in it (not the keys) replaced by `value`."""
    if isinstance(x, dict):
        return {k: _leaves(v, value) for k, v in x.items()}
    if isinstance(x, list):
        return [_leaves(v, value) for v in x]
    return value


def _write_run(run: Path, lines: list[str], state: dict[str, Any] | str, history: list[str]) -> None:
    (run / "trajectories" / "train").mkdir(parents=True)
    (run / "trajectories" / "train" / "0000.jsonl").write_text("\n".join(lines) + "\n")
    (run / "state.json").write_text(state if isinstance(state, str) else _dumps(state))
    (run / "history.jsonl").write_text("\n".join(history) + "\n")


def _hostile_history() -> list[str]:
    rows = [_dumps({"step": 0, "split": "train", "train/reward": 0.5, f"train/{MARKUP}": 1.0})]
    rows += [
        _dumps({"step": v, "split": v, "train/reward": v, "val/reward": v, "train/loss": v})
        for v in ODD_VALUES
    ]
    return [*rows, "[]", "null", '"x"', "[" * 100_000, '{"step": 1, "train/reward": 1e400}']


def _not_json(word: str) -> Any:
    raise AssertionError(f"{word} in an answer: not JSON")


def test_viewer_answers_any_json_value(tmp_path: Path) -> None:
    """Every field of a group, one at a time, holds each odd value (objects, arrays, nulls, huge
    numbers, NaN, markup); so does every line, state.json and history.jsonl: every route answers
    200 with strict JSON, none 500 or drops the connection."""
    from fastapi import FastAPI
    from journeyman.app.view.mount import add_viewer
    from journeyman.serving.endpoint import ServerThread

    base = _hostile_group()
    cases = [(path, v) for path in _paths(base) for v in ODD_VALUES]
    lines = [_dumps(_replace(base, path, v)) for path, v in cases] + [_dumps(v) for v in ODD_VALUES]
    run = tmp_path / "p" / "models" / "m"
    _write_run(run, lines, {"step": 1, "base_model": DEFAULT_BASE_MODEL}, _hostile_history())
    # state.json's fields too, one run each (base_model: also names no directory can have)
    for i, v in enumerate([*ODD_VALUES, "\x00", "~no_such_user_x/m", "m" * 5000]):
        _write_run(tmp_path / "s" / "models" / f"s{i}", [_dumps(base)], {"step": v, "base_model": v}, [])
    deep = "[" * 100_000  # nested past the parser's depth: that line is a 400 naming it, no crash
    _write_run(tmp_path / "s" / "models" / "deep", [_dumps(base), deep], deep, [deep])

    runs = RunFiles([tmp_path])

    def answer(path: str, query: str = "") -> tuple[int, Any]:
        res = handle(runs, path, query)
        assert res.status < 500, (path, query, res.body[:300])
        return res.status, json.loads(res.body, parse_constant=_not_json)  # strict: no NaN, no Infinity

    status, listed = answer("api/runs")
    assert status == 200 and len(listed) == 1 + len(ODD_VALUES) + 3 + 1
    main = next(r for r in listed if r["name"] == "m")
    assert main["latest"] == {"train/reward": -1.5, "val/reward": -1.5}  # the last finite ones
    for r in listed:
        api = f"api/runs/{r['id']}/"
        assert answer(api + "history")[0] == 200
        assert answer(api + "steps", "split=train")[0] == 200
        assert answer(api + "step/train/0000", "limit=1")[0] == 200
        assert answer(api + "trajectory/train/0000/0/0")[0] == 200
        if r["name"] == "deep":
            status, body = answer(api + "trajectory/train/0000/1/0")
            assert status == 400 and body["error"]["param"] == "0000.jsonl:2"
    api = f"api/runs/{main['id']}/"
    for offset in range(0, len(lines), 200):
        status, page = answer(api + "step/train/0000", f"offset={offset}&limit=200")
        assert status == 200 and len(page["groups"]) == min(200, len(lines) - offset)
    views = []
    for i in range(len(lines)):
        status, view = answer(api + f"trajectory/train/0000/{i}/0")
        assert status == 200, view
        views.append(view)

    # what a page then shows: the value's JSON text where text belongs, nothing lost
    obj = cases.index((("trajectories", 0, "metadata", "ruler_explanation"), {"a": [1, {"b": None}]}))
    assert views[obj]["ruler_explanation"] == '{"a": [1, {"b": null}]}'
    msg = cases.index((("trajectories", 0, "messages_and_choices", 3, "content"), [1, "x", None, {"k": []}]))
    assert views[msg]["messages"][3]["content"] == ""  # content parts without text: no text
    err = cases.index((("trajectories", 0, "error"), MARKUP))
    assert views[err]["error"] == {"type": "error", "message": MARKUP, "traceback": ""}
    meta = cases.index((("trajectories", 0, "metadata"), [1, "x", None, {"k": []}]))
    assert views[meta]["metadata"] == {"value": [1, "x", None, {"k": []}]}
    huge = cases.index(
        (("trajectories", 0, "messages_and_choices", 2, "journeyman", "token_ids", 0), 10**400)
    )
    assert views[huge]["rows"][0]["ids"] == [1, 2, 4]  # no such token: left out, the row still shown

    # issue 53's case over both servers: `journeyman view` answered by dropping the connection, serve 500
    viewer = ViewerServer([tmp_path]).start()
    book = TokenBook(tmp_path / "tokens.json", admin_secret=secrets.token_urlsafe(16))
    secret = book.add("reviewer", "train")
    app = FastAPI()
    add_viewer(app, tmp_path)
    served = ServerThread(Guard(app, book, DEFAULT_MAX_BODY_BYTES))
    try:
        route = api + f"trajectory/train/0000/{obj}/0"
        status, body = _get(viewer.url + route)
        assert status == 200 and body["ruler_explanation"] == '{"a": [1, {"b": null}]}'
        status, body = _get(
            f"http://127.0.0.1:{served.port}/view/{route}", headers={"Authorization": f"Bearer {secret}"}
        )
        assert status == 200 and body["ruler_explanation"] == '{"a": [1, {"b": null}]}'
        assert _get(viewer.url + "api/runs")[0] == 200  # a NaN reward in history.jsonl: strict JSON still
    finally:
        served.stop()
        viewer.close()


def test_viewer_renders_hostile_values_in_chromium(tmp_path: Path, chromium: str) -> None:
    """Markup, objects, arrays, nulls and huge numbers in every leaf of a group, in the names of the
    run's directories and in history.jsonl's keys: every page draws them as text, no script runs, no
    page error, no `[object ...]`."""
    from playwright.sync_api import expect, sync_playwright

    base = _hostile_group()
    groups = [_dumps(base)] + [_dumps(_leaves(base, v)) for v in ODD_VALUES]
    run = tmp_path / NAME_MARKUP / "models" / NAME_MARKUP
    _write_run(run, groups, {"step": 1, "base_model": MARKUP}, _hostile_history())
    server = ViewerServer([tmp_path]).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

            def shows(text: str) -> None:
                expect(page.locator("#main h1")).to_contain_text(text)
                body = page.locator("#main").inner_text()
                assert "[object " not in body and "Could not load" not in body, body[:2000]

            page.goto(server.url)
            shows("Runs")
            expect(page.locator("#runs tbody td").first).to_have_text(NAME_MARKUP)
            page.locator("#runs tbody tr").first.click()
            shows(f"{NAME_MARKUP}/{NAME_MARKUP}")
            expect(page.locator(".chart[data-title=reward] circle").first).to_be_visible()
            page.locator("#metric").select_option(f"train/{MARKUP}")
            expect(page.locator(f".chart[data-title='train/{MARKUP}'] circle")).to_have_count(1)
            page.locator("#steps .step-row").first.click()
            shows("train step 0")
            expect(page.locator(".group")).to_have_count(len(groups))
            run_id = page.evaluate("location.hash").split("/")[2]
            for g in range(len(groups)):
                page.evaluate(f"location.hash = '#/run/{run_id}/traj/train/0000/{g}/0'")
                shows(f"Trajectory 0 of group {g}")
            expect(page.locator(".ruler")).to_have_text(MARKUP)  # the last group: markup everywhere
            expect(page.locator(".msg pre").first).to_have_text(MARKUP)
            page.evaluate(f"location.hash = '#/run/{run_id}/traj/train/0000/0/0?view=tokens'")
            expect(page.locator(".tokens .trained")).to_have_count(2)
            page.evaluate(f"location.hash = '#/run/{run_id}/compare/train/0000/0'")
            shows("Group 0: best vs worst")
            expect(page.locator(".compare .side")).to_have_count(2)
            assert page.evaluate("window.__pwned") is None  # no script of the run's ran
            assert not errors, errors
            browser.close()
    finally:
        server.close()


class _OtherPort(BaseHTTPRequestHandler):
    """Another server on the host (another port): its page embeds `/view/x` from itself and frames
    the viewer; it records the cookies each request brings."""

    viewer_port = 0
    seen: ClassVar[list[tuple[str, str]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Cookie") or ""))
        body = b""
        if self.path == "/":
            viewer = f"http://127.0.0.1:{self.viewer_port}/view/"
            body = f'<img src="/view/x"><iframe src="{viewer}"></iframe>'.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_viewer_session_cookie_in_chromium(tmp_path: Path, chromium: str) -> None:
    """Under `serve` the viewer's cookie holds a session of its own, never the API token: a page on
    another port of the host receives it (cookies are not port-scoped), and it is worth nothing
    there: no API route takes it, the viewer refuses it from that page's frames, it ends with its
    token. The runs page shows each latest reward as a badge (issue 53: `[object HTMLSpanElement]`)."""
    from fastapi import FastAPI
    from journeyman.app.view.mount import add_viewer
    from journeyman.serving.endpoint import ServerThread
    from playwright.sync_api import expect, sync_playwright

    run = tmp_path / "p" / "models" / "m"
    history = [json.dumps({"step": 0, "split": "train", "train/reward": 0.5, "val/reward": 0.25})]
    _write_run(run, [json.dumps(_hostile_group())], {"step": 1}, history)
    book = TokenBook(tmp_path / "tokens.json", admin_secret=secrets.token_urlsafe(16))
    secret = book.add("reviewer", "train")
    app = FastAPI()
    add_viewer(app, tmp_path)
    served = ServerThread(Guard(app, book, DEFAULT_MAX_BODY_BYTES))
    url = f"http://127.0.0.1:{served.port}/view/"
    _OtherPort.viewer_port, _OtherPort.seen = served.port, []
    other = ThreadingHTTPServer(("127.0.0.1", 0), _OtherPort)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            context = browser.new_context()
            # a browser that still holds the cookie of old, the token itself: it opens nothing
            context.add_cookies(
                [{"name": "journeyman_token", "value": secret, "domain": "127.0.0.1", "path": "/view"}]
            )
            page = context.new_page()
            assert page.goto(url).status == 401  # pyright: ignore[reportOptionalMemberAccess]
            page.goto(url + f"?token={secret}")
            assert "token=" not in page.url
            expect(page.locator("#runs tbody tr", has_text="m")).to_be_visible()
            expect(page.locator("#runs tbody td").nth(4)).to_have_text("train/reward 0.500 val/reward 0.250")
            expect(page.locator("#runs tbody td").nth(4).locator(".badge")).to_have_count(2)
            cookies = context.cookies()
            assert len(cookies) == 1  # the old one cleared
            cookie: dict[str, Any] = dict(cookies[0])
            assert (
                cookie["name"] == VIEW_COOKIE and cookie["value"] != secret and secret not in cookie["value"]
            )
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/view"
            assert abs(cookie["expires"] - time.time() - VIEW_SESSION_MAX_S) < 120
            assert page.evaluate("document.cookie") == ""

            viewer_statuses: list[int] = []
            page.on("response", lambda r: viewer_statuses.append(r.status) if r.url == url else None)
            page.goto(f"http://127.0.0.1:{other.server_address[1]}/")
            deadline = time.monotonic() + 20
            while not (viewer_statuses and any(path == "/view/x" for path, _ in _OtherPort.seen)):
                assert time.monotonic() < deadline, (viewer_statuses, _OtherPort.seen)
                page.wait_for_timeout(100)
            leaked = next(c for path, c in _OtherPort.seen if path == "/view/x")
            assert leaked == f"{VIEW_COOKIE}={cookie['value']}"  # what the other port gets: no token
            assert viewer_statuses == [401]  # its frame of the viewer: same-site, not same-origin
            assert (
                _get(
                    f"http://127.0.0.1:{served.port}/v1/models",
                    headers={"Authorization": f"Bearer {cookie['value']}"},
                )[0]
                == 401
            )

            assert page.goto(url).status == 200  # pyright: ignore[reportOptionalMemberAccess]
            book.revoke("reviewer")  # revoking the token ends its sessions
            assert page.goto(url).status == 401  # pyright: ignore[reportOptionalMemberAccess]
            browser.close()
    finally:
        other.shutdown()
        served.stop()


def test_view_sessions_end(tmp_path: Path) -> None:
    """A session ends idle, at its age limit, when its token is revoked, or pushed out by newer ones."""
    book = TokenBook(tmp_path / "tokens.json", admin_secret=secrets.token_urlsafe(16))
    book.add("reviewer", "train")
    token = book.tokens()[1]
    sessions = ViewSessions(idle_s=1.0, max_s=2.0, max_sessions=2)
    first, idle, busy = sessions.open(token), sessions.open(token), sessions.open(token)
    assert sessions.token(first, book) is None and len(sessions) == 2  # the least recently used went
    for _ in range(4):  # 1.4 s, used every 0.35 s: sliding
        time.sleep(0.35)
        assert sessions.token(busy, book) == token
    assert sessions.token(idle, book) is None  # unused for over 1 s
    time.sleep(2.1 - 1.4)
    assert sessions.token(busy, book) is None  # over 2 s old, however busy
    fresh = sessions.open(token)
    assert sessions.token(fresh, book) == token
    book.revoke("reviewer")
    assert sessions.token(fresh, book) is None
    assert sessions.token("not-a-session", book) is None
