"""An engine that needs no model: its replies come from a script, its logprobs from a formula.

For tests of everything above the engine (the endpoint, captures, joins, integrations, servers) that use
a model only as plumbing: loading the embedded model takes 30-120 s on the 2-core CI machine, a
tokenizer well under one. The samples are real token ids of the served tokenizer, so records,
splicing and rows work as they do on a real model; only what is said is decided by the script.

    engine = ScriptedEngine(chat_format, ["Hello!", "Bye."])   # replies in turn
    engine = ScriptedEngine(chat_format, lambda call: f"echo {len(call.prompt_ids)}")

SamplingParams are honoured as far as a script allows: `n` replies, each cut at `max_tokens`
("length") or at the first `stop` string ("stop", the text before it); `seed` picks a list script's
reply by `(seed + k) % len(script)`, so the same seed gives the same sample whatever else is asked
meanwhile, while unseeded completions take the list's replies in turn. `temperature`, `top_p` and a
JSON-schema constraint are the script's business: a callable script sees them in `call.params`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from journeyman.chat.formats import ChatFormat
from journeyman.engine.base import Engine, FinishReason, OnToken, Sample, SamplingParams
from journeyman.errors import EngineDownError, InvalidFieldError

Reply = str | Sequence[int]
"""Text (encoded with the served tokenizer, then the family's end-of-turn token) or exact token ids."""


@dataclass(frozen=True)
class ScriptedCall:
    """What a callable script is asked: one completion of one request."""

    prompt_ids: list[int]
    params: SamplingParams
    completion: int  # k of the request's params.n
    served: int  # completions the engine answered before this one


Script = Sequence[Reply] | Callable[[ScriptedCall], Reply]
LogprobFn = Callable[[list[int], list[int]], list[float]]
"""(prompt ids, sampled ids) -> one logprob per sampled id, each <= 0."""


def formula_logprobs(prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """Deterministic logprobs in [-4, -0.004]: a function of the prompt's length and last id, the
    position and the token, so the same prompt and reply always get the same numbers."""
    last = prompt_ids[-1] if prompt_ids else 0
    mixed = (len(prompt_ids) * 97 + last * 31) % 1009
    return [-(((t * 7919 + i * 104_729 + mixed) % 1000) + 1) / 250 for i, t in enumerate(token_ids)]


class ScriptedEngine(Engine):
    """Answers every request from `script` through the tokenizer of `chat_format`.

    `requests` keeps each (prompt ids, params) asked, in order; `adapters` each (path, step)
    loaded. `delay_s` holds every answer that long (a slow or stuck engine); a callable script that
    raises fails only its own request, as a real engine's bad request does. A request for another
    step (`params.adapter`) is answered by the same script, its samples stamped with that step.
    """

    serves_other_steps = True

    def __init__(
        self,
        chat_format: ChatFormat,
        script: Script = ("OK",),
        *,
        logprobs: LogprobFn = formula_logprobs,
        delay_s: float = 0.0,
    ) -> None:
        if not callable(script) and not script:
            raise InvalidFieldError("script", script, "needs at least one reply (or a callable)")
        self.chat_format = chat_format
        self.script = script
        self.logprob_fn = logprobs
        self.delay_s = delay_s
        self.vocab_size = len(chat_format.tokenizer)
        self.end_id = self._end_of_turn(chat_format)
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.adapters: list[tuple[Path, int]] = []
        self._served = 0
        self._closed = False

    @staticmethod
    def _end_of_turn(fmt: ChatFormat) -> int:
        """The token that ends an assistant turn in this family (the template's own), else EOS."""
        for name in fmt.family.end_of_turn:
            tid = fmt.tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid in fmt.stop_ids:
                return tid
        return fmt.eos_id

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None = None
    ) -> list[Sample]:
        if self._closed:
            raise EngineDownError("the scripted engine is closed")
        self.requests.append((list(prompt_ids), params))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        samples = []
        for k in range(params.n):
            ids = self._reply_ids(ScriptedCall(list(prompt_ids), params, k, self._served + k))
            samples.append(self._sample(prompt_ids, ids, params))
            if on_token is not None:  # all at once: it is a script
                for t in samples[-1].token_ids:
                    on_token(k, t)
        self._served += params.n
        return samples

    def _reply_ids(self, call: ScriptedCall) -> list[int]:
        script = self.script
        if callable(script):
            reply = script(call)
        elif call.params.seed is not None:
            reply = script[(call.params.seed + call.completion) % len(script)]
        else:
            reply = script[call.served % len(script)]
        if isinstance(reply, str):
            return [*self.chat_format.encode(reply), self.end_id]
        ids = list(reply)
        if not ids or not all(0 <= t < self.vocab_size for t in ids):
            raise InvalidFieldError("script", ids, f"a reply needs token ids in 0..{self.vocab_size - 1}")
        # a real engine stops at the first stop token it samples
        end = next((i + 1 for i, t in enumerate(ids) if t in self.chat_format.stop_ids), len(ids))
        return ids[:end]

    def _sample(self, prompt_ids: list[int], ids: list[int], params: SamplingParams) -> Sample:
        finish: FinishReason = "stop"
        text: str | None = None
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        if params.stop:
            decode = self.chat_format.tokenizer.decode
            for end in range(1, len(ids) + 1):  # the first token whose text completes a stop string
                seen = decode(ids[:end], skip_special_tokens=True)
                cuts = [seen.find(s) for s in params.stop if s in seen]
                if cuts:
                    ids, text, finish = ids[:end], seen[: min(cuts)], "stop"
                    break
        if text is None:
            text = str(self.chat_format.tokenizer.decode(ids, skip_special_tokens=True))
        logprobs = self.logprob_fn(list(prompt_ids), ids)
        top = [
            [(t, lp), *[((t + j) % self.vocab_size, lp - j) for j in range(1, params.top_logprobs)]]
            for t, lp in zip(ids, logprobs, strict=True)
        ]
        return Sample(ids, logprobs, finish, text, top if params.top_logprobs else [], params.adapter_step)

    async def load_adapter(self, path: Path, step: int) -> None:
        self.adapters.append((path, step))
        self.step = step

    def close(self) -> None:
        self._closed = True

    @property
    def requests_served(self) -> int:
        return len(self.requests)

    @property
    def alive(self) -> bool:
        return not self._closed
