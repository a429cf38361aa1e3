"""The to-do task the examples learn on: a list, four tools, scenarios with a checkable end state.

Shared by `mcp_todo_server.py` (the list behind an MCP server), `langgraph_train.py` and
`agents_sdk_train.py` (the list as in-process tools of one episode; `train_and_report`, their run
on `jm.TrainLoop`). The scenarios are
`mcp_todo_scenarios.json`: 72 training tasks and 24 held out, on titles never seen in training.
Each has `setup` calls that put the list in a known state and `checks` that read it after the
episode, so success is the list's real end state, not a judge's opinion.

The embedded 135M model starts weak here (greedy held-out success about 0.2: it adds when asked to
remove, or names the task wrong), which is what makes it a task to learn on.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

if TYPE_CHECKING:  # the MCP server imports this module too: it needs no journeyman
    import journeyman as jm

SCENARIOS_FILE = Path(__file__).with_name("mcp_todo_scenarios.json")
Title = Annotated[str, Field(max_length=32)]
"""A tool's title argument. The cap (the longest scenario title has 22 characters) reaches the
endpoint's grammar as the schema's maxLength: a forced call then fits in 64 tokens (21 before the
title, 9 after) instead of a made-up title at temperature 0.7 running it past `max_tokens`."""
INSTRUCTIONS = "You manage the user's to-do list with your tools. Tasks are identified by their title."


class TodoError(Exception):
    """A tool call the list refuses (no such task, an empty title): the model sees the message."""


def normalize(title: str) -> str:
    return " ".join(title.strip().split()).lower()


@dataclass
class TodoList:
    """title -> done. The four tool functions return what the tool says to the model."""

    tasks: dict[str, bool] = field(default_factory=dict)
    calls: int = 0  # tool calls the agent made (`call`)
    refused: int = 0  # of which the list refused

    def add_task(self, title: str) -> str:
        key = normalize(title)
        if not key:
            raise TodoError("title must not be empty")
        if key in self.tasks:
            return f"'{key}' is already on the list."
        self.tasks[key] = False
        return f"Added '{key}'."

    def list_tasks(self) -> str:
        if not self.tasks:
            return "The list is empty."
        return "\n".join(f"- {t} ({'done' if d else 'open'})" for t, d in self.tasks.items())

    def mark_done(self, title: str) -> str:
        key = normalize(title)
        if key not in self.tasks:
            raise TodoError(f"no task titled '{key}'; the list has {sorted(self.tasks) or 'nothing'}")
        self.tasks[key] = True
        return f"Marked '{key}' as done."

    def remove_task(self, title: str) -> str:
        key = normalize(title)
        if key not in self.tasks:
            raise TodoError(f"no task titled '{key}'")
        del self.tasks[key]
        return f"Removed '{key}'."

    def call(self, tool: str, arguments: dict[str, Any]) -> str:
        """The agent's call of a tool by name, counted; a refusal comes back as the tool's text."""
        self.calls += 1
        try:
            return self.run(tool, arguments)
        except TodoError as e:
            self.refused += 1
            return f"Error: {e}"

    def run(self, tool: str, arguments: dict[str, Any]) -> str:
        """A tool by name, as a scenario's setup and checks name them (not counted)."""
        return getattr(self, tool)(**arguments)


# -- the list as an agent's tools, for one episode at a time ------------------------------------------

EPISODE: ContextVar[TodoList] = ContextVar("todo_list")
"""The list of the episode running in this task (and the tasks it starts): set it before the run."""


def add_task(title: Title) -> str:
    """Add a new open task with this title to the to-do list."""
    return EPISODE.get().call("add_task", {"title": title})


def list_tasks() -> str:
    """List every task on the to-do list with its status (open or done)."""
    return EPISODE.get().call("list_tasks", {})


def mark_done(title: Title) -> str:
    """Mark the task with this title as done."""
    return EPISODE.get().call("mark_done", {"title": title})


def remove_task(title: Title) -> str:
    """Delete the task with this title from the to-do list."""
    return EPISODE.get().call("remove_task", {"title": title})


TOOL_FUNCTIONS = [add_task, list_tasks, mark_done, remove_task]
"""Plain functions: wrap them as your framework's tools (LangChain `tool`, Agents SDK `function_tool`)."""


