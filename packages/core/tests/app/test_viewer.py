"""The run viewer in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright
through its own executable, never a downloaded build) on a run this module trains.

The run: a random-weight 2-layer Llama beside the embedded model's tokenizer, on a LocalBackend
(the real engine, endpoint, grammar, trainer and run store, no 135M weights): each rollout makes a
forced `add_task` call, gets the tool's answer (an error for an empty title), and answers. One step
trains before the browser opens; while the page is open the model logs an evaluation (a history row
and a val trajectories file, through the backend), and the page shows it without a reload. Screenshots of every page go to `<pytest tmp>/viewer-shots/` (printed).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from _support import function_tool, tiny_model_dir
from journeyman.app.view.server import ViewerServer

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


def _get(url: str, host: str | None = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Host": host} if host else {})
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
    from journeyman.serving.api_tokens import TokenBook
    from journeyman.serving.endpoint import ServerThread
    from journeyman.serving.guard import DEFAULT_MAX_BODY_BYTES, Guard
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
