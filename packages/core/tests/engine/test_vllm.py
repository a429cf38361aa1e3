"""The vLLM engine (CPU build, its own environment) behind our endpoint: records, tools, training, hot-load.

At most one vLLM server runs at a time (each takes ~1 min and ~5 GB to start on this CPU), so the tests
run in file order: the supervisor's failure paths, then one shared server for the base-model checks,
the learning run (`run_demo` on that server's model), the check of its last hot-loaded adapter, and
a kill and restart. The
environment is provisioned on first use (`journeyman.engine.vllm_env`); these tests skip only when it
is absent and no package index is reachable.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import journeyman as jm
import jsonschema
import openai
import pytest
from _support import ask, check_stop_string, streamed_chat, tool_round_trip
from journeyman.app import tasks
from journeyman.app.demo import run_demo
from journeyman.engine import vllm_env
from journeyman.engine.vllm_engine import VLLMEngine
from journeyman.engine.vllm_server import VLLMConfig
from openai.types.chat import ChatCompletion

# Startup dominates on 2 shared cores (50 s idle, up to 4 min under load); learning took 104 s alone
# with 3 steps (0.152 -> 0.498, 8.0 SE); the suite runs 2 (see test_demo_learns.py).
pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def vllm_python(pytestconfig: pytest.Config) -> str:
    # Built once per machine, outside the checkout; the first run shows its progress (a few minutes).
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    try:
        if vllm_env.is_provisioned() or capture is None:
            return str(vllm_env.provision())
        with capture.global_and_fixture_disabled():
            return str(vllm_env.provision())
    except vllm_env.VLLMProvisionError as e:
        if e.unreachable:
            pytest.skip(f"no vLLM environment and no package index reachable to build one: {e}")
        raise


@pytest.fixture(scope="module")
async def vllm_served(vllm_python: str, tmp_path_factory: pytest.TempPathFactory):
    backend = jm.LocalBackend(
        path=tmp_path_factory.mktemp("vllm-runs"), engine=VLLMConfig(python=vllm_python)
    )
    model = jm.TrainableModel(name="vllm-policy", project="tests")
    await model.register(backend)
    engine = backend.service(model).engine
    assert isinstance(engine, VLLMEngine)
    print(f"\nvLLM server ready in {engine.server.startup_seconds:.1f} s")
    yield model, backend
    backend.close()
    assert not engine.server.alive()


def test_provisioning_without_a_reachable_index_says_how(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one case the vLLM tests skip: no index answers. The error says so and how to provision by hand."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a closed port: refused at once
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")  # uv installs when at hand: no backoff either
    monkeypatch.setenv("PIP_TIMEOUT", "3")
    env_dir = tmp_path / "vllm-env"
    with pytest.raises(vllm_env.VLLMProvisionError) as e:
        vllm_env.provision(env_dir, log=False)
    assert e.value.unreachable
    assert "no package index is reachable" in str(e.value) and "python -m journeyman.engine.vllm_env" in str(
        e.value
    )
    assert not vllm_env.is_provisioned(env_dir)


def test_server_dies_with_a_killed_parent(vllm_python: str, tmp_path: Path) -> None:
    """SIGKILL the process that started vLLM: the kernel's parent-death signal takes the server down."""
    from journeyman.policy.weights import DEFAULT_BASE_MODEL, resolve_base_model

    weights = resolve_base_model(DEFAULT_BASE_MODEL)
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from journeyman.engine.vllm_server import VLLMConfig, VLLMServer
        server = VLLMServer(Path({str(weights)!r}), VLLMConfig(python={vllm_python!r}, startup_timeout_s=300))
        server.port = 0
        server._spawn()  # start only: the parent dies long before the server would be ready
        Path({str(pid_file)!r}).write_text(str(server.pid))
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        child = int(pid_file.read_text())
        # Wait for vLLM's engine-core process: it too must go when the parent dies.
        deadline = time.monotonic() + 240
        while len(_group(child)) < 3 and time.monotonic() < deadline:
            assert _group(child), "the vLLM server exited on its own"
            time.sleep(0.5)
        assert len(_group(child)) >= 3
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 60
    while _group(child) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group(child), "the vLLM server outlived its parent"