@dataclass(frozen=True)
class Scenario:
    id: str
    task: str
    setup: list[dict[str, Any]]
    checks: list[dict[str, Any]]

    def fresh_list(self) -> TodoList:
        """A list in the state the task starts from."""
        todo = TodoList()
        for c in self.setup:
            with contextlib.suppress(TodoError):  # e.g. removing a task that is not there
                todo.run(c["tool"], c["arguments"])
        return todo

    def passed(self, todo: TodoList) -> bool:
        """The end state is what the task asked for (the same checks mcp-rl runs on the server)."""
        for c in self.checks:
            seen = todo.run(c["tool"], c["arguments"]).lower()
            if not all(s.lower() in seen for s in c.get("expect_contains", [])):
                return False
            if any(s.lower() in seen for s in c.get("expect_absent", [])):
                return False
        return True


def load_scenarios(split: str) -> list[Scenario]:
    """The "train" or "eval" scenarios of mcp_todo_scenarios.json."""
    data = json.loads(SCENARIOS_FILE.read_text())
    return [Scenario(s["id"], s["task"], s["setup"], s["checks"]) for s in data[split]]


def held_out_report(before: dict[str, bool], after: dict[str, bool]) -> str:
    """Held-out success before -> after (mean ± standard error), and the paired view: tasks that
    went from failed to done and back, with an exact two-sided sign test on those."""

    def mean_se(xs: list[bool]) -> tuple[float, float]:
        p = sum(xs) / len(xs)
        return p, math.sqrt(p * (1 - p) / len(xs))

    ids = sorted(before)
    (b, b_se), (a, a_se) = mean_se([before[i] for i in ids]), mean_se([after[i] for i in ids])
    fixed = sum(after[i] and not before[i] for i in ids)
    broken = sum(before[i] and not after[i] for i in ids)
    n = fixed + broken
    # P(a split at least this uneven) under "training changed nothing": each change is a fair coin
    p = min(1.0, 2 * sum(math.comb(n, k) for k in range(min(fixed, broken) + 1)) / 2**n) if n else 1.0
    gain_se = math.sqrt(b_se**2 + a_se**2)
    gain = f"{(a - b) / gain_se:+.1f} SE" if gain_se else "n/a"
    return (
        f"held-out success ({len(ids)} tasks, greedy): {b:.2f} ± {b_se:.2f} -> {a:.2f} ± {a_se:.2f} ({gain}); "
        f"{fixed} tasks fixed, {broken} broken (sign test p = {p:.3f})"
    )


async def train_and_report(
    loop: jm.TrainLoop[Scenario],
    greedy: Callable[[Scenario], Awaitable[jm.Trajectory]],
    eval_scenarios: int,
    steps: int,
) -> None:
    """The LangGraph and Agents SDK examples' run: held-out success (one `greedy` rollout of each of
    the first `eval_scenarios` held-out tasks, every phrasing) before and after `steps` steps of
    `loop`, a line per step, the paired report, the reward plot."""
    from journeyman.integrations import plot_history

    model, held_out = loop.model, every_phrasing(load_scenarios("eval"))[:eval_scenarios]

    async def evaluate() -> dict[str, bool]:
        groups, m = await loop.evaluate(held_out, greedy)
        print(f"step {await model.get_step()}: val success {m['success']:.3f}, val reward {m['reward']:.3f}")
        return {
            s.id: bool(g.trajectories[0].metrics["success"]) for s, g in zip(held_out, groups, strict=True)
        }

    before = await evaluate()
    async for s in loop.steps(steps):
        print(
            f"step {s.step} -> {s.result.step}: success {s.mean('success'):.3f} over {s.rollouts} rollouts "
            f"(rollouts {s.rollout_seconds:.0f} s, train {s.train_seconds:.0f} s, skipped={s.result.skipped})"
        )
    after = await evaluate()
    print(held_out_report(before, after))
    png = plot_history(await model.history(), model.run_dir / "reward.png", title=model.name)
    print(f"reward plot: {png}")
    print(f"run directory: {model.run_dir}")


# -- writing the scenarios file -----------------------------------------------------------------------

