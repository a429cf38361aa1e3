"""Connect to an MCP server (stdio command, Streamable HTTP or SSE URL), describe it, call its tools.

The first stop on the data path: everything later sees the server only through `ServerSpec`,
`ServerInfo` (tools as OpenAI tool definitions) and `SessionPool.lease()` → `Connection.call()`.

Each connection lives in its own asyncio task: the MCP client runs anyio task groups, and a server
that dies would otherwise cancel whichever task opened it (the training loop). Here it only marks
that connection dead; the rollout using it fails, and the pool opens a fresh one for the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal, TextIO

from journeyman import InvalidFieldError, JourneymanError
from pydantic import BaseModel, Field

Transport = Literal["stdio", "http", "sse"]


class ServerUnavailableError(JourneymanError, ConnectionError):
    """The MCP server could not be started or reached, or it offers no tools."""


class ServerSpec(BaseModel):
    """How to reach one MCP server."""

    transport: Transport
    url: str | None = None
    command: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for a stdio command")

    @classmethod
    def parse(cls, target: str | Sequence[str]) -> ServerSpec:
        """`http(s)://host/mcp` (Streamable HTTP), `http(s)://host/sse` (SSE), `stdio:cmd args` or a command."""
        parts = [target] if isinstance(target, str) else list(target)
        if not parts or not parts[0].strip():
            raise InvalidFieldError(
                "server",
                target,
                "give a URL (http://host:port/mcp), 'stdio:<command>' or '-- <command> args'",
            )
        first = parts[0].strip()
        if first.startswith(("http://", "https://")):
            if len(parts) > 1:
                raise InvalidFieldError("server", parts, "a URL takes no further arguments")
            path = first.split("?", 1)[0].rstrip("/")
            return cls(transport="sse" if path.endswith("/sse") else "http", url=first)
        if first.startswith("stdio:"):
            parts = shlex.split(first[len("stdio:") :]) + parts[1:]
        elif len(parts) == 1 and " " in first:
            parts = shlex.split(first)
        if not parts:
            raise InvalidFieldError("server", target, "'stdio:' needs a command after it")
        return cls(transport="stdio", command=parts)

    def label(self) -> str:
        return self.url if self.url else shlex.join(self.command)

    def client(self, errlog: TextIO | None = None) -> Any:
        """A fresh (unentered) `mcp.Client`; a stdio server's stderr goes to `errlog` (default: ours)."""
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        if self.transport == "http":
            return Client(self.url or "", cache=None)
        if self.transport == "sse":
            from mcp.client.sse import sse_client

            return Client(sse_client(self.url or ""), cache=None)
        exe = self.command[0]
        if shutil.which(exe) is None and not os.path.exists(exe):
            raise ServerUnavailableError(f"server command not found: {exe!r} (is it installed and on PATH?)")
        params = StdioServerParameters(
            command=exe, args=self.command[1:], env={**os.environ, **self.env} if self.env else None
        )
        return Client(stdio_client(params, errlog=errlog or sys.stderr), cache=None)


def openai_tool(name: str, description: str | None, input_schema: dict[str, Any] | None) -> dict[str, Any]:
    """An MCP tool as an OpenAI function tool (the schema is passed through unchanged)."""
    schema = dict(input_schema or {"type": "object", "properties": {}})
    schema.pop("$schema", None)  # noise in the prompt the model reads
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    return {
        "type": "function",
        "function": {"name": name, "description": (description or "").strip(), "parameters": schema},
    }


ToolKind = Literal["read_only", "mutating", "unknown"]


def tool_kind(read_only_hint: bool | None, destructive_hint: bool | None) -> ToolKind:
    """A tool's kind from its MCP annotations: `readOnlyHint` decides; a tool that says it is
    destructive mutates; a tool without hints is unknown (the scenario generator classifies it)."""
    if read_only_hint is True:
        return "read_only"
    if read_only_hint is False or destructive_hint is True:
        return "mutating"
    return "unknown"