def _group(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(")")[-1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


def test_start_failure_shows_the_server_log(vllm_python: str) -> None:
    from journeyman.engine.vllm_server import VLLMServer, VLLMStartError
    from journeyman.policy.weights import DEFAULT_BASE_MODEL, resolve_base_model

    server = VLLMServer(
        resolve_base_model(DEFAULT_BASE_MODEL),
        VLLMConfig(python=vllm_python, extra_args=["--no-such-flag"], startup_timeout_s=300),
    )
    with pytest.raises(VLLMStartError) as e:
        server.start()
    assert "exited with code" in str(e.value) and "--no-such-flag" in str(e.value)
    assert not server.alive()


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


SEA = [{"role": "user", "content": "Write a short poem about the sea."}]


async def test_greedy_records_match_the_in_process_engine(vllm_served, served) -> None:
    model, backend = vllm_served
    torch_model, _ = served
    expected_prompt, _ = backend.service(model).chat_format.prompt_ids(SEA)
    greedy = [
        await m.openai_client().chat.completions.create(
            model=m.name, messages=SEA, max_tokens=24, temperature=0
        )
        for m in (model, torch_model)
    ]
    via_vllm, via_torch = (jm.record_of(g.choices[0]) for g in greedy)
    assert via_vllm.prompt_token_ids == expected_prompt == via_torch.prompt_token_ids
    assert via_vllm.token_ids == via_torch.token_ids  # same weights, fp32, same ids in: same greedy path
    assert max_diff(via_vllm.logprobs, via_torch.logprobs) < 1e-3
    assert via_vllm.model == f"{model.name}@0" and via_vllm.step == 0


@pytest.fixture(scope="module")
async def seeded(vllm_served) -> ChatCompletion:
    """n=3 temperature-1 samples of one seed, with the top two alternatives of each token."""
    model, _ = vllm_served
    return await ask(model, SEA, max_tokens=24, temperature=1.0, n=3, seed=5, logprobs=True, top_logprobs=2)


async def test_n_samples_are_distinct_draws_recorded_exactly(vllm_served, seeded: ChatCompletion) -> None:
    """Each decodes to its message; its logprobs are the trainer's raw temperature-1 ones."""
    model, backend = vllm_served
    service = backend.service(model)
    records = [jm.record_of(c) for c in seeded.choices]
    assert len({tuple(r.token_ids) for r in records}) > 1
    for choice, rec in zip(seeded.choices, records, strict=True):
        assert service.chat_format.tokenizer.decode(rec.token_ids, skip_special_tokens=True) == (
            choice.message.content
        )
        assert (
            max_diff(service.policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids), rec.logprobs)
            < 1e-3
        )


def test_top_logprobs_come_in_order(seeded: ChatCompletion) -> None:
    for choice in seeded.choices:
        top = choice.logprobs.content[0].top_logprobs
        assert len(top) == 2 and top[0].logprob >= top[1].logprob


async def test_a_seed_reproduces_its_samples(vllm_served, seeded: ChatCompletion) -> None:
    model, _ = vllm_served
    again = await model.openai_client().chat.completions.create(
        model=model.name, messages=SEA, max_tokens=24, temperature=1.0, n=3, seed=5
    )
    assert [jm.record_of(c).token_ids for c in again.choices] == [
        jm.record_of(c).token_ids for c in seeded.choices
    ]


async def test_a_seeded_prompt_past_the_cpu_batch_budget_is_answered(vllm_served) -> None:
    """Longer than the CPU build's default 2048-token batch budget: chunked, its prefill killed
    vLLM's engine core (a CPU generator cannot rewind); the server now runs unchunked. 650 items:
    2524 tokens, past the budget with room to spare and a third less prefill than 900 (3524)."""
    model, backend = vllm_served
    long = [{"role": "user", "content": "Summarize: " + " ".join(f"item{i}" for i in range(650))}]
    assert 2048 < len(backend.service(model).chat_format.prompt_ids(long)[0]) < 4000
    out = await model.openai_client().chat.completions.create(
        model=model.name, messages=long, max_tokens=4, temperature=1.0, seed=3
    )
    assert len(jm.record_of(out.choices[0]).token_ids) > 0


async def test_a_stop_string_ends_the_completion_before_it(vllm_served) -> None:
    await check_stop_string(vllm_served[0], SEA)


async def test_tool_trajectory_through_vllm_is_token_exact(vllm_served) -> None:
    model, backend = vllm_served
    # tool_choice="required" has vLLM decode under a grammar (literal <tool_call> tags around JSON
    # matching a listed tool), as agents on small models do
    call, _, traj = await tool_round_trip(model)
    assert call.finish_reason == "tool_calls", call.message.content
    tool_call = call.message.tool_calls[0]
    rec1, rec2 = traj.records()
    fmt = backend.service(model).chat_format
    turn = fmt.parse(fmt.completion_text(rec1.token_ids))
    assert turn.content == call.message.content
    assert [(c["name"], json.loads(c["arguments"])) for c in turn.tool_calls] == [
        (tool_call.function.name, json.loads(tool_call.function.arguments))
    ]
    # the second prompt holds the first call's sampled ids verbatim (spliced, not re-rendered)
    assert rec2.spliced_turns >= 1
    start = len(rec1.prompt_token_ids)
    assert rec2.prompt_token_ids[: start + len(rec1.token_ids)] == rec1.prompt_token_ids + rec1.token_ids
    for rec in (rec1, rec2):
        assert (
            max_diff(
                backend.service(model).policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids),
                rec.logprobs,
            )
            < 1e-3
        )


