"""MCP·RL against real servers on 127.0.0.1: mcp-server-time (stdio, PyPI), server-everything
(Streamable HTTP, npm) and the example to-do server, with the real embedded model on this CPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import journeyman as jm
import pytest
from _support import function_tool
from journeyman.data.paths import cache_dir
from journeyman_mcp.scenarios import Check, generate_scenarios, schema_scenarios, split
from journeyman_mcp.server import ServerInfo, ServerSpec, SessionPool, bound_strings

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
TIME_SERVER = [str(BIN / "mcp-server-time"), "--local-timezone", "UTC"]
TODO_SERVER = [sys.executable, str(ROOT / "examples" / "mcp_todo_server.py")]
# Small everything: a few steps must fit in a test on 2 shared cores. No sampled evaluation and no
# baseline comparison here (test_win_rate.py covers those against a rule judge).
FAST = [
    "--eval-samples",
    "0",
    "--against",
    "none",
    "--max-tokens",
    "40",
    "--max-turns",
    "2",
    "--steps",
    "1",
    "--groups-per-step",
    "1",
    "--group-size",
    "3",
]


def _env(tmp: Path) -> dict[str, str]:
    """The CLI's environment: unless the caller set one, a cache of its own under `tmp`, so RULER's
    answers start empty, whose `models` is the machine's (converting the weights afresh is ~32 s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if "JOURNEYMAN_CACHE" not in env:
        models = cache_dir() / "models"
        models.mkdir(parents=True, exist_ok=True)
        cache = tmp / "cache"
        cache.mkdir(exist_ok=True)
        if not (cache / "models").exists():
            (cache / "models").symlink_to(models, target_is_directory=True)
        env["JOURNEYMAN_CACHE"] = str(cache)
    return env


def _mcp_rl(args: list[str], tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "mcp-rl"), *args], capture_output=True, text=True, timeout=timeout, env=_env(tmp), cwd=tmp
    )


def _mcp_rl_at_once(
    runs: list[list[str]], tmp: Path, timeout: float = 300
) -> list[subprocess.CompletedProcess[str]]:
    """`_mcp_rl` of each argument list, all started together (each start imports the package for
    seconds): their results, in order."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda args: _mcp_rl(args, tmp, timeout), runs))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- connect ---------------------------------------------------------------------------------------


def test_server_spec_parses_urls_and_commands() -> None:
    assert ServerSpec.parse("http://127.0.0.1:8000/mcp").transport == "http"
    assert ServerSpec.parse("http://127.0.0.1:8000/sse").transport == "sse"
    spec = ServerSpec.parse("stdio:mcp-server-time --local-timezone UTC")
    assert spec.transport == "stdio" and spec.command == ["mcp-server-time", "--local-timezone", "UTC"]
    assert ServerSpec.parse(["python", "server.py", "--flag"]).command == ["python", "server.py", "--flag"]
    with pytest.raises(ValueError, match="server"):
        ServerSpec.parse("")


def test_bound_strings_caps_free_strings_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "b": {"type": "string", "maxLength": 5},
            "c": {"type": "string", "enum": ["x", "y"]},
            "d": {"type": "array", "items": {"type": "string"}},
        },
    }
    out = bound_strings(schema, 64)
    assert out["properties"]["a"]["maxLength"] == 64
    assert out["properties"]["b"]["maxLength"] == 5
    assert "maxLength" not in out["properties"]["c"]
    assert out["properties"]["d"]["items"]["maxLength"] == 64
    assert "maxLength" not in schema["properties"]["a"]  # a copy


async def test_stdio_pool_lists_tools_and_turns_failures_into_tool_results() -> None:
    async with SessionPool(ServerSpec.parse(TIME_SERVER), size=1) as pool:
        info = await pool.describe()
        assert {"get_current_time", "convert_time"} <= set(info.tool_names())
        fn = next(t for t in info.tools if t["function"]["name"] == "get_current_time")["function"]
        assert fn["parameters"]["required"] == ["timezone"]
        async with pool.lease() as conn:
            ok = await conn.call("get_current_time", {"timezone": "Asia/Tokyo"}, timeout=10)
            bad = await conn.call("get_current_time", {"timezone": "Nowhere/City"}, timeout=10)
            unknown = await conn.call("no_such_tool", {}, timeout=10)
    assert not ok.is_error and "Asia/Tokyo" in ok.text
    assert bad.is_error and "Nowhere" in bad.text
    assert unknown.is_error and "no_such_tool" in unknown.text


async def test_a_dead_server_fails_the_rollout_and_the_pool_replaces_it(tmp_path: Path) -> None:
    from journeyman_mcp.server import ServerUnavailableError

    async with SessionPool(ServerSpec.parse(TODO_SERVER), size=1) as pool:
        async with pool.lease() as conn:
            pid_text = (await conn.call("add_task", {"title": "x"}, timeout=10)).text
            assert "Added" in pid_text
            # Kill the server process under the session: the next call must fail, not hang.
            for p in _children(os.getpid(), "mcp_todo_server.py"):
                os.kill(p, 9)
            with pytest.raises(ServerUnavailableError):
                for _ in range(50):
                    await conn.call("list_tasks", {}, timeout=5)
                    await asyncio.sleep(0.1)
        async with pool.lease() as conn:  # a fresh process: its list is empty again
            assert "empty" in (await conn.call("list_tasks", {}, timeout=10)).text
        assert pool.replaced == 1


# A server whose first `lookup` call, in whichever of its processes, SIGKILLs that process.
KILLED_ONCE = """
import os, signal, sys
from mcp.server.mcpserver import MCPServer