class ServerInfo(BaseModel):
    """What the server offers: tools (OpenAI form), resources and prompts where it has them."""

    name: str
    instructions: str | None = None
    tools: list[dict[str, Any]]
    resources: list[dict[str, Any]] = Field(default_factory=list)
    prompts: list[dict[str, Any]] = Field(default_factory=list)
    kinds: dict[str, ToolKind] = Field(
        default_factory=dict,
        description="tool name -> read_only | mutating from the MCP annotations; absent = unknown",
    )

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def kind(self, name: str) -> ToolKind:
        return self.kinds.get(name, "unknown")

    def select(self, names: Sequence[str] | None) -> ServerInfo:
        """Only the named tools (all when `names` is empty); an unknown name is an error."""
        if not names:
            return self
        known = self.tool_names()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InvalidFieldError("tools", unknown, f"the server has no such tools; it has {known}")
        return self.model_copy(update={"tools": [t for t in self.tools if t["function"]["name"] in names]})

    def bounded(self, max_arg_chars: int) -> ServerInfo:
        """Tools whose string arguments are capped at `max_arg_chars` (0: unchanged), see `bound_strings`."""
        if max_arg_chars <= 0:
            return self
        tools = [
            {
                **t,
                "function": {
                    **t["function"],
                    "parameters": bound_strings(t["function"]["parameters"], max_arg_chars),
                },
            }
            for t in self.tools
        ]
        return self.model_copy(update={"tools": tools})


def bound_strings(schema: Any, max_chars: int) -> Any:
    """The schema with `maxLength` on every string that has none (a copy).

    Forced tool calls are decoded under the tool's schema; a small model given an unbounded string
    writes until max_tokens and the call is cut off. The bound is also shown to the model.
    """
    if isinstance(schema, list):
        return [bound_strings(s, max_chars) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: bound_strings(v, max_chars) if k not in ("enum", "const", "default", "examples") else v
        for k, v in schema.items()
    }
    kind = out.get("type")
    if (kind == "string" or (isinstance(kind, list) and "string" in kind)) and "enum" not in out:
        out.setdefault("maxLength", max_chars)
    return out


