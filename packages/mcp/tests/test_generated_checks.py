"""End-state checks written by a scenario generator and run against the real server's state: npm
`@modelcontextprotocol/server-memory` (stdio), whose tools carry MCP annotations, a stand-in
generator on 127.0.0.1 answering by rule (the embedded model cannot write checks), and the real
embedded model playing the episodes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from _support import ChatServer
from journeyman_mcp.rollout import RolloutConfig, rollout
from journeyman_mcp.scenarios import CheckTools, generate_scenarios, generation_schema
from journeyman_mcp.server import ServerInfo, ServerSpec, SessionPool, tool_kind

PEOPLE = {"Ada Lovelace": "mathematician", "Grace Hopper": "admiral"}


def _call(tool: str, args: dict[str, Any]) -> dict[str, str]:
    return {"tool": tool, "arguments": json.dumps(args)}


class RuleGenerator(ChatServer):
    """An OpenAI-compatible generator that answers by rule: for each person, a two-step task (look
    the person up, then add an observation) whose setup creates the person, with a read-only check
    that the observation is there afterwards, and one check on a tool that writes (which the
    harness must drop, whatever the generator says)."""

    async def answer(self, body: dict[str, Any]) -> str:
        scenarios = [
            {
                "task": f"Look up {name} in the memory graph, then add the observation '{fact}' to her entity.",
                "tools": ["search_nodes", "add_observations"],
                "difficulty": 3,
                "setup": [
                    _call(
                        "create_entities",
                        {
                            "entities": [
                                {"name": name, "entityType": "person", "observations": ["born in England"]}
                            ]
                        },
                    )
                ],
                "checks": [
                    {
                        **_call("open_nodes", {"names": [name]}),
                        "expect_contains": [fact],
                        "expect_absent": [],
                    },
                    {
                        **_call("delete_entities", {"entityNames": [name]}),
                        "expect_contains": ["ok"],
                        "expect_absent": [],
                    },
                ],
            }
            for name, fact in PEOPLE.items()
        ]
        if body["model"] == "classify":  # a server with no annotations: the generator says what reads
            check = {"expect_contains": ["milk"], "expect_absent": []}
            scenarios = [
                {
                    "task": "Add 'buy milk' to my to-do list and then show me the whole list.",
                    "tools": ["add_task", "list_tasks"],
                    "difficulty": 2,
                    "setup": [],
                    "checks": [
                        {**_call("list_tasks", {}), **check},
                        {**_call("add_task", {"title": "x"}), **check},
                    ],
                }
            ]
            return json.dumps({"scenarios": scenarios, "read_only_tools": ["list_tasks"]})
        return json.dumps({"scenarios": scenarios})


rule_generator = RuleGenerator.module_fixture("rule_generator")


def test_tool_kinds_come_from_annotations_and_else_from_the_generator() -> None:
    assert tool_kind(True, None) == "read_only" and tool_kind(True, True) == "read_only"
    assert tool_kind(False, False) == "mutating" and tool_kind(None, True) == "mutating"
    assert tool_kind(None, None) == "unknown" and tool_kind(None, False) == "unknown"
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {}}} for n in ("read", "write", "odd")
    ]
    info = ServerInfo(name="s", tools=tools, kinds={"read": "read_only", "write": "mutating"})
    ct = CheckTools.of(info)
    assert ct.read_only == ["read"] and ct.unknown == ["odd"] and ct.candidates == ["read", "odd"]
    schema = generation_schema(info.tool_names(), 2, ct)
    item = schema["properties"]["scenarios"]["items"]["properties"]
    assert item["checks"]["items"]["properties"]["tool"]["enum"] == ["read", "odd"]  # never "write"
    assert schema["properties"]["read_only_tools"]["items"]["enum"] == ["odd"]
    assert item["difficulty"]["enum"] == [1, 2, 3, 4, 5] and item["tools"]["maxItems"] == 4
    # the embedded model's schema stays small: no setup, no checks
    assert (
        "checks"
        not in generation_schema(info.tool_names(), 2)["properties"]["scenarios"]["items"]["properties"]
    )


async def test_without_annotations_the_generator_says_which_tools_only_read(
    rule_generator: RuleGenerator,
) -> None:
    tools = [
        {"type": "function", "function": {"name": n, "description": d, "parameters": {"type": "object"}}}
        for n, d in [
            ("add_task", "Add a task to the to-do list"),
            ("list_tasks", "List the tasks on the list"),
        ]
    ]
    info = ServerInfo(name="todo", tools=tools)  # no annotations: both tools are of unknown kind
    scenarios, report = await generate_scenarios(
        info, 1, generator=rule_generator.base_url, generator_model="classify", batch_size=1
    )
    schema = rule_generator.requests[-1]["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["read_only_tools"]["items"]["enum"] == ["add_task", "list_tasks"]
    assert (
        report.read_only_by_generator == ["list_tasks"] and report.checks == 1 and report.checks_rejected == 1
    )
    [s] = scenarios
    assert [c.tool for c in s.checks] == ["list_tasks"] and s.tools == ["add_task", "list_tasks"]


def _graph(path: Path) -> dict[str, list[str]]:
    """The memory server's end state, read from its own file: entity name -> observations."""
    if not path.exists():
        return {}
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {i["name"]: i.get("observations", []) for i in items if i.get("type") == "entity"}