server = MCPServer("lookup")


@server.tool()
def lookup(key: str) -> str:
    \"\"\"Look up the value stored under a key.\"\"\"
    try:
        open(sys.argv[1], "x").close()  # exclusive create: true for one call across all processes
    except FileExistsError:
        return f"{key} = 42"
    os.kill(os.getpid(), signal.SIGKILL)


server.run()
"""


async def test_a_server_killed_mid_rollout_fails_that_rollout_and_the_step_trains_on_the_rest(
    tmp_path: Path, served: tuple[object, object]
) -> None:
    from journeyman_mcp.rollout import RolloutConfig, rollout
    from journeyman_mcp.scenarios import Scenario

    _, backend = served
    model = jm.TrainableModel(name="mcp-killed", project="tests")
    await model.register(backend)  # type: ignore[arg-type]
    script = tmp_path / "killed_once.py"
    script.write_text(KILLED_ONCE)
    # Every rollout reaches the server: the end-state check calls `lookup` after the model's turn.
    scenario = Scenario(
        id="s", task="What is stored under 'answer'?", checks=[Check(tool="lookup", arguments={"key": "k"})]
    )
    # A free turn: no grammar to compile for the fresh engine (28 s alone, minutes on a busy 2-core
    # CPU); the kill needs no call from the model, the end-state check reaches the server anyway.
    cfg = RolloutConfig(max_turns=1, forced_turns=0, max_tokens=24)
    client = model.openai_client()

    async with SessionPool(
        ServerSpec.parse([sys.executable, str(script), str(tmp_path / "killed")]), size=4
    ) as pool:
        info = await pool.describe()

        async def one() -> jm.Trajectory:
            async with pool.lease() as conn:
                return await rollout(model, client, conn, info, scenario, cfg)

        [group] = await jm.gather_trajectory_groups(
            [jm.TrajectoryGroup(one() for _ in range(4))], max_exceptions=1
        )
        # The pool started a fresh server for the killed one: four sessions answer again.
        async with contextlib.AsyncExitStack() as stack:
            conns = [await stack.enter_async_context(pool.lease()) for _ in range(4)]
            outs = [await c.call("lookup", {"key": "k"}, timeout=10) for c in conns]
        assert all(o.text == "k = 42" for o in outs) and pool.replaced == 1
    # The killed rollout is counted, named and kept apart; the other three are whole.
    assert len(group.exceptions) == 1 and group.exceptions[0].type == "ServerUnavailableError"
    assert len(group.trajectories) == 3
    assert all(t.metrics["checks_passed"] == 1 for t in group.trajectories)
    for i, t in enumerate(group.trajectories):
        t.reward = float(i)
    result = await model.train([group])
    assert result.step == 1 and not result.skipped


@pytest.fixture
def todo_sse_url(tmp_path: Path):
    """The example to-do server speaking SSE on 127.0.0.1."""
    port = _free_port()
    with _serving([*TODO_SERVER, "--sse", str(port)], port):
        yield f"http://127.0.0.1:{port}/sse"


async def test_sse_pool_lists_tools_and_calls_them(todo_sse_url: str) -> None:
    spec = ServerSpec.parse(todo_sse_url)
    assert spec.transport == "sse"
    async with SessionPool(spec, size=2) as pool:
        info = await pool.describe()
        assert set(info.tool_names()) == {"add_task", "list_tasks", "mark_done", "remove_task"}
        assert info.name == "todo" and "to-do" in (info.instructions or "")
        async with pool.lease() as a, pool.lease() as b:  # two SSE sessions, one server-side list
            assert "Added" in (await a.call("add_task", {"title": "Pay Rent"}, timeout=10)).text
            assert "Marked" in (await b.call("mark_done", {"title": "pay rent"}, timeout=10)).text
            missing = await b.call("remove_task", {"title": "nothing"}, timeout=10)
            listing = await a.call("list_tasks", {}, timeout=10)
    assert missing.is_error and "no task titled" in missing.text
    assert "pay rent (done)" in listing.text


@contextlib.contextmanager
def _serving(
    cmd: list[str], port: int, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[None]:
    """A server process (its own process group) that listens on 127.0.0.1:`port` while inside."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                pytest.fail(f"{cmd[0]} exited: {proc.stderr.read() if proc.stderr else ''}")
            if time.time() > deadline:
                pytest.fail(f"nothing listened on 127.0.0.1:{port} within 120 s")
            time.sleep(0.3)
        yield
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(10)


