"""What the vLLM engine (`vllm_engine`) says to a vLLM server and reads back: `/v1/completions` bodies
with the prompt as token ids, choices (whole or streamed chunk by chunk) turned into `Sample`s, the
rescoring of grammar-constrained samples, and vLLM's refusals as errors. Fields are as vLLM 0.32's
CompletionRequest and its answer name them.
"""

from __future__ import annotations

from typing import Any

import httpx

from journeyman.engine.base import OnToken, Sample, SamplingParams
from journeyman.engine.grammar import is_plain_schema, wrapped_ebnf
from journeyman.errors import JourneymanError

__all__ = [
    "Refused",
    "VLLMRequestError",
    "VLLMWakeError",
    "add_chunk",
    "check",
    "completion_body",
    "rescore_body",
    "rescored",
    "samples",
]

_TOKEN_ID = "token_id:"


class VLLMRequestError(JourneymanError, RuntimeError):
    """vLLM refused or failed a request; the message carries its status and error text."""


class VLLMWakeError(VLLMRequestError):
    """A stage of vLLM's wake timed out (`VLLMConfig.wake_timeout_s`) or was refused. The engine
    stays asleep, its requests failing with EngineDownError, until a later wake succeeds."""


class Refused(Exception):
    """vLLM's 400: a bad value in the request, with the parameter vLLM names (when it does)."""

    def __init__(self, resp: httpx.Response) -> None:
        try:
            err = resp.json().get("error") or {}
        except ValueError:
            err = {}
        self.message: str = str(err.get("message") or resp.text[:2000])
        self.param: str | None = err.get("param")
        super().__init__(self.message)


def check(resp: httpx.Response, what: str) -> None:
    """Raise `Refused` for a 400, VLLMRequestError for any other answer but 200."""
    if resp.status_code == 400:
        raise Refused(resp)
    if resp.status_code != 200:
        raise VLLMRequestError(f"{what}: vLLM answered {resp.status_code}: {resp.text[:2000]}")


def completion_body(
    prompt_ids: list[int], params: SamplingParams, model: str, stop_ids: list[int]
) -> dict[str, Any]:
    """The `/v1/completions` body for one prompt, sampled by vLLM's `model` (a LoRA name or the base)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_ids,  # token ids: vLLM does not tokenize, so no BOS/whitespace drift
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "stop": params.stop,
        "stop_token_ids": stop_ids,
        "seed": params.seed,
        "logprobs": max(1, params.top_logprobs),
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,  # top-logprob keys as ids, not lossy strings
        "skip_special_tokens": True,
    }
    constraint = params.constraint
    if constraint is not None and not is_plain_schema(constraint):
        # Tool calls (JSON between literal tags) and reasoning first: only a grammar can say them.
        body["structured_outputs"] = {"grammar": wrapped_ebnf(constraint)}
    elif params.json_schema is not None:
        # Compact JSON, as the in-process engine emits: a small model given free whitespace pads.
        body["structured_outputs"] = {"json": params.json_schema, "disable_any_whitespace": True}
    return body


def add_chunk(choices: dict[int, dict[str, Any]], part: dict[str, Any], on_token: OnToken) -> None:
    """Add one streamed choice chunk to `choices` (by index), as the unstreamed answer has them
    (token ids, logprobs, text, finish); each of its tokens goes to `on_token` first."""
    i = _index(part)
    into = choices.setdefault(
        i, {"index": i, "token_ids": [], "text": "", "finish_reason": None, "logprobs": {}}
    )
    ids = part.get("token_ids") or []
    for t in ids:
        on_token(i, int(t))
    into["token_ids"] += ids
    into["text"] += part.get("text") or ""
    into["finish_reason"] = part.get("finish_reason") or into["finish_reason"]
    lp = part.get("logprobs") or {}
    for key in ("token_logprobs", "top_logprobs"):
        into["logprobs"].setdefault(key, []).extend(lp.get(key) or [])


def samples(choices: list[dict[str, Any]], top_k: int, step: int) -> list[Sample]:
    """The answer's choices as samples, in index order, sampled by training `step`'s policy."""
    out = [_sample(choice, top_k) for choice in sorted(choices, key=_index)]
    for s in out:
        s.step = step
    return out


def rescore_body(prompt_ids: list[int], rows: list[Sample], model: str, top_k: int) -> dict[str, Any]:
    """One unconstrained prefill of prompt + each sample on `model`, for its prompt logprobs."""
    return {
        "model": model,
        "prompt": [prompt_ids + s.token_ids for s in rows],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": top_k,
    }


def rescored(rows: list[Sample], choices: list[dict[str, Any]], prompt_len: int, top_k: int) -> None:
    """Put the prompt logprobs of the rescore's `choices` in place of `rows`' logprobs."""
    for sample, choice in zip(rows, sorted(choices, key=_index), strict=True):
        entries = (choice.get("prompt_logprobs") or [])[prompt_len : prompt_len + len(sample.token_ids)]
        if len(entries) != len(sample.token_ids):
            raise VLLMRequestError(
                f"vLLM returned {len(entries)} prompt logprobs for {len(sample.token_ids)} sampled tokens"
            )
        sample.logprobs = [
            float(e[str(t)]["logprob"]) for e, t in zip(entries, sample.token_ids, strict=True)
        ]
        if top_k:
            sample.top_logprobs = [
                sorted(((int(k), float(v["logprob"])) for k, v in e.items()), key=lambda x: -x[1])[:top_k]
                for e in entries
            ]


def _index(choice: dict[str, Any]) -> int:
    return int(choice.get("index", 0))


def _token_id(token: str) -> int:
    return int(token[len(_TOKEN_ID) :]) if token.startswith(_TOKEN_ID) else -1


def _sample(choice: dict[str, Any], top_k: int) -> Sample:
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise VLLMRequestError(
            "vLLM returned no token_ids (return_token_ids is not supported by this version)"
        )
    lp = choice.get("logprobs") or {}
    logprobs = [float(x) if x is not None else float("nan") for x in lp.get("token_logprobs") or []]
    if len(logprobs) != len(token_ids):
        raise VLLMRequestError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    top: list[list[tuple[int, float]]] = []
    if top_k:
        for entry in lp.get("top_logprobs") or []:
            ranked = sorted(((_token_id(t), v) for t, v in (entry or {}).items()), key=lambda x: -x[1])
            top.append(ranked[:top_k])
    finish = choice.get("finish_reason") or "length"
    if finish not in ("stop", "length"):  # "abort" / "error": the sample is incomplete
        raise VLLMRequestError(f"vLLM finished a sample with finish_reason={finish!r}")
    return Sample(list(token_ids), logprobs, finish, choice.get("text", ""), top)
