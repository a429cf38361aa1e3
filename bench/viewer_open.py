"""How long `journeyman view` takes to show its first page of a big run: 200 steps x 32 trajectories
(8 groups of 4), each a three-turn tool run with token records (~64 MB of trajectories).

Generates the run in a temporary directory, starts the viewer on 127.0.0.1 (a thread of this
process, the real HTTP server), and times what a browser fetches for each page over HTTP:

  first page     index.html, app.js, style.css, api/runs, the run's history and its newest steps
  step page      the groups of one step (the file's lines indexed, 20 groups parsed)
  trajectory     one trajectory with its token rows

The baseline, measured in the same run: reading the whole run the way a viewer that loads
everything would (every trajectories file parsed with `read_trajectories`).

    uv run python bench/viewer_open.py [--steps 200] [--groups 8] [--group-size 4]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import urllib.request
from pathlib import Path

from journeyman.app.view.server import ViewerServer
from journeyman.data.trajectory_file import read_trajectories

PROMPT_TOKENS, SAMPLED_TOKENS = 300, 40


def _choice(rng: random.Random, prompt_len: int, content: str, tool: bool, step: int) -> dict:
    message: dict = {"role": "assistant", "content": None if tool else content}
    if tool:
        message["tool_calls"] = [
            {
                "id": f"call_{rng.randrange(10**8)}",
                "type": "function",
                "function": {"name": "add_task", "arguments": json.dumps({"title": content})},
            }
        ]
    return {
        "index": 0,
        "finish_reason": "tool_calls" if tool else "stop",
        "message": message,
        "journeyman": {
            "prompt_token_ids": [rng.randrange(49000) for _ in range(prompt_len)],
            "token_ids": [rng.randrange(49000) for _ in range(SAMPLED_TOKENS)],
            "logprobs": [-rng.random() * 3 for _ in range(SAMPLED_TOKENS)],
            "model": "bench@0",
            "step": step,
            "finish_reason": "tool_calls" if tool else "stop",
        },
    }


def _trajectory(rng: random.Random, step: int) -> dict:
    msgs: list[dict] = [
        {"role": "system", "content": "You manage the user's to-do list with your tools."},
        {"role": "user", "content": "Add 'buy milk' and then 'call mom'."},
    ]
    prompt = PROMPT_TOKENS
    for turn in range(3):
        last = turn == 2
        msgs.append(_choice(rng, prompt, "Done." if last else f"task {turn}", not last, step))
        if not last:
            msgs.append({"role": "tool", "tool_call_id": "call", "content": f"Added 'task {turn}'."})
        prompt += SAMPLED_TOKENS + 12
    return {
        "messages_and_choices": msgs,
        "tools": None,
        "reward": round(rng.random(), 3),
        "metrics": {"calls": 2},
        "metadata": {},
        "logs": [],
        "additional_histories": [],
        "error": None,
    }


def make_run(root: Path, steps: int, groups: int, group_size: int) -> Path:
    run = root / "bench" / "models" / "big"
    (run / "trajectories" / "train").mkdir(parents=True)
    rng = random.Random(0)
    # one group's text reused with other rewards: generating 6,400 random trajectories is slow
    template = [[_trajectory(rng, 0) for _ in range(group_size)] for _ in range(groups)]
    history = []
    for step in range(steps):
        lines = []
        for g in template:
            for t in g:
                t["reward"] = round(rng.random(), 3)
            lines.append(json.dumps({"trajectories": g, "exceptions": [], "dropped": [], "metadata": {}}))
        (run / "trajectories" / "train" / f"{step:04d}.jsonl").write_text("\n".join(lines) + "\n")
        history.append(
            {"step": step, "split": "train", "train/reward": rng.random(), "train/loss": rng.random()}
        )
    (run / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    (run / "state.json").write_text(json.dumps({"step": steps, "base_model": "none"}))
    return run


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp), args.steps, args.groups, args.group_size)
        size = sum(f.stat().st_size for f in run.rglob("*.jsonl"))
        print(
            f"run: {args.steps} steps x {args.groups * args.group_size} trajectories, {size / 2**20:.0f} MiB"
        )

        server = ViewerServer([Path(tmp)]).start()
        try:
            t0 = time.perf_counter()
            for page in ("", "app.js", "style.css"):
                _get(server.url + page)
            runs = json.loads(_get(server.url + "api/runs"))
            rid = runs[0]["id"]
            _get(server.url + f"api/runs/{rid}/history")
            _get(server.url + f"api/runs/{rid}/steps?split=train&offset=0&limit=25")
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            _get(server.url + f"api/runs/{rid}/step/train/0100?offset=0&limit=20")
            step = time.perf_counter() - t0
            t0 = time.perf_counter()
            _get(server.url + f"api/runs/{rid}/trajectory/train/0100/3/2")
            traj = time.perf_counter() - t0
        finally:
            server.close()

        t0 = time.perf_counter()
        n = sum(len(read_trajectories(f)) for f in sorted((run / "trajectories" / "train").iterdir()))
        whole = time.perf_counter() - t0

    print(f"first page (html, js, css, runs, history, 25 newest steps): {first:.3f} s")
    print(f"a step's groups page:                                       {step:.3f} s")
    print(f"one trajectory with its tokens:                             {traj:.3f} s")
    print(f"baseline, reading the whole run ({n} trajectories):         {whole:.3f} s")
    print(f"first page vs baseline: {whole / first:.0f}x faster; under 2 s: {'yes' if first < 2 else 'NO'}")


if __name__ == "__main__":
    main()
