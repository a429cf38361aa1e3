"""The OpenAI-compatible endpoint: token-exact records, batching and sampling on the real embedded
model; the endpoint's own mechanics (validation, errors, streaming, captures, the Responses route)
on a scripted engine (`engine/scripted.py`), which needs no weights."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import journeyman as jm
import openai
import pytest
from _support import (
    ask,
    check_stop_string,
    embedded_policy_with_adapter,
    few_shot,
    streamed_chat,
    tool_round_trip,
    wait_until,
    weather_tools,
)
from journeyman.training.rows import trajectory_rows

pytestmark = pytest.mark.integration

TOOLS = weather_tools()
FEW_SHOT = few_shot()


@pytest.fixture(scope="module")
async def three_turn(served) -> dict[str, Any]:
    """A forced tool call, the tool's answer, a free answer: one trajectory on the real model."""
    call, answer, traj = await tool_round_trip(served[0])
    rec1, rec2 = traj.records()
    return {"call": call, "answer": answer, "rec1": rec1, "rec2": rec2, "served": served}


def test_a_forced_tool_call_parses_back_from_its_sampled_ids(three_turn) -> None:
    call, rec1 = three_turn["call"], three_turn["rec1"]
    model, backend = three_turn["served"]
    fmt = backend.service(model).chat_format
    assert call.finish_reason == "tool_calls", call.message.content
    turn = fmt.parse(fmt.completion_text(rec1.token_ids))
    assert turn.content == call.message.content
    tool_call = call.message.tool_calls[0]
    assert [(c["name"], json.loads(c["arguments"])) for c in turn.tool_calls] == [
        (tool_call.function.name, json.loads(tool_call.function.arguments))
    ]


def test_a_free_answer_decodes_to_its_content(three_turn) -> None:
    model, backend = three_turn["served"]
    tok = backend.service(model).chat_format.tokenizer
    answer = three_turn["answer"].message.content
    assert tok.decode(three_turn["rec2"].token_ids, skip_special_tokens=True) == answer


def test_the_next_prompt_holds_the_sampled_turn_verbatim(three_turn) -> None:
    """Spliced, not re-rendered: the first call's prompt and sampled ids open the second's prompt."""
    rec1, rec2 = three_turn["rec1"], three_turn["rec2"]
    model, backend = three_turn["served"]
    fmt = backend.service(model).chat_format
    assert rec2.spliced_turns >= 1
    start = len(rec1.prompt_token_ids)
    assert rec2.prompt_token_ids[:start] == rec1.prompt_token_ids
    sampled = rec1.token_ids
    spliced = rec2.prompt_token_ids[start : start + len(sampled)]
    # the sampled turn exactly; one that stopped on another of the family's stop tokens (sampling
    # chose it) is closed by the template's own
    assert spliced == sampled or (
        sampled[-1] in fmt.stop_ids and spliced[:-1] == sampled[:-1] and spliced[-1] in fmt.stop_ids
    )


def test_recorded_logprobs_are_the_trainers_within_1e_3(three_turn) -> None:
    """Teacher-forced through the same weights (fp32), each record's logprobs come back."""
    model, backend = three_turn["served"]
    policy = backend.service(model).policy
    for rec in (three_turn["rec1"], three_turn["rec2"]):
        again = policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids)
        assert max(abs(a - b) for a, b in zip(again, rec.logprobs, strict=True)) < 1e-3


async def test_32_concurrent_requests_are_batched(served) -> None:
    model, backend = served
    engine = backend.service(model).engine
    client = model.openai_client()
    batches_before = engine.batches
    results = await asyncio.gather(
        *[
            client.chat.completions.create(
                model=model.name,
                messages=[{"role": "user", "content": f"Name a color #{i}"}],
                max_tokens=8,
                seed=i,
            )
            for i in range(32)
        ]
    )
    assert all(len(jm.record_of(r.choices[0]).token_ids) >= 1 for r in results)
    assert engine.batches - batches_before < 16  # many requests per forward pass, not one each


POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
OSLO = [{"role": "user", "content": "Weather in Oslo?"}]


async def test_a_seed_reproduces_its_sample(served) -> None:
    model, _ = served
    client = model.openai_client()
    a, b = [
        await client.chat.completions.create(
            model=model.name, messages=POEM, max_tokens=12, seed=3, top_p=0.9
        )
        for _ in range(2)
    ]
    assert jm.record_of(a.choices[0]).token_ids == jm.record_of(b.choices[0]).token_ids


async def test_a_stop_string_ends_the_completion_before_it(served) -> None:
    await check_stop_string(served[0], POEM)