def result_text(result: Any, limit: int = 2000) -> str:
    """A CallToolResult as the text a model reads: text parts joined, other parts named."""
    parts = []
    for c in getattr(result, "content", None) or []:
        kind = getattr(c, "type", "")
        if kind == "text":
            parts.append(c.text)
        elif kind == "resource":
            res = c.resource
            parts.append(getattr(res, "text", None) or f"[resource {res.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource link {c.uri}]")
        else:
            parts.append(f"[{kind or 'content'}]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


class ToolOutcome(BaseModel):
    text: str
    is_error: bool
    seconds: float


class Connection:
    """One live MCP session, owned by its own task (see the module docstring)."""

    def __init__(self, spec: ServerSpec, index: int, errlog: TextIO | None = None) -> None:
        self.spec = spec
        self.errlog = errlog
        self.index = index
        self.client: Any = None
        self.error: BaseException | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.client is not None and self.error is None and not self._stop.is_set()

    async def start(self, timeout: float) -> None:
        self._task = asyncio.create_task(self._own(), name=f"mcp-connection-{self.index}")
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            self.error = TimeoutError(f"no answer from the server within {timeout:g}s")
        if self.error is not None or self.client is None:
            await self.close()
            raise ServerUnavailableError(
                f"cannot connect to MCP server {self.spec.label()}: {describe(self.error)}"
            ) from None

    async def _own(self) -> None:
        try:
            async with self.spec.client(self.errlog) as client:
                self.client = client
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:  # the server died or never came up: record it, never propagate
            self.error = e
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self._ready.set()

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> ToolOutcome:
        """Call a tool; server-side failures (is_error, unknown tool, bad arguments) come back as text."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        if not self.alive:
            raise ServerUnavailableError(f"MCP connection {self.index} is down: {describe(self.error)}")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            result = await asyncio.wait_for(
                self.client.call_tool(name, arguments, read_timeout_seconds=timeout), timeout + 1
            )
        except TimeoutError:
            return ToolOutcome(
                text=f"Error: the tool {name!r} timed out after {timeout:g}s",
                is_error=True,
                seconds=loop.time() - t0,
            )
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:  # the server process or HTTP session is gone
                self.error = e
                raise ServerUnavailableError(f"MCP server went away during {name!r}: {e}") from e
            return ToolOutcome(text=f"Error: {e}", is_error=True, seconds=loop.time() - t0)
        except Exception as e:
            if not self.alive:
                raise ServerUnavailableError(f"MCP server went away during {name!r}: {describe(e)}") from e
            # A result the client could not validate etc.: the model sees it, the run goes on.
            return ToolOutcome(text=f"Error: {describe(e)}", is_error=True, seconds=loop.time() - t0)
        return ToolOutcome(text=result_text(result), is_error=bool(result.is_error), seconds=loop.time() - t0)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, 10)
            if not self._task.done():
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task


def describe(e: BaseException | None) -> str:
    """The innermost useful message of an exception (anyio wraps failures in exception groups)."""
    if e is None:
        return "unknown error"
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, OSError) and e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def describe_server(conn: Connection) -> ServerInfo:
    """List tools, and resources and prompts where the server offers them."""
    client = conn.client
    tools, cursor = [], None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    caps = client.server_capabilities
    resources: list[dict[str, Any]] = []
    prompts: list[dict[str, Any]] = []
    if getattr(caps, "resources", None) is not None:
        with contextlib.suppress(Exception):
            res = await client.list_resources()
            resources = [
                {"uri": str(r.uri), "name": r.name, "description": r.description or ""}
                for r in res.resources[:50]
            ]
    if getattr(caps, "prompts", None) is not None:
        with contextlib.suppress(Exception):
            pr = await client.list_prompts()
            prompts = [{"name": p.name, "description": p.description or ""} for p in pr.prompts[:50]]
    info = client.server_info
    return ServerInfo(
        name=(info.name if info else None) or conn.spec.label(),
        instructions=client.instructions,
        tools=[openai_tool(t.name, t.description, t.input_schema) for t in tools],
        resources=resources,
        prompts=prompts,
        kinds={
            t.name: kind
            for t in tools
            if (a := t.annotations) is not None
            and (kind := tool_kind(a.read_only_hint, a.destructive_hint)) != "unknown"
        },
    )


class SessionPool:
    """`size` MCP sessions shared by concurrent rollouts; each rollout leases one for its episode.

    Leases are exclusive so a stateful server sees one episode per session at a time (setup, the
    agent's calls and the end-state checks all run on the same session). A dead session is replaced
    when it is handed back.
    """

    def __init__(
        self, spec: ServerSpec, size: int = 4, connect_timeout: float = 60.0, errlog: Path | None = None
    ) -> None:
        if size < 1:
            raise InvalidFieldError("connections", size, "must be >= 1")
        self.spec = spec
        self.size = size
        self.connect_timeout = connect_timeout
        self._free: asyncio.Queue[Connection] = asyncio.Queue()
        self._all: list[Connection] = []
        self._opened = 0
        self.replaced = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.errlog_path = errlog
        self._errlog: TextIO | None = None

    async def _open(self) -> Connection:
        if self.errlog_path is not None and self._errlog is None:
            self.errlog_path.parent.mkdir(parents=True, exist_ok=True)
            self._errlog = self.errlog_path.open("a")
        conn = Connection(self.spec, self._opened, self._errlog)
        self._opened += 1
        await conn.start(self.connect_timeout)
        self._all.append(conn)
        return conn

    async def __aenter__(self) -> SessionPool:
        try:
            first = await self._open()  # fail fast with one clear message
        except ServerUnavailableError as e:
            raise ServerUnavailableError(f"{e}{self._stderr_tail()}") from None
        self._free.put_nowait(first)
        rest = await asyncio.gather(*(self._open() for _ in range(self.size - 1)), return_exceptions=True)
        for c in rest:
            if isinstance(c, Connection):
                self._free.put_nowait(c)
        return self

    def _stderr_tail(self, lines: int = 3) -> str:
        """The last lines a stdio server wrote to its log: why it died, usually (a missing module...)."""
        if self._errlog is None or self.errlog_path is None:
            return ""
        self._errlog.flush()
        tail = [x for x in self.errlog_path.read_text(errors="replace").splitlines() if x.strip()][-lines:]
        if not tail:
            return ""
        return f"\nthe server's stderr ({self.errlog_path}) ends with:\n  " + "\n  ".join(tail)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(c.close() for c in self._all), return_exceptions=True)
        if self._errlog is not None:
            self._errlog.close()

    async def describe(self) -> ServerInfo:
        async with self.lease() as conn:
            return await describe_server(conn)

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[Connection]:
        conn = await self._free.get()
        try:
            yield conn
        finally:
            if conn.alive:
                self._free.put_nowait(conn)
            else:
                self._all.remove(conn)
                task = asyncio.create_task(self._replace(conn))
                self._tasks.add(task)  # keep a reference: the loop holds tasks only weakly
                task.add_done_callback(self._tasks.discard)

    async def _replace(self, dead: Connection) -> None:
        await dead.close()
        try:
            self._free.put_nowait(await self._open())
            self.replaced += 1
        except ServerUnavailableError:
            # The server stays down: hand back the dead one so waiting rollouts fail instead of hanging.
            self._all.append(dead)
            self._free.put_nowait(dead)