async def test_json_schema_output_through_vllm(vllm_served) -> None:
    model, backend = vllm_served
    schema = {
        "type": "object",
        "properties": {
            "verdict": {"type": "string", "enum": ["yes", "no"]},
            "score": {"type": "integer", "enum": list(range(11))},
        },
        "required": ["verdict", "score"],
        "additionalProperties": False,
    }
    ask_json = [{"role": "user", "content": "Is the sea blue? Answer in JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    out = await ask(model, ask_json, max_tokens=30, seed=3, n=2, response_format=response_format)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert "\n" not in choice.message.content
        # vLLM masks logits before it scores them; the engine rescores so records hold unmasked logprobs
        rec = jm.record_of(choice)
        assert (
            max_diff(
                backend.service(model).policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids),
                rec.logprobs,
            )
            < 1e-3
        )


@pytest.mark.slow
async def test_grpo_learns_with_the_vllm_engine(vllm_served) -> None:
    """The core learning test (test_demo_learns.py's settings) with engine="vllm", on the shared server's
    model once the base-model checks above are done (a server of its own took another start)."""
    model, backend = vllm_served
    steps: list[dict[str, float]] = []
    t0 = time.perf_counter()
    result = await run_demo(
        backend=backend,
        name=model.name,
        project=model.project,
        steps=2,
        learning_rate=8e-4,
        on_step=lambda _, m: steps.append(m),
    )
    gaps = [m["engine_trainer_logprob_gap"] for m in steps]
    print(
        f"\nvLLM: held-out reward {result.before.mean:.3f}±{result.before.sem:.3f} -> "
        f"{result.after.mean:.3f}±{result.after.sem:.3f} ({result.gain_in_sems:.1f} SE) in "
        f"{time.perf_counter() - t0:.0f} s; engine-trainer logprob gap per step (mean |Δ|): "
        + " ".join(f"{g:.1e}" for g in gaps)
        + "; adapter loads: "
        + " ".join(f"{m['adapter_load_seconds']:.2f}" for m in steps)
        + " s"
    )
    assert result.gain_in_sems > 3, result
    # every step was sampled by vLLM on the adapter the trainer had just produced
    assert len(steps) == 2 and max(gaps) < 1e-3, gaps


def _rollout_groups(model: jm.TrainableModel, split: str, prompts: int, group_size: int, seed: int):
    client = model.openai_client()
    return jm.gather_trajectory_groups(
        (
            jm.TrajectoryGroup(tasks.rollout(model, client, s, max_tokens=40) for _ in range(group_size))
            for s in tasks.scenarios(split, prompts, seed=seed)
        ),
        pbar_desc=None,
    )


async def test_training_step_hot_loads_the_adapter_vllm_serves(vllm_served) -> None:
    """After a step, vLLM's logprobs for newly sampled tokens equal the trainer's to 1e-3 (fp32).

    The step is the learning run's last when it ran (it trained three, each hot-loaded); with it
    deselected (`-m "not slow"`) this test trains one of its own."""
    model, backend = vllm_served
    engine = backend.service(model).engine
    step = await model.get_step()  # 3 after the learning run
    if step == 0:
        groups = await _rollout_groups(model, "train", prompts=2, group_size=4, seed=11)
        # A large learning rate so the adapter moves logprobs far more than the 1e-3 tolerance.
        result = await model.train(groups, config=jm.TrainConfig(learning_rate=2e-3))
        assert not result.skipped and result.step == 1 == await model.get_step()
        assert result.metrics["adapter_load_seconds"] < 10
        step = result.step
    print(f"\nadapter hot-loads, engine-side: {' '.join(f'{s:.3f}' for s in engine.adapter_load_seconds)} s")
    assert len(engine.adapter_load_seconds) >= step and max(engine.adapter_load_seconds) < 10
    assert engine.served_model == f"policy@{step}"

    out = await ask(
        model, [{"role": "user", "content": "Tell me about the ocean."}], max_tokens=32, n=4, seed=1
    )
    policy = backend.service(model).policy
    moved = gap = 0.0
    for choice in out.choices:
        rec = jm.record_of(choice)
        assert rec.step == step and rec.model == f"{model.name}@{step}"
        gap = max(
            gap,
            max_diff(
                backend.service(model).policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids),
                rec.logprobs,
            ),
        )
        with policy.base_only():
            moved = max(
                moved,
                max_diff(
                    backend.service(model).policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids),
                    rec.logprobs,
                ),
            )
    print(
        f"after one step + hot-load: max |vLLM - trainer| logprob {gap:.2e}; base model differs by {moved:.2f}"
    )
    assert gap < 1e-3
    assert moved > 1e-2, "the served logprobs should differ from the base model's after a step"

    # the base model under its own name, as vLLM serves it beside the LoRA: the adapter's effect is gone
    base = await model.openai_client().chat.completions.create(
        model=model.base_model,
        messages=[{"role": "user", "content": "Tell me about the ocean."}],
        max_tokens=16,
    )
    rec = jm.record_of(base.choices[0])
    assert rec is not None and rec.step == 0 and base.model == model.base_model
    with policy.base_only():
        base_gap = max_diff(policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids), rec.logprobs)
    assert base_gap < 1e-3, base_gap