TITLES = [
    "buy milk",
    "pay rent",
    "call mom",
    "water the plants",
    "book a dentist visit",
    "renew passport",
    "clean the garage",
    "send the invoice",
    "fix the bike",
    "walk the dog",
    "order printer ink",
    "return library books",
    "plan the trip",
    "update the resume",
    "cancel the gym plan",
    "bake bread",
    "wash the car",
    "pick up the parcel",
    "backup the laptop",
    "write a thank you note",
    "feed the cat",
    "paint the fence",
    "file the taxes",
    "buy a birthday gift",
    "mow the lawn",
    "charge the camera",
    "sort the photos",
    "repair the roof",
    "book the flights",
    "read the contract",
    "empty the dishwasher",
    "visit grandma",
]
ADD = [
    "Add '{t}' to my to-do list.",
    "Put '{t}' on my list of tasks.",
    "I need to remember to {t}: add it as a task.",
]
DONE = [
    "Mark '{t}' as done.",
    "I finished '{t}'. Mark it done on my list.",
    "Check off '{t}' on my to-do list.",
]
REMOVE = [
    "Remove '{t}' from my to-do list.",
    "Delete the task '{t}'.",
    "Take '{t}' off my list, I no longer need it.",
]


PHRASINGS = {"add": ADD, "done": DONE, "remove": REMOVE}


def every_phrasing(scenarios: list[Scenario]) -> list[Scenario]:
    """Each scenario asked in each of its kind's phrasings (same setup and checks): 3x the held-out
    tasks for the examples' paired before/after, at no cost in new titles. The stored phrasing keeps
    its id; the others get `<id>/<n>`."""
    out: list[Scenario] = []
    for s in scenarios:
        kind, _, slug = s.id.partition("-")
        title = slug.replace("-", " ")
        for n, phrasing in enumerate(PHRASINGS[kind]):
            task = phrasing.format(t=title)
            out.append(Scenario(s.id if task == s.task else f"{s.id}/{n}", task, s.setup, s.checks))
    return out


def scenario(kind: str, title: str, rng: random.Random) -> dict[str, object]:
    listing = {"tool": "list_tasks", "arguments": {}}
    if kind == "add":
        task = rng.choice(ADD).format(t=title)
        setup = [{"tool": "remove_task", "arguments": {"title": title}}]
        checks = [{**listing, "expect_contains": [title]}]
        tools = ["add_task"]
    elif kind == "done":
        task = rng.choice(DONE).format(t=title)
        setup = [
            {"tool": "remove_task", "arguments": {"title": title}},
            {"tool": "add_task", "arguments": {"title": title}},
        ]
        checks = [{**listing, "expect_contains": [f"{title} (done)"]}]
        tools = ["mark_done"]
    else:
        task = rng.choice(REMOVE).format(t=title)
        setup = [{"tool": "add_task", "arguments": {"title": title}}]
        checks = [{**listing, "expect_absent": [title]}]
        tools = ["remove_task"]
    sid = f"{kind}-{title.replace(' ', '-')}"
    return {"id": sid, "task": task, "difficulty": 1, "tools": tools, "setup": setup, "checks": checks}


def write_scenarios(path: Path, num_eval_titles: int = 8, seed: int = 0) -> None:
    """Every title x {add, done, remove}; the eval split uses titles never seen in training."""
    rng = random.Random(seed)
    titles = list(TITLES)
    rng.shuffle(titles)
    eval_titles, train_titles = titles[:num_eval_titles], titles[num_eval_titles:]
    kinds = ["add", "done", "remove"]
    data = {
        "server": "python examples/mcp_todo_server.py",
        "tools": ["add_task", "list_tasks", "mark_done", "remove_task"],
        "train": [scenario(k, t, rng) for t in train_titles for k in kinds],
        "eval": [scenario(k, t, rng) for t in eval_titles for k in kinds],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


__all__ = [
    "EPISODE",
    "INSTRUCTIONS",
    "TOOL_FUNCTIONS",
    "Scenario",
    "Title",
    "TodoError",
    "TodoList",
    "every_phrasing",
    "held_out_report",
    "load_scenarios",
    "write_scenarios",
]