def _children(pid: int, needle: str) -> list[int]:
    # -ww: never cut args to the terminal width (pytest sets COLUMNS; long checkout paths got cut)
    out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return [
        int(line.split()[0])
        for line in out.splitlines()[1:]
        if needle in line and line.split()[1] == str(pid)
    ]


# -- scenarios -------------------------------------------------------------------------------------


async def test_schema_scenarios_are_valid_distinct_and_split() -> None:
    async with SessionPool(ServerSpec.parse(TIME_SERVER), size=1) as pool:
        info = await pool.describe()
    items = schema_scenarios(info, 8, seed=1)
    assert len(items) == 8 and len({s.task for s in items}) == 8
    assert all(s.tools[0] in info.tool_names() and s.source == "schema" for s in items)
    # Arguments are filled from the schema: the required timezone is a real IANA name.
    assert any("Europe/" in s.task or "Asia/" in s.task or "America/" in s.task for s in items)
    train, held = split(items, 3)
    assert len(held) == 3 and not {s.id for s in train} & {s.id for s in held}
    # A generator that cannot be reached costs nothing but a note: schema tasks fill the set.
    got, report = await generate_scenarios(
        info, 5, generator="http://127.0.0.1:9/v1", generator_model="nobody", seed=2
    )
    assert len(got) == 5 and report.from_schema == 5 and report.generator_error


async def test_generator_specs_are_checked_by_name() -> None:
    info = ServerInfo(
        name="t", tools=[{"type": "function", "function": {"name": "now", "description": "time"}}]
    )
    with pytest.raises(jm.InvalidFieldError) as err:  # a URL needs a model name: raised, not a fallback
        await generate_scenarios(info, 2, generator="http://127.0.0.1:9/v1")
    assert err.value.field == "generator_model"
    with pytest.raises(jm.InvalidFieldError) as err:
        await generate_scenarios(info, 2, generator="gpt 4o")
    assert err.value.field == "generator"


