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


def wrapped_grammar(prefix: str, schema: str, suffix: str) -> Any:
    """xgrammar Grammar: literal `prefix`, compact JSON matching `schema`, literal `suffix`.

    Tool calls use this: `<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>`.
    """
    import xgrammar as xgr

    parts = [xgr.Grammar.from_json_schema(schema, any_whitespace=False)]
    if prefix:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"))
    if suffix:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]


def wrapped_ebnf(prefix: str, schema: str, suffix: str) -> str:
    """The same grammar as EBNF text, for engines (vLLM) that take a grammar string."""
    return str(wrapped_grammar(prefix, schema, suffix))


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

    def compile(self, constraint: tuple[str, str, str]) -> Any:
        """The compiled grammar of (prefix, schema, suffix); an unusable schema raises InvalidFieldError."""
        key = "\0".join(constraint)
        prefix, schema, suffix = constraint
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        try:
            json.loads(schema)
            if prefix or suffix:
                compiled = self._compiler.compile_grammar(wrapped_grammar(prefix, schema, suffix))
            else:
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
        except (ValueError, RuntimeError) as e:
            # xgrammar reports unsupported or malformed schemas as RuntimeError with a C++ location.
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InvalidFieldError(SCHEMA_FIELD, schema, f"not a usable JSON schema: {reason}") from e
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, constraint: tuple[str, str, str]) -> Any:
        return self._xgr.GrammarMatcher(self.compile(constraint))

    def mask(self, matcher: Any, logits: torch.Tensor, row: int) -> None:
        """Set the logits of tokens the grammar forbids at this point to -inf (in place)."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        view = logits[row : row + 1]
        if view.shape[-1] > self.vocab_size:
            # padded LM heads have ids no tokenizer produces: never sample them under a grammar
            view[:, self.vocab_size :] = float("-inf")
        self._xgr.apply_token_bitmask_inplace(view, bitmask.to(logits.device), vocab_size=self.vocab_size)