async def test_a_named_tool_choice_forces_that_tool(served) -> None:
    model, _ = served
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    get_time = {"type": "function", "function": {"name": "get_time"}}
    forced = await ask(model, OSLO, tools=tools, tool_choice=get_time, temperature=1.0, seed=3, max_tokens=40)
    assert forced.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in forced.choices[0].message.tool_calls] == ["get_time"]


async def test_a_forced_call_cut_by_max_tokens_is_length_and_its_tokens_still_train(served) -> None:
    """No half-parsed call: the text stays content, the turn is "length", its ids train."""
    model, backend = served
    get_weather = {"type": "function", "function": {"name": "get_weather"}}
    unknown = {"store": True, "frobnicate": {"x": 1}}  # unknown fields: ignored, as vLLM does
    cut = await ask(model, OSLO, tools=TOOLS, tool_choice=get_weather, max_tokens=6, extra_body=unknown)
    (choice,) = cut.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls, choice
    record = jm.record_of(choice)
    assert len(record.token_ids) == 6 and record.finish_reason == "length"
    traj = jm.Trajectory(messages_and_choices=[*OSLO, choice])
    (row,) = trajectory_rows(traj, backend.service(model).chat_format, advantage=1.0)
    assert row.input_ids[-6:] == record.token_ids and row.trained[-6:] == [True] * 6


# -- the endpoint's own mechanics, on a scripted engine ------------------------------------------

HI = [{"role": "user", "content": "hi"}]


def _echo(call) -> str:
    """A reply that is a function of the prompt: the same prompt, the same answer, on any route."""
    return f"Seen {len(call.prompt_ids)} tokens, ending {call.prompt_ids[-3:]}."


async def test_a_scripted_reply_is_recorded_with_its_exact_ids(scripted, chat_format) -> None:
    model, backend = scripted
    backend.engine(model).script = ["Blue, mostly."]
    r = await model.openai_client().chat.completions.create(model=model.name, messages=HI)
    record = jm.record_of(r.choices[0])
    assert r.choices[0].message.content == "Blue, mostly." and r.choices[0].finish_reason == "stop"
    assert record.prompt_token_ids == chat_format.prompt_ids(HI)[0]
    assert record.token_ids == [*chat_format.encode("Blue, mostly."), backend.engine(model).end_id]
    assert record.logprobs == backend.engine(model).logprob_fn(record.prompt_token_ids, record.token_ids)


async def test_a_scripted_engine_replies_with_exact_ids_and_refuses_work_once_closed(chat_format) -> None:
    from journeyman.engine.base import SamplingParams
    from journeyman.engine.scripted import ScriptedEngine

    engine = ScriptedEngine(chat_format, [[11, 12, chat_format.eos_id, 13]])
    (sample,) = await engine.generate([1, 2, 3], SamplingParams(max_tokens=8))
    assert sample.token_ids == [11, 12, chat_format.eos_id] and sample.finish_reason == "stop"  # a real stop
    assert engine.requests == [([1, 2, 3], SamplingParams(max_tokens=8))]
    engine.close()
    assert not engine.alive
    with pytest.raises(jm.EngineDownError):
        await engine.generate([1], SamplingParams())


async def test_n_max_tokens_and_seed_reach_the_engine(scripted) -> None:
    model, backend = scripted
    backend.engine(model).script = ["One two three four five six.", "Seven."]
    client = model.openai_client()
    both = await client.chat.completions.create(model=model.name, messages=HI, n=2, seed=0)
    assert [c.message.content for c in both.choices] == ["One two three four five six.", "Seven."]
    cut = await client.chat.completions.create(model=model.name, messages=HI, max_tokens=2, seed=0)
    assert cut.choices[0].finish_reason == "length" and len(jm.record_of(cut.choices[0]).token_ids) == 2
    stopped = await client.chat.completions.create(model=model.name, messages=HI, stop=[" three"], seed=0)
    assert stopped.choices[0].message.content == "One two" and stopped.choices[0].finish_reason == "stop"


async def test_logprobs_hold_the_asked_alternatives_and_the_records_numbers(scripted) -> None:
    model, _ = scripted
    lp = await model.openai_client().chat.completions.create(
        model=model.name, messages=POEM, max_tokens=5, logprobs=True, top_logprobs=3, max_completion_tokens=5
    )
    content = lp.choices[0].logprobs.content
    record = jm.record_of(lp.choices[0])
    assert len(content) == len(record.token_ids) and len(content[0].top_logprobs) == 3
    assert content[0].logprob == pytest.approx(record.logprobs[0])


