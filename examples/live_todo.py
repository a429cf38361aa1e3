"""Live training: a population of simulated users on the to-do task, and a model that learns from them.

Users (`--users` at a time) send to-do requests (`todo_task.py`'s training tasks) to the served model
through its OpenAI endpoint, each request marked as one episode (`model.episode()`: the header
`x-journeyman-capture`). The list's end state says whether the task was done; that outcome reaches
the server later, after a random delay (`--max-delay-s`), and for some episodes never
(`--missing`). Nobody calls `train`: once `--episodes-per-step` scored episodes wait, a candidate
trains in the background from the promoted step, the gate evaluates it on held-out tasks
(`name@<candidate>`, greedy or at `--eval-temperature`) while the users stay on the promoted step,
and it is promoted only if it is not worse than the best promoted step so far (`--against`). A
promoted step whose live rewards fall well below its parent's is rolled back.

`--poison-from A --poison-to B` inverts the rewards the users report between those fractions of
the run (a broken reward pipeline): candidates trained on it should fail the gate, or the rollback
fire. The served success rate over time (rolling mean), with every decision marked, goes to `--plot`.

    uv run python examples/live_todo.py --plot docs/live.png
    uv run python examples/live_todo.py --poison-from 0.3 --poison-to 0.6 --plot docs/live-poisoned.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import journeyman as jm
from todo_task import INSTRUCTIONS, TOOL_FUNCTIONS, Scenario, load_scenarios

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": f.__name__,
            "description": (f.__doc__ or "").strip(),
            "parameters": {
                "type": "object",
                "properties": {}
                if f.__name__ == "list_tasks"
                else {"title": {"type": "string", "maxLength": 32}},
                "required": [] if f.__name__ == "list_tasks" else ["title"],
            },
        },
    }
    for f in TOOL_FUNCTIONS
]


@dataclass
class Served:
    """One user episode as the user saw it."""

    at: float  # seconds since the start
    step: int  # the step that served it
    success: bool
    poisoned: bool  # its reward was inverted


async def attempt(
    model: jm.TrainableModel, s: Scenario, name: str, temperature: float, seed: int | None = None
) -> tuple[bool, int]:
    """One request (a forced tool call), the tool calls run on a fresh list: (task done?, serving step).
    A seed makes the sample reproducible (the users' runs are, from `--seed`)."""
    todo = s.fresh_list()
    out = await model.openai_client().chat.completions.create(
        model=name,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": s.task}],
        tools=TOOLS,  # pyright: ignore[reportArgumentType]
        tool_choice="required",
        max_tokens=64,
        temperature=temperature,
        seed=seed,
    )
    for call in out.choices[0].message.tool_calls or []:
        fn = call.function  # pyright: ignore[reportAttributeAccessIssue]
        try:
            arguments = json.loads(fn.arguments or "{}")
        except json.JSONDecodeError:
            arguments = {}
        if fn.name in {t["function"]["name"] for t in TOOLS} and isinstance(arguments, dict):
            try:
                todo.call(fn.name, arguments)
            except TypeError:  # arguments the tool does not take
                todo.refused += 1
    return s.passed(todo), int(out.model.rsplit("@", 1)[1])


class Population:
    """The users: each asks, then (maybe, later) reports how it went."""

    def __init__(self, model: jm.TrainableModel, args: argparse.Namespace, tasks: list[Scenario]) -> None:
        self.model, self.args, self.tasks = model, args, tasks
        self.rng = random.Random(args.seed)
        self.served: list[Served] = []
        self.reports: set[asyncio.Task[None]] = set()
        self.t0 = time.monotonic()
        self.started = 0
        self.missing = 0

    def poisoned(self) -> bool:
        frac = self.started / self.args.episodes  # of the episodes asked for
        return self.args.poison_from <= frac < self.args.poison_to

    async def user(self) -> None:
        while self.started < self.args.episodes and time.monotonic() - self.t0 < self.args.max_minutes * 60:
            self.started += 1
            s, eid, seed = self.rng.choice(self.tasks), uuid.uuid4().hex, self.rng.randrange(1 << 31)
            poisoned = self.poisoned()
            with self.model.episode(eid):
                success, step = await attempt(self.model, s, self.model.name, self.args.temperature, seed)
            self.served.append(Served(time.monotonic() - self.t0, step, success, poisoned))
            if self.rng.random() < self.args.missing:
                self.missing += 1  # this user never says: the episode expires, counted
                continue
            reward = 1.0 - float(success) if poisoned else float(success)
            delay = self.rng.uniform(0, self.args.max_delay_s)
            task = asyncio.create_task(self.report(eid, reward, delay))
            self.reports.add(task)
            task.add_done_callback(self.reports.discard)

    async def report(self, eid: str, reward: float, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.model.report_outcome(eid, reward)


def held_out_eval(model: jm.TrainableModel, tasks: list[Scenario], temperature: float, samples: int) -> Any:
    async def evaluate(name: str) -> float:  # `samples` requests per task, on the step `name` names
        # the same seeds for every step evaluated: the candidate and the step it is compared with
        # draw alike wherever their policies agree, so the gate sees their difference, not the dice.
        # All at once: the engine runs them back to back after one drain of the users' rows.
        runs = [attempt(model, s, name, temperature, seed=k) for s in tasks for k in range(samples)]
        done = await asyncio.gather(*runs)
        return sum(ok for ok, _ in done) / len(done)

    return evaluate


def rolling(served: list[Served], window: int) -> list[tuple[float, float]]:
    out = []
    for i in range(window, len(served) + 1):
        chunk = served[i - window : i]
        out.append((chunk[-1].at, sum(s.success for s in chunk) / window))
    return out


def plot(
    path: Path, served: list[Served], decisions: list[tuple[float, str]], args: argparse.Namespace
) -> None:
    """The served success rate over time (rolling mean), the poisoned stretch shaded, each decision marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    curve = rolling(served, args.window)
    if curve:
        label = f"served success (last {args.window} episodes)"
        ax.plot([t for t, _ in curve], [r for _, r in curve], color="tab:blue", label=label)
    poisoned = [s.at for s in served if s.poisoned]
    if poisoned:
        ax.axvspan(min(poisoned), max(poisoned), color="tab:red", alpha=0.12, label="rewards inverted")
    marks = {"promote": ("tab:green", "^"), "reject": ("tab:red", "x"), "rollback": ("tab:orange", "v")}
    seen: set[str] = set()
    for at, decision in decisions:
        color, marker = marks[decision]
        ax.axvline(at, color=color, alpha=0.35, lw=1)
        ax.scatter([at], [1.03], color=color, marker=marker, label=None if decision in seen else decision)
        seen.add(decision)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("seconds since the users started")
    ax.set_ylabel("success rate of served episodes")
    ax.set_title("live training on the to-do task: outcomes late or never, a gate before anything serves")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


async def main(args: argparse.Namespace) -> None:
    train, held_out = load_scenarios("train"), load_scenarios("eval")[: args.eval_scenarios]
    async with jm.LocalBackend(path=args.path) as backend:
        model = jm.TrainableModel(name=args.name, project="live-example", max_tokens=64)
        await model.register(backend)
        t_register = time.monotonic()
        config = jm.LiveConfig(
            episodes_per_step=args.episodes_per_step,
            settle_s=0.5,
            episode_ttl_s=args.max_delay_s * 3 + 60,
            train=jm.TrainConfig(advantages="given", tis_cap=2.0, learning_rate=args.learning_rate),
            gate=jm.GateConfig(
                canary_share=0.0,
                margin=args.margin,
                against=args.against,
                rollback_episodes=args.rollback_episodes,
                rollback_drop=0.25,
            ),
        )
        evaluate = held_out_eval(model, held_out, args.eval_temperature, args.eval_samples)
        await model.live(config, evaluate=evaluate)
        users = Population(model, args, train)
        wall0 = time.time()  # the history's clock, at the users' start
        await asyncio.gather(*(users.user() for _ in range(args.users)))
        await asyncio.gather(*list(users.reports))
        # let the last full step train and its candidate be judged, then stop
        deadline = time.monotonic() + args.final_wait_s
        while time.monotonic() < deadline:
            status = await model.live_status()
            if status.candidate is None and status.episodes_waiting < args.episodes_per_step:
                break
            await asyncio.sleep(1)
        # off, after the step or decision under way (exiting in the middle of one would cut it off)
        status = await model.live(config.model_copy(update={"enabled": False}))
        history = await model.history()
        wall = time.monotonic() - t_register
    served = users.served
    n = len(served)
    k = max(1, n // 4)

    def rate(xs: list[Served]) -> str:
        p = sum(s.success for s in xs) / len(xs)
        return f"{p:.2f} ± {math.sqrt(p * (1 - p) / len(xs)):.2f} (n={len(xs)})"

    print(f"episodes served: {n}, outcomes never sent: {users.missing}, wall time {wall:.0f} s")
    print(f"served success: first quarter {rate(served[:k])} -> last quarter {rate(served[-k:])}")
    print(
        f"steps trained: {status.counts.get('steps', 0)}, promoted step now {status.promoted}, "
        f"latest checkpoint {status.latest}; expired episodes {status.counts.get('expired', 0)}"
    )
    decisions = [(r["recorded_at"] - wall0, r) for r in history if r.get("split") == "live"]
    for at, r in decisions:
        print(f"  {at:6.0f} s  {r['decision']:8s} step {r['step']} (parent {r.get('parent')}): {r['reason']}")
    if args.plot is not None:
        plot(args.plot, served, [(at, r["decision"]) for at, r in decisions], args)
        print(f"plot: {args.plot}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=8, help="users at a time")
    p.add_argument("--episodes", type=int, default=320, help="episodes in all")
    p.add_argument("--episodes-per-step", type=int, default=16)
    p.add_argument("--eval-scenarios", type=int, default=12, help="held-out tasks the gate evaluates on")
    p.add_argument(
        "--max-delay-s", type=float, default=20.0, help="outcomes arrive after 0..this many seconds"
    )
    p.add_argument("--missing", type=float, default=0.1, help="share of users who never report")
    p.add_argument(
        "--poison-from", type=float, default=0.0, help="fraction of the run where inverted rewards start"
    )
    p.add_argument("--poison-to", type=float, default=0.0, help="... and end")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--rollback-episodes", type=int, default=24)
    p.add_argument(
        "--margin",
        type=float,
        default=0.0,
        help="how much worse on the held-out tasks a candidate may score and pass",
    )
    p.add_argument(
        "--against",
        choices=["promoted", "best"],
        default="best",
        help="the gate compares a candidate with the promoted step, or with the best promoted eval so far",
    )
    p.add_argument(
        "--eval-temperature",
        type=float,
        default=0.0,
        help="the gate's sampling temperature (the users' --temperature evaluates what they are served)",
    )
    p.add_argument("--eval-samples", type=int, default=1, help="the gate's requests per held-out task")
    p.add_argument("--window", type=int, default=32, help="episodes in the plotted rolling mean")
    p.add_argument("--final-wait-s", type=float, default=120.0)
    p.add_argument("--max-minutes", type=float, default=30.0, help="users stop starting episodes after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="live-todo")
    p.add_argument("--path", default=".journeyman-examples")
    p.add_argument("--plot", type=Path, default=None)
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
