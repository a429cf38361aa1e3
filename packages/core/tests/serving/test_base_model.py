"""The base model is served under its own name beside the trained policy, with the adapter off, as
vLLM serves a base model beside its LoRAs: a validator or a comparison rollout can ask for it."""

from __future__ import annotations

import pytest
from _support import embedded_policy_with_adapter


async def test_the_endpoint_serves_the_base_models_name_with_the_adapter_off(scripted) -> None:
    model, backend = scripted
    client = model.openai_client()
    listed = [m.id async for m in client.models.list()]
    assert model.base_model in listed and model.name in listed

    engine = backend.engine(model)
    ask = [{"role": "user", "content": "Hi"}]
    base = await client.chat.completions.create(model=model.base_model, messages=ask, max_tokens=4)
    assert base.model == model.base_model
    assert engine.requests[-1][1].base is True
    assert (base.choices[0].model_extra or {})["journeyman"]["step"] == 0  # step 0 is the base model

    tuned = await client.chat.completions.create(model=model.name, messages=ask, max_tokens=4)
    assert tuned.model.startswith(f"{model.name}@")
    assert engine.requests[-1][1].base is False

    import openai

    with pytest.raises(openai.NotFoundError, match="served models"):
        await client.chat.completions.create(model="not-served", messages=ask, max_tokens=4)


async def test_the_in_process_engine_samples_the_base_with_the_adapter_disabled() -> None:
    """A base request's tokens and logprobs are the base model's (the adapter switched off, not
    merged), while the policy's requests still sample the adapter."""
    import torch
    from journeyman.engine.base import SamplingParams
    from journeyman.engine.torch_engine import TorchEngine

    policy = embedded_policy_with_adapter()  # its adapter changes the outputs
    engine = TorchEngine(policy, stop_ids={policy.tokenizer.eos_token_id})

    def base_logprobs(prompt: list[int], ids: list[int]) -> list[float]:
        with torch.inference_mode(), policy.editing(), policy.base_only():
            x = torch.tensor([prompt + ids], device=policy.device)
            logp = torch.log_softmax(policy.model(input_ids=x).logits[0].float(), dim=-1)
        return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]

    try:
        prompt = list(
            policy.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Name a river."}], add_generation_prompt=True, return_dict=False
            )
        )
        [base] = await engine.generate(prompt, SamplingParams(max_tokens=10, seed=5, base=True))
        [tuned] = await engine.generate(prompt, SamplingParams(max_tokens=10, seed=5))
        gap = max(
            abs(a - b) for a, b in zip(base_logprobs(prompt, base.token_ids), base.logprobs, strict=True)
        )
        assert gap < 1e-4, gap
        adapter_effect = max(
            abs(a - b) for a, b in zip(base_logprobs(prompt, tuned.token_ids), tuned.logprobs, strict=True)
        )
        assert adapter_effect > 1e-3  # the policy's rows are not the base's
        [again] = await engine.generate(prompt, SamplingParams(max_tokens=10, seed=5, base=True))
        assert again.token_ids == base.token_ids  # seeded: the same base sample, after policy rows ran
    finally:
        engine.close()