async def test_a_killed_server_fails_its_requests_fast_and_is_restarted_on_the_served_step(
    vllm_served,
) -> None:
    """SIGKILL mid-batch: the requests vLLM held fail within seconds (503), requests during the
    restart are refused at once, and the restarted server serves the adapter of the step it served."""
    model, backend = vllm_served
    engine = backend.service(model).engine
    assert isinstance(engine, VLLMEngine) and engine.step >= 1
    step = engine.step
    client = model.openai_client().with_options(max_retries=0, timeout=120)

    async def ask(max_tokens: int = 256) -> Any:
        return await client.chat.completions.create(
            model=model.name,
            messages=[{"role": "user", "content": "Tell me a long story about the sea."}],
            max_tokens=max_tokens,
            temperature=1.0,
        )

    inflight = [asyncio.create_task(ask()) for _ in range(8)]
    async with httpx.AsyncClient(base_url=engine.base_url, timeout=5) as vllm:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until vLLM reports requests running (its Prometheus gauge)
            text = (await vllm.get("/metrics")).text
            running = re.findall(r"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.]+)$", text, re.M)
            if sum(float(x) for x in running) > 0:
                break
            await asyncio.sleep(0.05)
    killed_at = time.perf_counter()
    os.kill(engine.server.pid or 0, signal.SIGKILL)
    results = await asyncio.gather(*inflight, return_exceptions=True)
    failed_within = time.perf_counter() - killed_at
    refused = [r for r in results if isinstance(r, openai.APIStatusError) and r.status_code == 503]
    others = [repr(r)[:300] for r in results if r not in refused and not isinstance(r, ChatCompletion)]
    assert refused and not others, others
    assert "exited" in refused[0].message and failed_within < 15, (refused[0].message, failed_within)

    with pytest.raises(openai.APIStatusError) as during:  # not queued behind a minute of startup
        await ask(8)
    assert during.value.status_code == 503 and "restarting" in during.value.message

    deadline = time.monotonic() + 600
    while engine.down is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert engine.down is None and engine.restarts == 1
    out = await ask(8)
    assert jm.record_of(out.choices[0]).step == step and engine.served_model == f"policy@{step}"
    print(
        f"\nkilled vLLM: {len(refused)}/8 in-flight failed in {failed_within:.2f} s; restarted in "
        f"{engine.server.startup_seconds:.0f} s on step {engine.step}"
    )


async def test_a_stream_through_vllm_sends_tokens_as_they_come(vllm_served) -> None:
    """vLLM's own stream feeds the endpoint's: more than one content delta, the same text and token
    record as the unstreamed greedy request."""
    model, _ = vllm_served
    client = model.openai_client()
    ask: dict[str, Any] = {"model": model.name, "messages": SEA, "max_tokens": 24, "temperature": 0}
    deltas, record = await streamed_chat(client, ask)
    whole = await client.chat.completions.create(**ask)
    assert len(deltas) > 1, deltas
    assert "".join(deltas) == whole.choices[0].message.content
    assert record is not None and record["token_ids"] == jm.record_of(whole.choices[0]).token_ids
    assert record["logprobs"] == pytest.approx(jm.record_of(whole.choices[0]).logprobs, abs=1e-4)


