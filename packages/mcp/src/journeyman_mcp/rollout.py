"""One multi-turn tool-use episode of the policy against the real MCP server → a Trajectory.

The policy sees the task, the server's tools and a `complete_task` tool. The loop holds every
completion itself (the endpoint's exact token record rides on its Choice), so it `record`s each call
on an `Episode` (`journeyman.integrations`), which joins them into the trajectory by core's one rule: a
tool loop is one history, anything that does not continue it (should the endpoint's splice ever
fail) a history of its own, never silently merged. Tool results the model never read (those of its
last turn) follow the main history, for the judge.
Tool errors, bad arguments and timeouts go back to the model as tool results; only a server that
goes away fails the rollout.

The embedded 135M model almost never calls a tool on its own, so the first `forced_turns` turns use
`tool_choice="required"` (the endpoint then decodes exactly one well-formed call of a listed tool);
later turns are free.

Success is the scenario's end-state checks when it has them (run on the same session after the
episode), else the proxy "every tool the task names was called without error".
"""

from __future__ import annotations

import functools
import json
from typing import Any

import journeyman as jm
from journeyman.integrations import Episode, message_of_choice
from openai import BadRequestError
from pydantic import BaseModel, Field

from .scenarios import Check, Scenario
from .server import Connection, ServerInfo

COMPLETE_TASK = "complete_task"

COMPLETE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": COMPLETE_TASK,
        "description": "Call this once the task is done, with a one-sentence summary of the result.",
        "parameters": {
            "type": "object",
            "properties": {"summary": {"type": "string", "maxLength": 80}},
            "required": ["summary"],
        },
    },
}


def system_prompt(info: ServerInfo) -> str:
    extra = f" {info.instructions.strip()[:400]}" if info.instructions else ""
    return (
        f"You are an agent that uses the tools of the MCP server {info.name!r}.{extra} Call tools to do "
        f"the user's task, read their results, then call {COMPLETE_TASK} with a short summary."
    )


class RolloutConfig(BaseModel):
    length_penalty: float = Field(
        default=0.02,
        ge=0,
        description="minus this x the mean fraction of max_tokens each turn used: concise turns win ties, "
        "so a group whose rollouts all succeed (or all fail) still carries a signal",
    )
    max_turns: int = Field(default=3, ge=1, description="model turns per episode")
    forced_turns: int = Field(
        default=1, ge=0, description="first turns that must be a tool call (tool_choice=required)"
    )
    max_tokens: int = Field(default=96, ge=8, description="max_tokens per model turn")
    temperature: float = Field(
        default=1.0,
        ge=0,
        le=2,
        description="sampling temperature of training rollouts and sampled evaluation",
    )
    tool_timeout: float = Field(default=30.0, gt=0, description="seconds per tool call")
    tool_result_chars: int = Field(
        default=1200, ge=50, description="longer tool results are cut for the model"
    )
    shaping: float = Field(
        default=0.1, ge=0, description="weight of the valid-tool-call fraction in the reward"
    )
    check_weight: float = Field(
        default=1.0, ge=0, description="weight of end-state checks (scenarios that have them)"
    )


def independent_reward(metrics: dict[str, Any], cfg: RolloutConfig) -> float:
    """The judge-free part of the reward: success (checks, else the proxy) and valid-call shaping."""
    calls = metrics["tool_calls"] + metrics["invalid_calls"]
    valid = (metrics["tool_calls"] - metrics["tool_errors"]) / calls if calls else 0.0
    length = float(metrics.get("length_used", 0.0))
    return cfg.check_weight * float(metrics["success"]) + cfg.shaping * valid - cfg.length_penalty * length


async def run_checks(conn: Connection, checks: list[Check], timeout: float) -> int:
    """How many end-state checks pass on the server as it is now (hand-written or generated alike)."""
    passed = 0
    for check in checks:
        out = await conn.call(check.tool, check.arguments, timeout)
        passed += int(not out.is_error and check.passes(out.text))
    return passed


