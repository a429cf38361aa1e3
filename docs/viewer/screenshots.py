"""Screenshots of every page of the run viewer on a run directory, in the system's Chromium.

    uv run python docs/viewer/screenshots.py RUN_ROOT OUT_PREFIX [--split train] [--step 0000]

writes OUT_PREFIX-runs.png, -run.png, -step.png, -trajectory.png, -tokens.png, -compare.png. The
trajectory shown is the best of the first group whose runs called a tool (else of group 0).
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from journeyman.app.view.server import ViewerServer
from playwright.sync_api import sync_playwright


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("out", help="path prefix of the PNG files")
    ap.add_argument("--split", default="train", help="(the run's first split if it has no such split)")
    ap.add_argument("--step", default=None, help="trajectories file name (default: the newest)")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    server = ViewerServer([args.root]).start()
    try:
        run = _get(server.url + "api/runs")[0]
        rid = run["id"]
        if args.split not in run["splits"]:  # a run still in its first evaluation has only `val`
            args.split = run["splits"][0]
        steps = _get(server.url + f"api/runs/{rid}/steps?split={args.split}&limit=200")["items"]
        name = args.step or next(s["name"] for s in steps if s["status"] == "committed")
        groups = _get(server.url + f"api/runs/{rid}/step/{args.split}/{name}?limit=200")["groups"]
        # the group with the widest reward spread, one whose runs called a tool first
        group = max(groups, key=lambda g: (any(t["tool_calls"] for t in g["trajectories"]), g["reward_std"]))
        best = max(group["trajectories"], key=lambda t: t["reward"])["index"]
        base = f"{server.url}#/run/{rid}"
        pages = [
            ("runs", server.url, "#runs"),
            ("run", base + f"?split={args.split}", "#steps"),
            ("step", base + f"/step/{args.split}/{name}", ".group"),
            ("trajectory", base + f"/traj/{args.split}/{name}/{group['index']}/{best}", ".conversation"),
            ("tokens", base + f"/traj/{args.split}/{name}/{group['index']}/{best}?view=tokens", ".tokens"),
            ("compare", base + f"/compare/{args.split}/{name}/{group['index']}", ".compare"),
        ]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            for label, url, ready in pages:
                page.goto(url)
                page.wait_for_selector(ready)
                page.wait_for_timeout(300)
                out = f"{args.out}-{label}.png"
                page.screenshot(path=out, full_page=label != "run")
                print(out)
            browser.close()
    finally:
        server.close()


if __name__ == "__main__":
    main()