async def test_generated_checks_run_against_server_memory_and_decide_success(
    served: tuple[object, object], rule_generator: RuleGenerator, tmp_path: Path
) -> None:
    npx = shutil.which("npx")
    if npx is None:
        pytest.skip("npx (Node.js) is not installed")
    model, _ = served
    memory = tmp_path / "memory.jsonl"
    spec = ServerSpec(
        transport="stdio",
        command=[npx, "-y", "@modelcontextprotocol/server-memory"],
        env={"MEMORY_FILE_PATH": str(memory)},
    )
    async with SessionPool(spec, size=1, connect_timeout=120) as pool:
        # four of its nine tools: a shorter prompt and grammar for the embedded model (checks may
        # still call any tool the server annotates as read-only)
        tools = ["create_entities", "search_nodes", "open_nodes", "add_observations"]
        info = (await pool.describe()).select(tools).bounded(32)
        # the server's own annotations classify its tools; no generator needed for these
        assert info.kind("open_nodes") == "read_only" and info.kind("read_graph") == "read_only"
        assert "read_graph" not in info.tool_names()
        assert info.kind("create_entities") == "mutating" and info.kind("delete_entities") == "mutating"
        scenarios, report = await generate_scenarios(
            info, 2, generator=rule_generator.base_url, generator_model="rule", batch_size=2
        )
        asked = rule_generator.requests[-1]
        check_enum = asked["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]["items"][
            "properties"
        ]["checks"]["items"]["properties"]["tool"]["enum"]
        assert "open_nodes" in check_enum and "delete_entities" not in check_enum
        assert report.from_generator == 2 and report.checks == 2 and report.checks_rejected == 2
        for s in scenarios:
            assert (
                s.source == "generator"
                and s.difficulty == 3
                and s.tools == ["search_nodes", "add_observations"]
            )
            assert [c.tool for c in s.checks] == ["open_nodes"] and s.setup[0].tool == "create_entities"

        client = model.openai_client()  # type: ignore[attr-defined]
        cfg = RolloutConfig(max_turns=1, max_tokens=40)
        for s in scenarios:
            async with pool.lease() as conn:
                t = await rollout(model, client, conn, info, s, cfg, seed=0)  # type: ignore[arg-type]
            name, fact = next((n, f) for n, f in PEOPLE.items() if n in s.task)
            # the setup ran on the real server; the check read its end state: success is what the
            # server's own file says, not whether some tool was called
            state = _graph(memory)
            done = any(fact in o.lower() for o in state.get(name, []))
            assert t.metrics["checks_passed"] == float(done) and t.metrics["success"] == done, (state, t.logs)
            assert name in state or any("delete" in line for line in t.logs), (state, t.logs)