async def test_a_stream_says_what_the_same_request_unstreamed_says(scripted) -> None:
    model, backend = scripted
    backend.engine(model).script = _echo
    client = model.openai_client()
    stream = await client.chat.completions.create(model=model.name, messages=POEM, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    whole = await client.chat.completions.create(model=model.name, messages=POEM)
    assert text == whole.choices[0].message.content


async def test_the_model_is_listed_by_name_and_step(scripted) -> None:
    model, _ = scripted
    listed = await model.openai_client().models.list()
    # and the base model under its own name, as vLLM lists it beside its LoRAs (test_base_model.py)
    assert [m.id for m in listed.data] == [model.name, f"{model.name}@0", model.base_model]


async def test_an_unknown_model_is_a_404_naming_it(scripted) -> None:
    model, _ = scripted
    with pytest.raises(openai.NotFoundError) as e:
        await model.openai_client().chat.completions.create(model="no-such-model", messages=HI)
    assert "no-such-model" in str(e.value)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": 0}, "n"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role")],
    ids=["n", "role"],
)
async def test_a_bad_field_is_a_400_naming_it(scripted, fields: dict[str, Any], param: str) -> None:
    model, _ = scripted
    with pytest.raises(openai.BadRequestError) as e:
        await model.openai_client().chat.completions.create(**{"model": model.name, "messages": HI, **fields})
    assert e.value.body["param"] == param


async def test_a_body_that_is_not_json_or_lacks_messages_is_a_400(scripted) -> None:
    model, _ = scripted
    async with _http(model) as http:  # the endpoint's door wants its token
        r = await http.post("/chat/completions", content=b"{not json")
        assert r.status_code == 400
        r = await http.post("/chat/completions", json={"model": model.name})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


async def test_a_prompt_past_the_context_is_refused_before_the_engine(scripted) -> None:
    model, backend = scripted
    asked = len(backend.engine(model).requests)
    with pytest.raises(openai.BadRequestError) as e:
        await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "word " * 40_000}], max_tokens=4
        )
    assert e.value.body["param"] == "messages" and "8192-token context" in e.value.body["message"]
    assert len(backend.engine(model).requests) == asked


async def test_max_tokens_past_the_context_names_what_fits(scripted) -> None:
    model, _ = scripted
    with pytest.raises(openai.BadRequestError) as e:
        await model.openai_client().chat.completions.create(model=model.name, messages=HI, max_tokens=9000)
    assert e.value.body["param"] == "max_tokens" and "at most" in e.value.body["message"]


async def test_an_engine_that_does_not_answer_in_time_is_a_504_naming_the_limit(scripted) -> None:
    model, backend = scripted
    backend.engine(model).delay_s = 5.0
    backend.endpoint(model).request_timeout_s = 0.05
    with pytest.raises(openai.APIStatusError) as e:
        await model.openai_client(max_retries=0).chat.completions.create(model=model.name, messages=HI)
    assert e.value.status_code == 504 and "request_timeout_s" in e.value.message


async def test_capture_scopes_keep_concurrent_episodes_apart(scripted) -> None:
    model, _ = scripted
    client = model.openai_client()

    async def episode(i: int) -> tuple[int, list[str]]:
        async with model.capture() as cap:
            for turn in range(2):
                await client.chat.completions.create(
                    model=model.name,
                    messages=[{"role": "user", "content": f"episode {i} turn {turn}"}],
                    max_tokens=3,
                )
        return i, [c.request_messages[-1]["content"] for c in cap.calls]

    for i, seen in await asyncio.gather(*[episode(i) for i in range(6)]):
        assert seen == [f"episode {i} turn 0", f"episode {i} turn 1"]


@pytest.mark.parametrize(
    ("choice", "field"),
    [
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ("sometimes", "tool_choice"),
    ],
    ids=["unknown-tool", "unknown-mode"],
)
async def test_a_bad_tool_choice_is_named(scripted, choice: Any, field: str) -> None:
    model, _ = scripted
    with pytest.raises(openai.BadRequestError) as e:
        await model.openai_client().chat.completions.create(
            model=model.name, messages=HI, tools=TOOLS, tool_choice=choice
        )
    assert e.value.body["param"] == field


async def test_the_responses_route_records_what_the_chat_route_records(scripted, chat_format) -> None:
    """/v1/responses (the Agents SDK's default API) goes through the same endpoint and records."""
    model, backend = scripted
    backend.engine(model).script = _echo
    client = model.openai_client()
    resp = await client.responses.create(
        model=model.name, instructions="Answer in one word.", input="What colour is the sky?"
    )
    (record,) = [jm.TokenRecord.model_validate(r) for r in resp.model_extra["journeyman"]]
    assert chat_format.tokenizer.decode(record.token_ids, skip_special_tokens=True) == resp.output_text
    chat = await client.chat.completions.create(
        model=model.name,
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What colour is the sky?"},
        ],
    )
    assert jm.record_of(chat.choices[0]).prompt_token_ids == record.prompt_token_ids
    assert chat.choices[0].message.content == resp.output_text