async def test_the_local_model_generates_scenarios_under_the_schema(served: tuple[object, object]) -> None:
    model, backend = served
    await model.register(backend)  # type: ignore[attr-defined]  # `local` is this context's latest backend
    info = ServerInfo(
        name="todo",
        tools=[function_tool("add_task", "Add a task to the to-do list", {"title": {"type": "string"}})],
    )
    got, report = await generate_scenarios(
        info,
        2,
        generator=f"local:{model.name}",  # type: ignore[attr-defined]
        batch_size=2,  # one batch: one request, two scenarios asked of it
        max_tokens=120,
        seed=3,
    )
    assert len(got) == 2 and report.generator_error is None
    assert report.from_generator + report.from_schema == 2
    assert all(s.tools == ["add_task"] for s in got)


def test_check_matches_case_insensitively() -> None:
    c = Check(tool="list_tasks", expect_contains=["Buy Milk (done)"], expect_absent=["rent"])
    assert c.passes("- buy milk (done)\n- walk the dog (open)")
    assert not c.passes("- buy milk (open)")
    assert not c.passes("- buy milk (done)\n- pay rent (open)")


# -- the CLI, end to end ---------------------------------------------------------------------------


def test_cli_unreachable_server_and_no_tools_exit_cleanly(tmp_path: Path) -> None:
    empty = tmp_path / "empty_server.py"
    empty.write_text("from mcp.server.mcpserver import MCPServer\nMCPServer('empty').run()\n")
    broken = tmp_path / "broken_server.py"
    broken.write_text("import no_such_module_for_mcp_rl\n")
    # five separate runs of the CLI, side by side (each exits before any model loads)
    unreachable, missing, no_tools, died, helped = _mcp_rl_at_once(
        [
            ["train", "http://127.0.0.1:9/mcp", "--path", str(tmp_path / "unreachable")],
            ["train", "--path", str(tmp_path / "missing"), "--", "no-such-mcp-server-binary"],
            ["train", "--path", str(tmp_path / "empty"), "--", sys.executable, str(empty)],
            ["train", "--path", str(tmp_path / "broken"), "--", sys.executable, str(broken)],
            ["--help"],
        ],
        tmp_path,
        timeout=120,
    )
    assert (
        unreachable.returncode == 1
        and "cannot connect" in unreachable.stderr
        and "Traceback" not in unreachable.stderr
    )
    assert missing.returncode == 1 and "not found" in missing.stderr and "Traceback" not in missing.stderr
    assert no_tools.returncode == 1 and "no tools" in no_tools.stderr and "Traceback" not in no_tools.stderr
    # the server's own last words come with the message: why it died, not just "connection closed"
    assert died.returncode == 1 and "No module named 'no_such_module_for_mcp_rl'" in died.stderr
    assert helped.returncode == 0 and "train" in helped.stdout and "scenarios" in helped.stdout


def _check_run(tmp: Path, r: subprocess.CompletedProcess[str], tool_names: set[str]) -> list[dict]:
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out eval" in r.stdout and "success" in r.stdout
    run = tmp / "mcp-rl" / "models" / "mcp-agent"
    steps = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert any(s.get("split") == "val" for s in steps)
    report = json.loads((run / "mcp_rl_report.json").read_text())
    assert len(report["evals"]) == 2  # before and after
    trained = [s for s in report["steps"] if not s.get("skipped")]
    if trained:  # a step is skipped only when every rollout got the same reward
        assert (run / "checkpoints" / "0001" / "adapter_model.safetensors").exists()
    assert (run / "reward.png").exists()
    groups = [
        json.loads(line) for line in (run / "trajectories" / "train" / "0000.jsonl").read_text().splitlines()
    ]
    calls, results = 0, 0
    for g in groups:
        for t in g["trajectories"]:
            for m in t["messages_and_choices"]:
                msg = m.get("message", m)
                for c in msg.get("tool_calls") or []:
                    calls += c["function"]["name"] in tool_names
                if msg.get("role") == "tool" and not msg["content"].startswith("Error: unknown tool"):
                    results += 1
            assert t["metrics"]["turns"] >= 1
            assert any("journeyman" in m for m in t["messages_and_choices"])  # exact token records
    assert calls > 0 and results > 0, "rollouts must contain real tool calls and real tool results"
    return groups