async def rollout(
    model: jm.ModelConfig | str,
    client: Any,  # AsyncOpenAI, or anything with its chat.completions.create
    conn: Connection,
    info: ServerInfo,
    scenario: Scenario,
    cfg: RolloutConfig,
    *,
    seed: int | None = None,
) -> jm.Trajectory:
    """One episode. `model` is the policy (or just the model name to put in requests) and `client`
    anything with `chat.completions.create` (the policy's endpoint, another OpenAI-compatible
    server, `players.LiteLLMChat`): a baseline plays the same episodes through the same code."""
    name = model if isinstance(model, str) else model.name
    tools = [*info.tools, COMPLETE_TOOL]
    names = set(info.tool_names())
    for call in scenario.setup:  # the harness prepares the state; the agent never sees these calls
        await conn.call(call.tool, call.arguments, cfg.tool_timeout)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(info)},
        {"role": "user", "content": scenario.task},
    ]
    # a rollout that raises fails (its group counts it): nothing here is settled as a kept failure
    episode = Episode(on_error="raise")
    traj = episode.trajectory
    traj.metadata = {"scenario_id": scenario.id, "task": scenario.task, "difficulty": scenario.difficulty}
    m: dict[str, Any] = {
        "turns": 0,
        "tool_calls": 0,  # well-formed calls of a server tool
        "tool_errors": 0,  # of those, the server reported an error (or timed out)
        "invalid_calls": 0,  # unknown tool or arguments that are not a JSON object
        "completed": False,  # called complete_task
        "target_tool_ok": False,  # a successful call of the tool the scenario is about
        "truncated": 0,  # turns cut by max_tokens
    }
    ok_tools: set[str] = set()
    used = 0.0  # sum over turns of the fraction of max_tokens sampled
    sent = len(messages)  # messages of the latest request; its answer and tool results follow
    for turn in range(cfg.max_turns):
        kwargs: dict[str, Any] = {}
        if turn < cfg.forced_turns:
            kwargs["tool_choice"] = "required"
        ask = functools.partial(
            client.chat.completions.create,
            model=name,
            messages=messages,
            tools=tools,
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
        )
        try:
            completion = await ask(seed=None if seed is None else seed + turn, **kwargs)
        except BadRequestError as e:
            if "tool_choice" not in kwargs:
                raise
            # A tool schema the grammar compiler cannot take: let the model answer freely instead.
            traj.log(f"forced tool call refused ({e.message[:200]}); turn {turn} is free")
            completion = await ask()
        choice = completion.choices[0]
        served = jm.CapturedCall(
            request_messages=list(messages), tools=tools, response=completion.model_dump()
        )
        episode.record(served)
        m["turns"] += 1
        m["truncated"] += int(choice.finish_reason == "length")
        record = jm.record_of(choice)
        used += len(record.token_ids) / cfg.max_tokens if record else 1.0
        sent = len(messages)
        msg = message_of_choice(choice)
        messages.append(msg)
        calls = choice.message.tool_calls or []
        if not calls:
            break
        done = False
        for call in calls:
            if call.type != "function":  # only function tools are offered: the endpoint emits no other kind
                raise TypeError(f"unexpected {call.type!r} tool call {call.id!r}")
            fn = call.function
            try:
                args = json.loads(fn.arguments or "{}")
            except json.JSONDecodeError:
                args = None
            if fn.name == COMPLETE_TASK:
                done = True
                text = "Task marked complete."
            elif fn.name not in names or not isinstance(args, dict):
                m["invalid_calls"] += 1
                text = (
                    f"Error: unknown tool {fn.name!r}; the tools are {sorted(names)}"
                    if fn.name not in names
                    else "Error: the arguments must be a JSON object"
                )
            else:
                out = await conn.call(fn.name, args, cfg.tool_timeout)
                m["tool_calls"] += 1
                m["tool_errors"] += int(out.is_error)
                if not out.is_error:
                    ok_tools.add(fn.name)
                text = out.text[: cfg.tool_result_chars]
                traj.log(
                    f"{fn.name}({json.dumps(args)[:200]}) -> {'ERROR ' if out.is_error else ''}{text[:200]!r}"
                )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        if done:
            m["completed"] = True
            break
    m["length_used"] = used / max(1, m["turns"])
    # every tool the task names, not any one of them: a multi-step task is not done by its first call
    m["target_tool_ok"] = set(scenario.tools) <= ok_tools if scenario.tools else bool(ok_tools)
    if scenario.checks:
        passed = await run_checks(conn, scenario.checks, cfg.tool_timeout)
        m["checks_passed"] = passed / len(scenario.checks)
        m["success"] = passed == len(scenario.checks)
    else:
        m["success"] = m["target_tool_ok"]
    # exact=False: a baseline's calls carry no token records and join by their messages
    histories = episode.join([c.call for c in await episode.calls()], exact=False)
    main = histories[0] if histories and histories[0].trainable else None
    if main is not None and main.calls[-1] == m["turns"] - 1:  # the last answer is main's: its results follow
        traj.messages_and_choices = [*traj.messages_and_choices, *messages[sent + 1 :]]
    traj.metrics = m
    traj.reward = independent_reward(m, cfg)
    return episode.settle()
