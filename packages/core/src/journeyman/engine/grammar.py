"""JSON-schema constrained decoding for the in-process engine, with xgrammar's token bitmasks.

Output is compact JSON (`{"a": 1, "b": [2, 3]}`): xgrammar's default lets the model put any amount
of whitespace between tokens, and a small model given that freedom pads with newlines and indents
(more tokens, slower on a CPU) or never closes the object before `max_tokens`.

A compile is timed out: xgrammar's time grows with a schema's size, nesting and repetition bounds
(2,000 optional properties took 99 s on 2 cores, `maxLength: 100000` 4 s), and a request must not
wait minutes for one. xgrammar cannot stop a compile, so one that runs past the limit finishes on
its own thread (not a daemon: a process exiting waits for it rather than abort inside xgrammar);
at most `max_compiles` run at once, and a schema refused for time is refused again at once, so
such schemas cannot pile up.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from journeyman.chat.families import PYTHON_KWARGS
from journeyman.errors import InvalidFieldError

if TYPE_CHECKING:
    import torch

    from journeyman.engine.base import Constraint

SCHEMA_FIELD = "response_format.json_schema.schema"
COMPILE_TIMEOUT_S = 10.0


def wrapped_grammar(prefix: str, schema: str, suffix: str) -> Any:
    """xgrammar Grammar: literal `prefix`, compact JSON matching `schema`, literal `suffix`.

    Tool calls use this: `<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>`.
    """
    import xgrammar as xgr

    parts = [_body_grammar(schema)]
    if prefix:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"))
    if suffix:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]


def _body_grammar(schema: str) -> Any:
    """Compact JSON matching `schema`, or a Python call's keyword arguments (`PYTHON_KWARGS`): the
    required parameters in their listed order, `name=<JSON value>`, comma-separated (optional ones
    are left out: a forced call writes what it must)."""
    import xgrammar as xgr

    parsed = json.loads(schema)
    if not (isinstance(parsed, dict) and PYTHON_KWARGS in parsed):
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    parameters: dict[str, Any] = parsed[PYTHON_KWARGS] or {}
    properties: dict[str, Any] = parameters.get("properties") or {}
    required = [k for k in properties if k in (parameters.get("required") or [])]
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    parts = []
    for n, name in enumerate(required):
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps((', ' if n else '') + name + '=')}"))
        value = properties[name] if isinstance(properties[name], dict) else {}
        parts.append(xgr.Grammar.from_json_schema(json.dumps({**value, **defs}), any_whitespace=False))
    if not parts:
        return xgr.Grammar.from_ebnf('root ::= ""')
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]


def text_without(marker: str) -> str:
    """EBNF of any text that does not contain `marker` (a reasoning block's body before its close
    tag): one rule per characters of the marker matched so far, as in Knuth-Morris-Pratt."""

    def state_after(matched: int, char: str) -> int:  # the longest prefix of marker ending here
        seen = marker[:matched] + char
        return next(k for k in range(len(seen), -1, -1) if seen.endswith(marker[:k]))

    chars = sorted(set(marker))
    others = "[^" + "".join(_class_char(c) for c in chars) + "]"
    rules = []
    for i in range(len(marker)):
        options = ['""', f"{others} s0"]
        for c in chars:
            j = state_after(i, c)
            if j < len(marker):  # reaching the whole marker is what the body may not do
                options.append(f"{json.dumps(c)} s{j}")
        rules.append(f"s{i} ::= " + " | ".join(options))
    return "root ::= s0\n" + "\n".join(rules)


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


def constraint_grammar(constraint: Constraint) -> Any:
    """xgrammar Grammar of a `SamplingParams.constraint`: any one of its (prefix, schema, suffix)
    shapes (an answer in a response schema, or a tool call), after its free reasoning block if any."""
    import xgrammar as xgr

    shapes = [wrapped_grammar(*shape) for shape in constraint.shapes]
    output = shapes[0] if len(shapes) == 1 else xgr.Grammar.union(*shapes)
    if constraint.reasoning is None:
        return output
    open_, close = constraint.reasoning
    parts = [
        xgr.Grammar.from_ebnf(text_without(close.strip())),
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(close)}"),
    ]
    if open_:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(open_)}"))
    return xgr.Grammar.concat(*parts, output)


def is_plain_schema(constraint: Constraint) -> bool:
    """Whether the constraint is one JSON schema alone (no literals, no alternatives, no reasoning)."""
    [(prefix, _, suffix), *more] = constraint.shapes
    return not (more or prefix or suffix or constraint.reasoning)


def wrapped_ebnf(constraint: Constraint) -> str:
    """The same grammar as EBNF text, for engines (vLLM) that take a grammar string."""
    return str(constraint_grammar(constraint))


class GrammarCache:
    """Compiles each schema once (a bounded LRU); hands out one matcher per sampled row.

    `compile` may be called from any thread (the endpoint checks a schema before queueing it);
    `matcher` and `mask` run on the engine's worker thread. Concurrent calls for one schema share
    its compile.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        capacity: int = 64,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        max_compiles: int = 2,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.compile_timeout_s = compile_timeout_s
        self._compiler = xgr.GrammarCompiler(
            xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        )
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._refused: OrderedDict[str, InvalidFieldError] = OrderedDict()  # unusable, or too slow
        # compiles under way: their result, and whether they hold a slot yet
        self._pending: dict[str, tuple[Future[Any], threading.Event]] = {}
        self._slots = threading.Semaphore(max_compiles)
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of a constraint; an unusable schema, or one that does not compile
        within `compile_timeout_s`, raises InvalidFieldError."""
        key = constraint.key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            if key in self._refused:
                raise self._refused[key]
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = (Future(), threading.Event())
                threading.Thread(
                    target=self._compile,
                    args=(key, constraint, *pending),
                    daemon=False,
                    name="journeyman-grammar",
                ).start()
        result, started = pending
        try:
            return result.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            pass
        schema = constraint.shapes[0][1]
        if not started.is_set():  # still waiting for a slot: other schemas hold the compiler
            raise InvalidFieldError(
                SCHEMA_FIELD,
                schema,
                f"waited {self.compile_timeout_s:g} s for the grammar compiler, busy with other schemas",
            ) from None
        error = InvalidFieldError(
            SCHEMA_FIELD, schema, f"took more than {self.compile_timeout_s:g} s to compile into a grammar"
        )
        with self._lock:
            self._refuse(key, error)
        raise error from None

    def _compile(
        self, key: str, constraint: Constraint, result: Future[Any], started: threading.Event
    ) -> None:
        schema = constraint.shapes[0][1]
        with self._slots:
            started.set()
            try:
                for _, each, _ in constraint.shapes:
                    json.loads(each)
                if not is_plain_schema(constraint):
                    compiled = self._compiler.compile_grammar(constraint_grammar(constraint))
                else:
                    compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
            except (ValueError, RuntimeError) as e:
                # xgrammar reports unsupported or malformed schemas as RuntimeError with a C++ location.
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                error = InvalidFieldError(SCHEMA_FIELD, schema, f"not a usable JSON schema: {reason}")
                with self._lock:
                    self._pending.pop(key, None)
                    self._refuse(key, error)
                result.set_exception(error)
                return
            except (
                BaseException
            ) as e:  # a bug of ours or xgrammar's: the callers see it, the key is free again
                with self._lock:
                    self._pending.pop(key, None)
                result.set_exception(e)
                return
        with self._lock:
            self._pending.pop(key, None)
            if key not in self._refused:  # one refused for time stays refused: answers do not race the clock
                self._compiled[key] = compiled
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        result.set_result(compiled)

    def _refuse(self, key: str, error: InvalidFieldError) -> None:
        self._refused[key] = error
        while len(self._refused) > self.capacity:
            self._refused.popitem(last=False)

    def matcher(self, constraint: Constraint) -> Any:
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


class LazyGrammars:
    """A `GrammarCache` made on first use, from any thread: xgrammar and its tables of the
    tokenizer load only when a constrained request comes."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                self._cache = GrammarCache(self._tokenizer, self._vocab_size)
            return self._cache

    def matcher(self, constraint: Constraint | None) -> Any:
        """A matcher for one sampled row (None: unconstrained)."""
        return None if constraint is None else self.get().matcher(constraint)
