"""Helpers and data shared by the tests of every package and by bench/soak.py.

On sys.path through the root conftest.py (tests are not a package under `--import-mode=importlib`);
a bench adds this folder itself. Fixtures built on these live in the root conftest.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from fastapi import Request
    from journeyman import CapturedCall, Inference, ModelConfig, TrainableModel, Trajectory, TrajectoryGroup
    from journeyman.chat.formats import ChatFormat
    from journeyman.engine.scripted import Script, ScriptedEngine
    from journeyman.serving.endpoint import Endpoint, ServerThread
    from openai.types.chat.chat_completion import ChatCompletion, Choice


def function_tool(
    name: str,
    description: str | None,
    properties: dict[str, dict[str, Any]],
    required: Sequence[str] = (),
) -> dict[str, Any]:
    """An OpenAI function tool taking an object of `properties` (name -> JSON schema). Keys keep one
    order (name, description, parameters): a chat template renders the tool as JSON, order and all."""
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = list(required)
    function = {
        "name": name,
        **({"description": description} if description else {}),
        "parameters": parameters,
    }
    return {"type": "function", "function": function}


WEATHER_TOOL = function_tool(
    "get_weather", "Current weather for a city", {"city": {"type": "string"}}, ["city"]
)
# One worked example makes the 135M model imitate the tool-call format.
FEW_SHOT: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer weather questions. Always call get_weather first."},
    {"role": "user", "content": "What's the weather in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c0", "content": "18C, cloudy"},
    {"role": "assistant", "content": "It is 18C and cloudy in Rome."},
    {"role": "user", "content": "What's the weather in Paris?"},
]


LANGFUSE_RECEIVER = (
    Path(__file__).resolve().parents[1] / "packages/core/tests/integrations/langfuse_receiver.py"
)


def langfuse_receiver() -> Any:
    """The wire-level Langfuse stand-in (`LANGFUSE_RECEIVER`), loaded by path once per process (tests
    are not a package) and kept in sys.modules, so every test file gets the same module."""
    if "langfuse_receiver" not in sys.modules:
        spec = importlib.util.spec_from_file_location("langfuse_receiver", LANGFUSE_RECEIVER)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["langfuse_receiver"] = module
        spec.loader.exec_module(module)
    return sys.modules["langfuse_receiver"]


def check_public_names(package: str, test_file: str) -> None:
    """`package.__all__` is exactly the names pinned in `public_names.txt` beside `test_file` (one a
    line, sorted), and each of them resolves: a package's API changes only on purpose, in that file."""
    import importlib

    module = importlib.import_module(package)
    pin = Path(test_file).with_name("public_names.txt")
    pinned = pin.read_text().split()
    assert pinned == sorted(set(pinned)), f"{pin}: keep the names sorted, each once"
    exported = sorted(module.__all__)
    added, removed = sorted(set(exported) - set(pinned)), sorted(set(pinned) - set(exported))
    assert exported == pinned, (
        f"{package}.__all__ differs from {pin}: added {added}, removed {removed}"
        " (or a name listed twice); change the pin when the API changes on purpose"
    )
    for name in exported:
        assert getattr(module, name) is not None, f"{package}.{name} is None"


def weather_tools(cities: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """[get_weather], its `city` limited to `cities` when given (a fresh copy each call)."""
    tool = copy.deepcopy(WEATHER_TOOL)
    if cities is not None:
        tool["function"]["parameters"]["properties"]["city"]["enum"] = list(cities)
    return [tool]


def few_shot() -> list[dict[str, Any]]:
    """FEW_SHOT, a fresh copy a test may change."""
    return copy.deepcopy(FEW_SHOT)


async def tool_round_trip(model: TrainableModel) -> tuple[Choice, Choice, Trajectory]:
    """FEW_SHOT on `model`: a forced get_weather call (seed 7), the tool's answer, a greedy reply.
    Returns (call choice, reply choice, the whole trajectory); a call not made leaves no tool turn."""
    from journeyman import Trajectory

    client = model.openai_client()
    tools, messages = weather_tools(), few_shot()
    # The 135M model rarely calls a tool on its own; tool_choice="required" constrains decoding to
    # a well-formed call of a listed tool, which is how agents use small models.
    first = await client.chat.completions.create(
        model=model.name,
        messages=messages,
        tools=tools,
        tool_choice="required",
        seed=7,
        temperature=0.7,
        max_tokens=60,
    )
    call = first.choices[0]
    traj = Trajectory(messages_and_choices=[*messages, call], tools=tools)
    if call.message.tool_calls:
        tool_call_id = call.message.tool_calls[0].id
        traj.messages_and_choices.append(
            {"role": "tool", "tool_call_id": tool_call_id, "content": "21C, sunny"}
        )
    second = await client.chat.completions.create(
        model=model.name,
        messages=traj.messages(),
        tools=tools,
        temperature=0,
        max_tokens=30,
    )
    traj.messages_and_choices.append(second.choices[0])
    return call, second.choices[0], traj


def _choice(
    message: dict[str, Any], prompt: Sequence[int] | None, sampled: Sequence[int], finish_reason: str
) -> dict[str, Any]:
    """A chat choice's JSON as the endpoint writes it; its token record (logprob -0.5 a token, step
    0, under the extra field `journeyman`) unless `prompt` is None (a foreign call's)."""
    from journeyman import TokenRecord

    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish_reason,
        "message": message,
        "logprobs": None,
    }
    if prompt is not None:
        choice["journeyman"] = TokenRecord(
            prompt_token_ids=list(prompt),
            token_ids=list(sampled),
            logprobs=[-0.5] * len(sampled),
            model="m@0",
            step=0,
            finish_reason=finish_reason,
        ).model_dump()
    return choice