@pytest.mark.slow
def test_train_end_to_end_on_mcp_server_time_stdio_with_ruler(tmp_path: Path) -> None:
    r = _mcp_rl(
        [
            "train",
            "--path",
            str(tmp_path),
            "--num-scenarios",
            "4",
            "--num-eval",
            "1",
            "--judge",
            "local",
            "--generator",
            "none",
            *FAST,
            # after FAST (the last one counts): a group of two, the fewest RULER compares (the free
            # second turn's length still spreads the rewards: one turn ties them, skipping the step)
            "--group-size",
            "2",
            "--",
            *TIME_SERVER,
        ],
        tmp_path,
    )
    groups = _check_run(tmp_path, r, {"get_current_time", "convert_time"})
    ruler = groups[0]["metadata"]["ruler"]
    assert ruler["judge"].startswith("local:mcp-agent-judge")
    assert all("ruler" in t["metrics"] for t in groups[0]["trajectories"]) or ruler["skipped"]
    scen = json.loads((tmp_path / "mcp-rl" / "models" / "mcp-agent" / "scenarios.json").read_text())
    assert len(scen["train"]) == 3 and len(scen["eval"]) == 1

    # `mcp-rl eval --step N` re-evaluates a checkpoint of the run on its held-out scenarios (the
    # latest: step 0 is served the same way, by a zero adapter).
    report = json.loads((tmp_path / "mcp-rl" / "models" / "mcp-agent" / "mcp_rl_report.json").read_text())
    latest = max([0] + [s["new_step"] for s in report["steps"] if not s.get("skipped")])
    common = ["eval", "--path", str(tmp_path), "--max-tokens", "40", "--max-turns", "2"]
    common += ["--eval-samples", "0", "--against", "none"]
    # the step the run has and one it lacks, evaluated side by side
    r, lacking = _mcp_rl_at_once(
        [[*common, "--step", str(step), "--", *TIME_SERVER] for step in (latest, latest + 5)], tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    row = r.stdout.splitlines()[-1].split()
    assert row[0] == str(latest), r.stdout
    # Greedy decoding of the same adapter on the same scenario gives the run's own eval numbers.
    same = report["evals"][-1]
    assert float(row[1]) == pytest.approx(same["success"], abs=0.005), (r.stdout, same)
    assert (
        lacking.returncode == 2 and "step" in lacking.stderr and "Traceback" not in lacking.stderr
    )  # a usage error (App)


@pytest.fixture
def everything_url(tmp_path: Path):
    npx = shutil.which("npx")
    if npx is None:
        pytest.skip("npx (Node.js) is not installed")
    port = _free_port()
    env = dict(
        os.environ, PORT=str(port), NODE_OPTIONS=f"--require {Path(__file__).parent / 'bind_localhost.cjs'}"
    )
    with _serving(
        [npx, "-y", "@modelcontextprotocol/server-everything", "streamableHttp"], port, env, tmp_path
    ):
        yield f"http://127.0.0.1:{port}/mcp"


@pytest.mark.slow
def test_train_end_to_end_on_server_everything_streamable_http(tmp_path: Path, everything_url: str) -> None:
    r = _mcp_rl(
        [
            "train",
            everything_url,
            "--path",
            str(tmp_path),
            "--tools",
            "echo,get-sum",
            "--num-scenarios",
            "4",
            "--num-eval",
            "1",
            "--judge",
            "none",
            "--generator",
            "none",
            *FAST,
            # after FAST's 40 (the last one counts): a forced `echo` call's free-text message ran
            # past 40 tokens in all of one run's rollouts, leaving no call to check
            "--max-tokens",
            "96",
        ],
        tmp_path,
    )
    _check_run(tmp_path, r, {"echo", "get-sum"})