async def test_the_responses_route_refuses_a_previous_response_id(scripted) -> None:
    model, _ = scripted
    with pytest.raises(openai.BadRequestError) as e:
        await model.openai_client().responses.create(
            model=model.name, input="hi", previous_response_id="resp_x"
        )
    assert e.value.body["param"] == "previous_response_id"


async def test_sampling_on_merged_weights_records_the_trainers_logprobs() -> None:
    """The engine samples with the adapter merged into the base weights; what it records must be
    what the trainer computes on the unmerged model, and unmerging must give the base back."""
    from journeyman.engine.base import SamplingParams
    from journeyman.engine.torch_engine import TorchEngine

    policy = embedded_policy_with_adapter()  # unmerged now: its base layers are the base model's
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "base_layer" in n}
    engine = TorchEngine(policy, stop_ids={policy.tokenizer.eos_token_id})
    try:
        prompt = policy.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Name three rivers."}], add_generation_prompt=True, return_dict=False
        )
        samples = await engine.generate(list(prompt), SamplingParams(n=4, max_tokens=16, seed=3))
        changed = max(
            (p - base[n]).abs().max().item() for n, p in policy.model.named_parameters() if n in base
        )
        assert changed > 1e-3  # merged: the adapter's product sits in the base weights
        gaps = [
            max(
                abs(a - b)
                for a, b in zip(policy.sampled_logprobs(list(prompt), s.token_ids), s.logprobs, strict=True)
            )
            for s in samples
        ]
        assert max(gaps) < 1e-4, gaps
        restored = max(
            (p - base[n]).abs().max().item() for n, p in policy.model.named_parameters() if n in base
        )
        assert restored < 1e-6  # `sampled_logprobs` unmerged them: fp32 round-off at most
    finally:
        engine.close()


async def test_a_request_arriving_mid_batch_joins_it_and_is_answered_first(served) -> None:
    """Continuous batching: a short request sent while a long one samples joins that batch (no
    wait for it to finish) and is answered as soon as its own row is done; both records stay what
    the trainer computes."""
    from journeyman.engine.base import SamplingParams
    from journeyman.engine.torch_engine import TorchEngine

    model, backend = served
    policy = backend.service(model).policy
    engine = TorchEngine(policy, stop_ids=set())  # no stop token: rows sample max_tokens
    tok = policy.tokenizer

    def prompt(text: str) -> list[int]:
        return list(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
            )
        )

    try:
        long = asyncio.create_task(
            engine.generate(prompt("Tell me a story."), SamplingParams(max_tokens=48, seed=1))
        )
        while engine.batches == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # a few decode steps in
        [short] = await engine.generate(prompt("Say hi."), SamplingParams(max_tokens=4, seed=2, n=1))
        assert not long.done() and engine.rows_joined == 1 and engine.batches == 2
        [longer] = await long
        assert len(short.token_ids) == 4 and len(longer.token_ids) == 48
        for text, s in (("Say hi.", short), ("Tell me a story.", longer)):
            again = policy.sampled_logprobs(prompt(text), s.token_ids)
            assert max(abs(a - b) for a, b in zip(again, s.logprobs, strict=True)) < 1e-4
    finally:
        engine.close()


async def test_a_burst_handed_over_one_by_one_samples_as_one_batch(served) -> None:
    """The endpoint hands a burst of requests to the engine a few ms apart (it renders each in
    turn). A new batch gathers until none has come for `batch_wait_s`, so the burst samples as one
    batch, not the first request alone and the rest after it; a longer gap starts another batch."""
    from journeyman.engine.base import SamplingParams
    from journeyman.engine.torch_engine import TorchEngine

    model, backend = served
    policy = backend.service(model).policy
    # Wide margins, so a loaded test machine's scheduling jitter cannot split or join batches.
    engine = TorchEngine(policy, stop_ids=set(), batch_wait_s=0.2, batch_wait_max_s=5.0)
    prompt = list(
        policy.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_dict=False
        )
    )

    async def after(seconds: float) -> None:
        await asyncio.sleep(seconds)
        await engine.generate(prompt, SamplingParams(max_tokens=2, seed=1))

    try:
        # 8 requests 60 ms apart: 420 ms from first to last, past a fixed 200 ms window from the first
        await asyncio.gather(*(after(0.06 * i) for i in range(8)))
        assert engine.batches == 1
        await asyncio.gather(after(0.0), after(2.0))  # 2 s apart: two batches
        assert engine.batches == 3
    finally:
        engine.close()


