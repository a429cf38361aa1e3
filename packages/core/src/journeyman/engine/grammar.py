"""JSON-schema constrained decoding for the in-process engine, with xgrammar's token bitmasks."""

from __future__ import annotations

from typing import Any

import torch


class GrammarCache:
    """Compiles each schema once; hands out one matcher per sampled row."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(
            xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        )
        self._compiled: dict[str, Any] = {}

    def matcher(self, schema: str) -> Any:
        if schema not in self._compiled:
            self._compiled[schema] = self._compiler.compile_json_schema(schema)
        return self._xgr.GrammarMatcher(self._compiled[schema])

    def mask(self, matcher: Any, logits: torch.Tensor, row: int) -> None:
        """Set the logits of tokens the grammar forbids at this point to -inf (in place)."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        view = logits[row : row + 1, : self.vocab_size]
        self._xgr.apply_token_bitmask_inplace(view, bitmask.to(logits.device))