def recorded_choice(
    content: str = "x", prompt_token_ids: Sequence[int] = (1, 2), token_ids: Sequence[int] = (5, 6)
) -> Choice:
    """An assistant choice as the endpoint returns it: `content` with its token record."""
    from openai.types.chat.chat_completion import Choice

    message = {"role": "assistant", "content": content}
    return Choice.model_validate(_choice(message, prompt_token_ids, token_ids, "stop"))


def captured_call(
    messages: list[dict[str, Any]],
    prompt: Sequence[int] | None,
    sampled: Sequence[int],
    message: dict[str, Any],
    tools: list[dict[str, Any]] | None,
) -> CapturedCall:
    """A call as the endpoint files it: `message` answered to `messages` (finished by its tool calls
    when it has some), with a token record unless `prompt` is None (a foreign call)."""
    from journeyman import CapturedCall

    finish = "tool_calls" if message.get("tool_calls") else "stop"
    response = {"id": "chatcmpl-x", "choices": [_choice(message, prompt, sampled, finish)]}
    return CapturedCall(request_messages=messages, tools=tools, response=response)


def embedded_chat_format() -> ChatFormat:
    """The embedded model's chat format: its tokenizer only (well under a second), never its weights."""
    from journeyman.chat.formats import ChatFormat
    from journeyman.policy.weights import DEFAULT_BASE_MODEL, resolve_base_model
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(resolve_base_model(DEFAULT_BASE_MODEL)))


class _Scripted:
    """One scripted model: its engine, the real endpoint over it, and that endpoint's server thread."""

    def __init__(self, engine: ScriptedEngine, endpoint: Endpoint, server: ServerThread) -> None:
        self.engine, self.endpoint, self.server = engine, endpoint, server


class ScriptedBackend:
    """A `jm.Backend` that serves each registered model from a `ScriptedEngine` through the real
    endpoint (rendering, splicing, records, captures, the OpenAI and Responses routes, the bearer
    token), loading no weights: for tests of what sits above the engine. It only serves:
    training and the run store raise NotImplementedError.

        backend = ScriptedBackend(chat_format, ["Hi!"])
        await model.register(backend)
        backend.engine(model).script = lambda call: "..."   # change the script any time
    """

    def __init__(
        self,
        chat_format: ChatFormat,
        script: Script = ("OK",),
        *,
        path: str | Path = ".journeyman-scripted",
        max_context: int = 8192,
    ) -> None:
        import secrets

        self.chat_format, self.script, self.path = chat_format, script, Path(path)
        self.max_context = max_context
        self.api_key = secrets.token_urlsafe(24)
        self._models: dict[str, _Scripted] = {}

    async def register(self, model: ModelConfig) -> None:
        if model.name in self._models:
            return
        from journeyman.engine.scripted import ScriptedEngine
        from journeyman.serving.endpoint import Endpoint, ServerThread, build_app
        from journeyman.serving.guard import DEFAULT_MAX_BODY_BYTES, Guard

        engine = ScriptedEngine(self.chat_format, self.script)
        endpoint = Endpoint(
            engine,
            self.chat_format,
            model.name,
            default_max_tokens=model.max_tokens,
            max_context=self.max_context,
            base_name=model.base_model,  # as LocalBackend serves it
        )
        server = ServerThread(Guard(build_app(endpoint), self.api_key, DEFAULT_MAX_BODY_BYTES))
        self._models[model.name] = _Scripted(engine, endpoint, server)

    def _get(self, model: ModelConfig | str) -> _Scripted:
        return self._models[model if isinstance(model, str) else model.name]

    def engine(self, model: ModelConfig | str) -> ScriptedEngine:
        return self._get(model).engine

    def endpoint(self, model: ModelConfig | str) -> Endpoint:
        return self._get(model).endpoint

    def inference(self, model_name: str | None = None) -> Inference:
        from journeyman import Inference

        name = model_name or next(reversed(self._models))
        return Inference(base_url=self._get(name).server.base_url, api_key=self.api_key, model=name)

    async def get_step(self, model: ModelConfig) -> int:
        return self.engine(model).step

    async def pop_captures(
        self, model: ModelConfig, capture_ids: Sequence[str]
    ) -> dict[str, list[CapturedCall]]:
        captures = self.endpoint(model).captures
        return {cid: captures.pop(cid) for cid in capture_ids}

    async def serve_step(self, model: ModelConfig, step: int) -> None:
        await self.engine(model).load_adapter(self.run_dir(model) / "checkpoints" / f"{step:04d}", step)

    def run_dir(self, model: ModelConfig) -> Path:
        return self.path / model.project / "models" / model.name

    async def train(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a ScriptedBackend serves only; train on a LocalBackend")

    train_sft = log = history = delete_checkpoints = train

    def close(self) -> None:
        for m in self._models.values():
            m.server.stop()
            m.engine.close()
        self._models.clear()


async def ask(model: TrainableModel, messages: Any, **request: Any) -> ChatCompletion:
    """A chat completion of `model` through its endpoint (its own OpenAI client, under its name)."""
    return await model.openai_client().chat.completions.create(model=model.name, messages=messages, **request)


async def check_stop_string(model: TrainableModel, messages: list[dict[str, Any]]) -> None:
    """Stop strings end a completion before them, finished as "stop" (the same check on every engine)."""
    stopped = await ask(model, messages, max_tokens=40, temperature=0, stop=["\n", "."])
    (choice,) = stopped.choices
    assert "." not in (choice.message.content or "") and choice.finish_reason == "stop"


async def wait_until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll `check` on the event loop (every 10 ms, so work on the loop goes on) until it holds; a
    check that never holds fails the test after `timeout_s`."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s"
        await asyncio.sleep(0.01)


def force_signal(groups: Sequence[TrajectoryGroup]) -> None:
    """Rewards 0, 1, 0, ... within each group: a step always has something to learn from."""
    for g in groups:
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2)