async def test_a_training_step_gets_the_weights_from_an_engine_that_never_runs_dry(served, tmp_path) -> None:
    """Requests queue faster than batches end (more than a batch holds, each answered one re-sent,
    so rows keep joining the running batch): a step (`editing`) and its checkpoint (`save`) still
    get the weights within a few decode steps, and sampling goes on after them. (The soak hung
    here: the checkpoint waited on the lock of a batch that never ended.)"""
    import time

    from journeyman.engine.base import SamplingParams
    from journeyman.engine.torch_engine import TorchEngine

    model, backend = served
    policy = backend.service(model).policy
    engine = TorchEngine(policy, stop_ids=set(), max_batch_rows=4)
    prompt = policy.tokenizer.encode("Count to ten:")
    answered = 0
    stop = asyncio.Event()

    async def client(i: int) -> None:
        nonlocal answered
        while not stop.is_set():
            await engine.generate(prompt, SamplingParams(max_tokens=3 + i % 7, seed=i))  # staggered ends
            answered += 1

    clients = [asyncio.create_task(client(i)) for i in range(12)]  # 12 rows for a 4-row batch
    try:
        while answered < 4:
            await asyncio.sleep(0.05)

        def step() -> float:
            t0 = time.perf_counter()
            with policy.editing():
                time.sleep(0.2)  # the step holds the weights a while
            policy.save(tmp_path / "checkpoint")
            return time.perf_counter() - t0

        waited = await asyncio.wait_for(asyncio.to_thread(step), timeout=90)
        before = answered
        while answered < before + 4:  # and sampling resumes
            await asyncio.sleep(0.05)
        assert waited < 30, waited
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), timeout=60)
        engine.close()


async def test_torch_work_runs_on_the_sampling_thread_between_batches(served) -> None:
    """`engine.call` (how the backend runs a training step, a save or a load) runs on the engine's
    own thread once the running rows are done, ahead of requests that came after it (which join no
    running rows meanwhile); its error comes back to the caller and sampling goes on; a closed
    engine refuses it by name."""
    import threading

    from journeyman.engine.base import SamplingParams
    from journeyman.engine.torch_engine import TorchEngine
    from journeyman.errors import EngineDownError

    model, backend = served
    policy = backend.service(model).policy
    engine = TorchEngine(policy, stop_ids=set())  # no stop token: rows sample max_tokens
    prompt = policy.tokenizer.encode("Count to ten:")
    seen: dict[str, object] = {}

    def work() -> str:
        # what the engine thread knows now (the caller's future is settled later, on its loop)
        seen.update(thread=threading.current_thread(), batches=engine.batches, served=engine.requests_served)
        return "done"

    def fail() -> None:
        raise ValueError("bad step")

    try:
        first = asyncio.create_task(engine.generate(prompt, SamplingParams(max_tokens=24, seed=1)))
        while engine.batches == 0:
            await asyncio.sleep(0.01)
        call = asyncio.create_task(engine.call(work))
        await asyncio.sleep(0.05)  # the call is pending before the three are queued
        queued = [
            asyncio.create_task(engine.generate(prompt, SamplingParams(max_tokens=2, seed=i)))
            for i in range(3)
        ]
        assert await call == "done"
        assert seen == {"thread": engine.scheduler.thread, "batches": 1, "served": 1}
        await asyncio.gather(first, *queued)
        assert engine.batches == 2  # the queued three sampled together, after the call
        with pytest.raises(ValueError, match="bad step"):
            await engine.call(fail)
        [again] = await engine.generate(prompt, SamplingParams(max_tokens=2, seed=9))
        assert len(again.token_ids) == 2
    finally:
        engine.close()
    with pytest.raises(EngineDownError, match="closed"):
        await engine.call(work)


