"""JSON-schema constrained decoding for the in-process engine, with xgrammar's token bitmasks.

Output is compact JSON (`{"a": 1, "b": [2, 3]}`): xgrammar's default lets the model put any amount
of whitespace between tokens, and a small model given that freedom pads with newlines and indents
(more tokens, slower on a CPU) or never closes the object before `max_tokens`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from ..errors import InvalidFieldError

SCHEMA_FIELD = "response_format.json_schema.schema"


class GrammarCache:
    """Compiles each schema once (a bounded LRU); hands out one matcher per sampled row.

    `compile` may be called from any thread (the endpoint checks a schema before queueing it);
    `matcher` and `mask` run on the engine's worker thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, capacity: int = 64) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._compiler = xgr.GrammarCompiler(
            xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        )
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, schema: str) -> Any:
        """The compiled grammar of `schema`; an unusable schema raises InvalidFieldError."""
        with self._lock:
            if schema in self._compiled:
                self._compiled.move_to_end(schema)
                return self._compiled[schema]
        try:
            json.loads(schema)
            compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
        except (ValueError, RuntimeError) as e:
            # xgrammar reports unsupported or malformed schemas as RuntimeError with a C++ location.
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InvalidFieldError(SCHEMA_FIELD, schema, f"not a usable JSON schema: {reason}") from e
        with self._lock:
            self._compiled[schema] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, schema: str) -> Any:
        return self._xgr.GrammarMatcher(self.compile(schema))

    def mask(self, matcher: Any, logits: torch.Tensor, row: int) -> None:
        """Set the logits of tokens the grammar forbids at this point to -inf (in place)."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        view = logits[row : row + 1]
        if view.shape[-1] > self.vocab_size:
            # padded LM heads have ids no tokenizer produces: never sample them under a grammar
            view[:, self.vocab_size :] = float("-inf")
        self._xgr.apply_token_bitmask_inplace(view, bitmask.to(logits.device), vocab_size=self.vocab_size)