async def test_a_teacher_served_by_vllm_scores_sampled_tokens_as_the_trainer_does(
    vllm_served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM as a distillation teacher: its served step (a LoRA) scores the ids the student sampled by
    `/v1/completions` (echo, max_tokens=0, logprobs=0), in one batched request; the tokenizer probe
    passes; each teacher logprob is the trainer's at that step to 1e-3 (fp32)."""
    from journeyman.backends.teachers import score_for_step

    model, backend = vllm_served
    s = backend.service(model)
    engine = s.engine
    assert isinstance(engine, VLLMEngine)
    monkeypatch.setenv("JM_TEST_TEACHER_KEY", engine.server.api_key)
    teacher = jm.Teacher(
        base_url=f"{engine.server.base_url}/v1", model=engine.served_model, api_key_env="JM_TEST_TEACHER_KEY"
    )
    groups = await _rollout_groups(model, "train", prompts=2, group_size=2, seed=3)
    counts = await score_for_step(s, groups, teacher)
    assert counts["teacher_sequences"] == 4 and counts["teacher_tokens"] > 0
    gap = 0.0
    for rec in (r for g in groups for t in g.trajectories for r in t.records()):
        assert rec.teacher_logprobs is not None
        gap = max(
            gap,
            max_diff(s.policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids), rec.teacher_logprobs),
        )
    print(f"\nvLLM teacher ({engine.served_model}): |teacher - trainer| logprob {gap:.1e}")
    assert gap < 1e-3, gap


async def test_live_training_samples_its_candidate_beside_the_promoted_step_on_vllm(vllm_served) -> None:
    """The canary on vLLM: a live candidate is a second LoRA in the same server; a share of episodes
    (by id) is sampled by it, stamped with its step, token-exact against the trainer at that step;
    when the canary wins, the candidate is promoted and served to everyone. Last in the file: live
    training then decides what this model serves."""
    model, backend = vllm_served
    engine = backend.service(model).engine
    assert isinstance(engine, VLLMEngine)
    p0 = await model.get_step()
    gate = jm.GateConfig(canary_share=0.5, canary_episodes=2, rollback_episodes=1000)
    await model.live(jm.LiveConfig(episodes_per_step=4, settle_s=0.2, gate=gate))
    run = backend.service(model).live
    client = model.openai_client()

    async def episode(i: int) -> tuple[str, ChatCompletion]:
        eid = f"vllm-canary-{i}"
        with model.episode(eid):
            out = await client.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": f"Add item {i}."}], max_tokens=8
            )
        return eid, out

    try:
        for i in range(4):  # rewards that differ: a candidate trains from the promoted step
            eid, _ = await episode(i)
            await model.report_outcome(eid, float(i % 2))
        deadline = time.monotonic() + 300
        while run.candidate is None:
            assert time.monotonic() < deadline, "no candidate trained"
            await asyncio.sleep(0.1)
        c = run.candidate
        assert run.parents[c] == p0 and engine.served_model == f"policy@{p0}"
        canary: list[ChatCompletion] = []
        i = 4
        while run.candidate == c:  # the canary wins every episode: promoted
            assert i < 200, "the gate never decided"
            eid, out = await episode(i)
            step = int(out.model.rsplit("@", 1)[1])
            rec = jm.record_of(out.choices[0])
            assert rec is not None and rec.step == step in (p0, c)
            if step == c:
                canary.append(out)
            await model.report_outcome(eid, 1.0 if step == c else 0.0)
            i += 1
        while run.busy is not None and not run.busy.done():
            await asyncio.sleep(0.1)
        assert run.promoted == c and await model.get_step() == c and engine.served_model == f"policy@{c}"
        assert canary, "no episode was routed to the candidate"
        # what vLLM sampled with the candidate beside the promoted step is the trainer's step c
        policy = backend.service(model).policy
        rec = jm.record_of(canary[0].choices[0])
        assert rec is not None
        gap = max_diff(policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids), rec.logprobs)
        assert gap < 1e-3, gap
        print(f"\nvLLM canary: {len(canary)} of {i - 4} episodes on step {c}; |vLLM - trainer| {gap:.1e}")
    finally:
        await model.live(jm.LiveConfig(enabled=False))