@pytest.mark.parametrize(("q_len", "window"), [(1, None), (5, None), (1, 30), (5, 30)])
def test_slot_attention_is_the_models_own_attention(q_len: int, window: int | None) -> None:
    """Rows in slots that read part of one shared prefix give what SDPA gives on each row's own
    keys (its prefix part, then its slots): grouped-query heads, rows reading different lengths of
    the prefix (one none), slots not filled yet; one token a row (decode) or several (a prefill
    chunk, causal within the row); with and without a sliding window (Mistral's)."""
    import torch
    from journeyman.engine.kv import KVPlan
    from journeyman.engine.slot_attention import slot_attention

    g = torch.Generator().manual_seed(0)
    rows, kv_heads, rep, d, prefix, slots = 4, 3, 3, 64, 40, 24
    uses = torch.tensor([40, 0, 17, 40])  # prefix tokens each row reads
    starts = torch.tensor([6, 11, 0, 19])  # filled slots before this pass's tokens
    k_pre, v_pre = (torch.randn(kv_heads, prefix, d, generator=g) for _ in range(2))
    key, value = (torch.randn(rows, kv_heads, slots, d, generator=g) for _ in range(2))
    query = torch.randn(rows, kv_heads * rep, q_len, d, generator=g)
    write = starts[:, None] + torch.arange(q_len)
    own_mask = torch.arange(slots) <= write[:, :, None]
    plan = KVPlan(
        [key], [value], write, slots, own_mask, [k_pre], [v_pre], torch.arange(prefix) < uses[:, None]
    )
    module = torch.nn.Module()
    module.layer_idx = 0
    got, _ = slot_attention(
        module, query, key, value, None, jm_plan=plan, scaling=d**-0.5, sliding_window=window
    )
    assert got.shape == (rows, q_len, kv_heads * rep, d)
    for r in range(rows):
        p = int(uses[r])
        k = torch.cat([k_pre[:, :p], key[r]], dim=1).repeat_interleave(rep, dim=0)
        v = torch.cat([v_pre[:, :p], value[r]], dim=1).repeat_interleave(rep, dim=0)
        mask = torch.cat([torch.ones(q_len, p, dtype=torch.bool), own_mask[r]], dim=1)
        if window:
            key_pos = torch.cat([torch.arange(p), p + torch.arange(slots)])
            mask &= key_pos > (p + write[r])[:, None] - window
        want = torch.nn.functional.scaled_dot_product_attention(query[r], k, v, attn_mask=mask)
        assert torch.allclose(got[r].transpose(0, 1), want, atol=1e-5), float(
            (got[r].transpose(0, 1) - want).abs().max()
        )


async def test_a_shared_prompt_prefix_is_prefilled_once_and_stays_exact(served) -> None:
    """Concurrent requests that share the system prompt and tools (and one with n=2) reuse one cached
    prefix KV; every record still equals the trainer's teacher-forced logprobs. A weight change
    (a training step bumps the policy version) makes the engine compute the prefix again."""
    model, backend = served
    service = backend.service(model)
    engine, policy = service.engine, service.policy
    client = model.openai_client()
    system = {"role": "system", "content": FEW_SHOT[0]["content"] + " Be brief. " * 8}

    async def ask(city: str, n: int = 1):
        return await client.chat.completions.create(
            model=model.name,
            messages=[system, {"role": "user", "content": f"What's the weather in {city}?"}],
            tools=TOOLS,
            max_tokens=12,
            n=n,
            seed=7,
        )

    computes, saved = engine.prefix_computes, engine.prefix_tokens_saved
    results = await asyncio.gather(ask("Oslo"), ask("Lima", n=2), ask("Kyoto"))
    assert engine.prefix_tokens_saved - saved >= 2 * 100  # two prompts skipped a >100-token prefix
    again = await ask("Cairo")  # a later batch: the prefix comes from the cache
    assert engine.prefix_computes - computes <= 1
    for choice in [c for r in (*results, again) for c in r.choices]:
        rec = jm.record_of(choice)
        forced = policy.sampled_logprobs(rec.prompt_token_ids, rec.token_ids)
        assert max(abs(a - b) for a, b in zip(forced, rec.logprobs, strict=True)) < 1e-3
    policy.version += 1  # what a training step or a checkpoint load does
    computes = engine.prefix_computes
    await ask("Quito")
    assert engine.prefix_computes == computes + 1


def _http(model) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=model.inference_base_url,
        timeout=120,
        headers={"authorization": f"Bearer {model.inference_api_key}"},
    )


async def test_a_bad_sampling_value_fails_its_own_request_not_the_good_ones_beside_it(served) -> None:
    """A request whose sampling value the engine cannot take (a seed past 64 bits, too many stop
    strings) is refused by name before it is queued; good requests sent at the same time are all
    answered, not failed with the batch it would have joined."""
    model, _ = served
    msgs = [{"role": "user", "content": "Name a fruit."}]
    good = {"model": model.name, "messages": msgs, "max_tokens": 4}
    async with _http(model) as http:
        for bad, field in [({"seed": 2**64}, "seed"), ({"stop": ["x"] * 100}, "stop")]:
            replies = await asyncio.gather(
                *[http.post("/chat/completions", json={**good, "seed": i}) for i in range(4)],
                http.post("/chat/completions", json={**good, **bad}),
            )
            *oks, refused = replies
            assert [r.status_code for r in oks] == [200] * 4, [r.text[:200] for r in oks]
            assert all(r.json()["choices"][0]["journeyman"]["token_ids"] for r in oks)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