async def task_groups(
    model: TrainableModel, *, groups: int = 2, size: int = 2, max_tokens: int = 8, signal: bool = True
) -> list[TrajectoryGroup]:
    """`groups` groups of `size` rollouts of the built-in task's train scenarios, sampled by `model`;
    with `signal`, their rewards forced apart (`force_signal`)."""
    from journeyman import TrajectoryGroup, gather_trajectory_groups
    from journeyman.app import tasks

    client = model.openai_client()
    gathered = await gather_trajectory_groups(
        (
            TrajectoryGroup(tasks.rollout(model, client, s, max_tokens=max_tokens) for _ in range(size))
            for s in tasks.scenarios("train", groups)
        ),
        pbar_desc=None,
    )
    if signal:
        force_signal(gathered)
    return gathered


def one_node_graph(node: Callable[..., Any], name: str = "agent") -> Any:
    """A compiled LangGraph graph over `MessagesState` that runs `node` once: START -> name -> END."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    g = StateGraph(MessagesState)
    g.add_node(name, node)
    g.add_edge(START, name)
    g.add_edge(name, END)
    return g.compile()


# The 2-layer, 64-wide shape the CPU tests of the trainer, packing, sharding and precision build
# with random weights, in any architecture's transformers config.
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def tiny_llama_config(vocab_size: int = 128, max_position_embeddings: int = 256, **overrides: Any) -> Any:
    """A transformers LlamaConfig of `TINY_SHAPE`; `overrides` set any other field."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, **TINY_SHAPE, **overrides
    )


def tiny_model_dir() -> Path:
    """A random 2-layer Llama (`tiny_llama_config`) with the embedded model's tokenizer, saved once per
    machine: a `base_model` that a LocalBackend loads and trains in a second (it says nothing useful)."""
    import torch
    from journeyman.data.config import DEFAULT_BASE_MODEL
    from journeyman.data.paths import cache_dir
    from journeyman.policy.weights import resolve_base_model
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = cache_dir() / "test-models" / "viewer-tiny"
    if (out / ".complete").exists():
        return out
    tok = AutoTokenizer.from_pretrained(resolve_base_model(DEFAULT_BASE_MODEL))
    config = tiny_llama_config(
        len(tok),
        2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    (out / ".complete").write_text("ok\n")
    return out


def embedded_policy_with_adapter() -> Any:
    """A `LoraPolicy` of the embedded model whose adapter changes its outputs (PEFT starts LoRA's B
    at 0): seeded random B matrices, the policy's version bumped as a training step would."""
    import torch
    from journeyman.policy.lora import LoraPolicy
    from journeyman.policy.weights import DEFAULT_BASE_MODEL, resolve_base_model

    policy = LoraPolicy(resolve_base_model(DEFAULT_BASE_MODEL))
    with policy.editing(), torch.no_grad():
        gen = torch.Generator(policy.device).manual_seed(0)
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02, generator=gen)
        policy.version += 1
    return policy


async def streamed_chat(client: Any, ask: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
    """A chat completion asked with `stream=True`: its content deltas, and the token record its
    last chunk carries."""
    deltas: list[str] = []
    record: dict[str, Any] | None = None
    async for chunk in await client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason is not None:
                record = (choice.model_extra or {})["journeyman"]
    return deltas, record


class ChatServer:
    """An OpenAI-compatible `/v1/chat/completions` on 127.0.0.1 (a judge, a scenario generator) whose
    one assistant message answering a request is `await self.answer(body)`, a subclass's rule. It
    keeps every request body in `requests`; `routes` may add routes before it starts; `with` stops it."""

    def __init__(self) -> None:
        from fastapi import FastAPI, Request
        from journeyman.serving.endpoint import ServerThread
        from journeyman.serving.openai_http import chat_completion_body

        self.requests: list[dict[str, Any]] = []
        app = FastAPI()

        async def complete(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.requests.append(body)
            message = {"role": "assistant", "content": await self.answer(body)}
            return chat_completion_body(
                body["model"], [{"index": 0, "message": message, "finish_reason": "stop"}], 1, 1
            )

        complete.__annotations__ = {
            "request": Request,
            "return": dict,
        }  # FastAPI reads the class, not a string
        app.post("/v1/chat/completions")(complete)
        self.routes(app)
        self.server: ServerThread = ServerThread(app)
        self.base_url = self.server.base_url

    def routes(self, app: Any) -> None:
        """More routes of the server (none here)."""

    async def answer(self, body: dict[str, Any]) -> str:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @classmethod
    def module_fixture(cls, name: str) -> Any:
        """A pytest fixture called `name`: one server for the tests of a module, stopped after them."""
        import pytest

        @pytest.fixture(scope="module", name=name)
        def serve() -> Iterator[Self]:
            with cls() as server:
                yield server

        return serve


_TRAJ = re.compile(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', re.DOTALL)


def ruler_request(body: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """What a RULER request asks, read as any judge would: the trajectory ids its response schema
    allows, and each trajectory's text from the prompt (id -> text)."""
    schema = body["response_format"]["json_schema"]["schema"]
    ids = schema["properties"]["scores"]["items"]["properties"]["trajectory_id"]["enum"]
    return ids, dict(_TRAJ.findall(body["messages"][1]["content"]))


class RuleJudge(ChatServer):
    """A judge endpoint (test_ruler, test_art_compat): 10 for a trajectory that mentions Paris, 2
    otherwise; wrong on request."""

    def __init__(self) -> None:
        self.plan: list[str] = []  # how to answer the next requests: short | bad_ids | prose (then ok)
        super().__init__()

    async def answer(self, body: dict[str, Any]) -> str:
        ids, shown = ruler_request(body)
        scores = [
            {
                "trajectory_id": i,
                "explanation": "names Paris" if "Paris" in shown[i] else "no",
                "score": 10 if "Paris" in shown[i] else 2,
            }
            for i in ids
        ]
        mode = self.plan.pop(0) if self.plan else "ok"
        if mode == "short":
            scores = scores[:-1]
        elif mode == "bad_ids":
            scores[0]["trajectory_id"] = "99"
        return "I think they are all fine." if mode == "prose" else json.dumps({"scores": scores})


VENVS = Path(__file__).resolve().parent.parent / ".venvs"
"""Virtual environments of packages that cannot share the workspace's (verifiers pins mcp<2),
one per pinned requirements file, kept between runs: ignored by git, rebuilt when the file changes."""


def pinned_venv(requirements: Path, timeout_s: float = 900.0) -> str:
    """The Python of a virtual environment holding exactly `requirements` (uv, from the package index
    this machine uses), built once per version of that file; a failed install fails the test with the
    installer's output (never a skip: the test then would not run where it should)."""
    import hashlib
    import shutil
    import subprocess

    import pytest

    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()[:12]
    where = VENVS / f"{requirements.stem}-{digest}"
    python = where / "bin" / "python"
    if (where / ".complete").exists():
        return str(python)
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH: ./dev installs it")
    shutil.rmtree(where, ignore_errors=True)
    print(f"\nbuilding {where.relative_to(VENVS.parent)} from {requirements.name}", flush=True)
    for cmd in (
        [uv, "venv", "--quiet", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", str(where)],
        [
            uv,
            "pip",
            "install",
            "--quiet",
            "--compile-bytecode",
            "--python",
            str(python),
            "-r",
            str(requirements),
        ],
    ):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(cmd)} took over {timeout_s:.0f} s")
        if done.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (where / ".complete").write_text(requirements.read_text())
    return str(python)