async def test_a_huge_prompt_is_refused_quickly_while_another_request_is_answered(scripted) -> None:
    """A 10 MB prompt (well under the body cap) is refused with a 400 naming `messages` in well
    under the ~22 s tokenizing it took, and a request sent beside it is answered meanwhile: its
    parsing, rendering and tokenizing happen off the event loop, the size is checked first."""
    import time

    model, _ = scripted
    huge = {
        "model": model.name,
        "messages": [{"role": "user", "content": "word " * 2_000_000}],
        "max_tokens": 2,
    }
    small = {"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with _http(model) as http:
        t0 = time.perf_counter()
        refused, answered = await asyncio.gather(
            http.post("/chat/completions", json=huge), http.post("/chat/completions", json=small)
        )
        took = time.perf_counter() - t0
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["param"] == "messages" and "8192-token context" in error["message"], error
    assert answered.status_code == 200, answered.text[:300]
    assert took < 10, took


async def test_schemas_too_large_or_deep_to_compile_are_refused_by_field(scripted) -> None:
    """A JSON schema the grammar compiler would take minutes over (too many bytes, too deep) is
    refused before compiling, naming the field it came from, on both routes."""
    model, _ = scripted
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (
            "/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}},
            "response_format.json_schema.schema",
        ),
        (
            "/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": wide}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            "/responses",
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": wide}}},
            "text.format.schema",
        ),
        (
            "/responses",
            {"tools": [{"type": "function", "name": "f", "parameters": deep}]},
            "tools[0].parameters",
        ),
    ]
    async with _http(model) as http:
        for path, extra, field in cases:
            base = {"messages": msgs, "max_tokens": 2} if path == "/chat/completions" else {"input": "hi"}
            r = await http.post(path, json={"model": model.name, **base, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, field, r.text[:300])
            assert "grammar compiler" in r.json()["error"]["message"]


def test_a_schema_that_compiles_too_long_is_refused_by_name_and_not_compiled_again(chat_format) -> None:
    """A compile past `compile_timeout_s` answers InvalidFieldError naming the schema field (a 400);
    the same schema is then refused at once, while other schemas still compile."""
    import time

    from journeyman.engine.base import Constraint
    from journeyman.engine.grammar import SCHEMA_FIELD, GrammarCache

    tok = chat_format.tokenizer
    cache = GrammarCache(tok, len(tok), compile_timeout_s=0.1)
    slow = Constraint(
        (("", json.dumps({"type": "string", "minLength": 900, "maxLength": 1000}), ""),)
    )  # ~1.5 s on 2 cores
    with pytest.raises(jm.InvalidFieldError, match="to compile") as e:
        cache.compile(slow)
    assert e.value.field == SCHEMA_FIELD
    t0 = time.perf_counter()
    with pytest.raises(jm.InvalidFieldError, match="to compile"):
        cache.compile(slow)
    assert time.perf_counter() - t0 < 0.05  # remembered, not compiled again
    cache.compile_timeout_s = 30.0
    assert cache.compile(Constraint((("", json.dumps({"type": "object"}), ""),))) is not None


async def test_a_stream_sends_text_as_it_is_sampled(served) -> None:
    """On the in-process engine the content leaves as it is sampled (more than one delta: the rest
    of a finished completion goes as one), and says what the unstreamed request says, with the same
    token record in the last chunk."""
    model, _ = served
    client = model.openai_client()
    ask: dict[str, Any] = {
        "model": model.name,
        "messages": [{"role": "user", "content": "Tell me a story about a dog."}],
        "max_tokens": 40,
        "temperature": 0.0,
    }
    deltas, record = await streamed_chat(client, ask)
    whole = await client.chat.completions.create(**ask)
    assert len(deltas) > 1, deltas
    assert "".join(deltas) == whole.choices[0].message.content
    assert record is not None and record["token_ids"] == jm.record_of(whole.choices[0]).token_ids


async def test_streamed_text_holds_back_what_may_not_stay_content(served) -> None:
    """A tool call's opening marker (or its start), a stop string (or its start), a character still
    being decoded and whitespace at the ends are not sent as content until the completion says."""
    from journeyman.serving.streaming import TextDeltas

    model, backend = served
    fmt = backend.service(model).chat_format
    deltas = TextDeltas(fmt, fmt.tokenizer, tools=True, stop=["END"], on_text=lambda i, d: None)
    call = fmt.family.call_open  # Hermes: "<tool_call>\n"
    assert deltas._safe("  Let me look.  ") == ("Let me look.", False)
    assert deltas._safe("Let me look. " + call[:4]) == ("Let me look.", False)
    assert deltas._safe("Let me look. " + call + '{"name"') == ("Let me look.", True)
    assert deltas._safe("Done. EN") == ("Done.", False)
    assert deltas._safe("Done. END and more") == ("Done.", True)
    assert deltas._safe("Caf\ufffd") == ("Caf", False)


async def test_a_responses_stream_sends_text_as_it_is_sampled(served) -> None:
    """/v1/responses with `stream` (the Agents SDK's `run_streamed`): text deltas as they are
    sampled, then the completed response, which says what the unstreamed request says."""
    model, _ = served
    client = model.openai_client()
    ask: dict[str, Any] = {
        "model": model.name,
        "input": "Tell me a story about a dog.",
        "max_output_tokens": 40,
        "temperature": 0.0,
    }
    deltas: list[str] = []
    kinds: list[str] = []
    completed: Any = None
    async for event in await client.responses.create(**ask, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    whole = await client.responses.create(**ask)
    assert len(deltas) > 1 and kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert completed is not None and "".join(deltas) == completed.output_text == whole.output_text
    done = kinds.index("response.output_text.done")
    assert kinds[done - 1] == "response.output_text.delta"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_request_whose_client_left_is_cancelled_and_its_capture_marked(
    scripted, stream: bool
) -> None:
    """A client that disconnects while its completion is sampled (here before any text) cancels
    it: the capture is no longer in flight (live training does not wait for it), nothing is filed
    under it, and it is marked cancelled. Before, the call ran on to its end and was filed then, an
    orphan beside the outcome posted meanwhile."""
    model, backend = scripted
    engine, endpoint = backend.engine(model), backend.endpoint(model)
    engine.delay_s = 60.0  # a completion that would take a minute
    cid = f"left-{stream}"
    before = endpoint.cancelled
    body = {"model": model.name, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with httpx.AsyncClient(
        base_url=model.inference_base_url,
        timeout=1.0,  # the client gives up and closes its connection
        headers={"authorization": f"Bearer {model.inference_api_key}", "x-journeyman-capture": cid},
    ) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/chat/completions", json=body)
    await wait_until(lambda: endpoint.cancelled == before + 1, 10)
    assert not endpoint.captures.in_flight(cid)
    assert endpoint.captures.was_cancelled(cid)
    assert endpoint.captures.pop(cid) == []


async def test_a_stream_cut_mid_text_stops_the_engine_at_the_next_step(served) -> None:
    """A stream whose client closes it after the first text stops decoding on the in-process engine
    (its row leaves the batch) instead of sampling on to `max_tokens` for nobody."""
    model, backend = served
    engine = backend.service(model).engine
    before = engine.scheduler.cancelled
    long = {
        "model": model.name,
        "messages": [{"role": "user", "content": "Tell me a very long story about a dog."}],
        "max_tokens": 2000,
        "stream": True,
    }
    async with _http(model) as http, http.stream("POST", "/chat/completions", json=long) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if '"content"' in line:
                break  # text arrived: the client leaves
    await wait_until(lambda: engine.scheduler.cancelled == before + 1, 10)
    await wait_until(lambda: not engine.runner.busy, 5)


async def test_too_many_or_too_large_tools_are_a_400_naming_tools(scripted) -> None:
    """More than MAX_TOOLS tools (on the Messages route, checked off the event loop) or more than
    MAX_TOOLS_BYTES of them (on the chat route) is a 400 naming `tools`, before any tool is checked
    one by one: 300,000 tools (16 MB) held every route of the server for 11.6 s."""
    from journeyman.serving.openai_http import MAX_TOOLS, MAX_TOOLS_BYTES

    model, _ = scripted
    schema = {"type": "object"}
    many = [{"name": f"t{i}", "input_schema": schema} for i in range(MAX_TOOLS + 1)]
    hi = [{"role": "user", "content": "hi"}]
    big = [
        {"type": "function", "function": {"name": f"f{i}", "description": "x" * (MAX_TOOLS_BYTES // 3)}}
        for i in range(4)
    ]
    async with _http(model) as http:
        refused = await http.post(
            "/messages", json={"model": model.name, "max_tokens": 4, "messages": hi, "tools": many}
        )
        assert refused.status_code == 400, refused.text[:300]
        message = refused.json()["error"]["message"]
        assert message == f"tools='{MAX_TOOLS + 1} tools': at most {MAX_TOOLS} tools are taken", message
        too_big = await http.post(
            "/chat/completions", json={"model": model.name, "messages": hi, "tools": big}
        )
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "tools", too_big.text[:300]
        assert f"at most {MAX_TOOLS_BYTES} bytes" in too_big.text
