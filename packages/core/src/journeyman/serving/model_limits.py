"""Per-model limits, so tenants stay apart: one model's requests cannot fill the engine that serves
the others (many models on one base share one engine, `engine/tenants.py`).

A model's `ModelConfig.max_rows_in_flight` caps the rows (a request's `n`) being sampled or queued
for it at once; `ModelConfig.max_requests_per_minute` caps the requests it admits in any 60 s. Both
are checked as a request enters `Endpoint.chat_completion`, before it is prepared or queued, on every
OpenAI route (chat, Responses, Messages; streamed or not). Over a cap the request is a 429 with
`Retry-After`, naming the model and the field (`ModelLimitError`); its rows go back when it
finishes, fails or its client leaves. None (the default) leaves a model unbounded, as before.

    limits = ModelLimits.of(ModelConfig(name="bot", project="p", max_rows_in_flight=8))
    with limits.admitted(rows=2):  # ModelLimitError over a cap
        ...
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from journeyman.data.config import ModelConfig
from journeyman.errors import InvalidFieldError, JourneymanError

RATE_WINDOW_S = 60.0
"""The window `max_requests_per_minute` counts requests over (sliding)."""
ROWS_RETRY_AFTER_S = 1
"""`Retry-After` of a request refused for rows in flight: rows finish within a decode, unknown when."""


class ModelLimitError(JourneymanError):
    """A request over one of its model's limits: a 429 with `Retry-After: retry_after_s`."""

    def __init__(self, model: str, field: str, limit: int, retry_after_s: int, what: str) -> None:
        self.model, self.field, self.limit, self.retry_after_s = model, field, limit, retry_after_s
        super().__init__(
            f"{field}={limit}: the model {model!r} {what}; retry after {retry_after_s} s (Retry-After)"
        )


class ModelLimits:
    """One model's caps and what counts against them. Safe from any thread."""

    def __init__(
        self,
        model: str,
        max_rows_in_flight: int | None = None,
        max_requests_per_minute: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.max_rows_in_flight = max_rows_in_flight
        self.max_requests_per_minute = max_requests_per_minute
        self.rows_in_flight = 0
        self.refused = 0
        self._clock = clock
        self._admitted: deque[float] = deque()  # when each request of the window was admitted
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model: ModelConfig) -> ModelLimits:
        return cls(model.name, model.max_rows_in_flight, model.max_requests_per_minute)

    def configure(self, model: ModelConfig) -> None:
        """Take `model`'s caps (registered again with others): what is in flight stays counted."""
        with self._lock:
            self.max_rows_in_flight = model.max_rows_in_flight
            self.max_requests_per_minute = model.max_requests_per_minute

    @contextmanager
    def admitted(self, rows: int) -> Iterator[None]:
        """Hold `rows` in flight for the `with` block, or raise `ModelLimitError` over a cap (an
        `InvalidFieldError` naming `n` when `rows` alone is over the rows cap: waiting cannot help)."""
        self._admit(rows)
        try:
            yield
        finally:
            with self._lock:
                self.rows_in_flight -= rows

    def _admit(self, rows: int) -> None:
        cap, rate = self.max_rows_in_flight, self.max_requests_per_minute
        if cap is not None and rows > cap:
            raise InvalidFieldError(
                "n",
                rows,
                f"more rows than the model {self.model!r} may have in flight (max_rows_in_flight={cap})",
            )
        with self._lock:
            now = self._clock()
            while self._admitted and self._admitted[0] <= now - RATE_WINDOW_S:
                self._admitted.popleft()
            if rate is not None and len(self._admitted) >= rate:
                self.refused += 1
                wait = max(1, math.ceil(self._admitted[0] + RATE_WINDOW_S - now))
                raise ModelLimitError(
                    self.model,
                    "max_requests_per_minute",
                    rate,
                    wait,
                    f"was sent {len(self._admitted)} requests in the last {RATE_WINDOW_S:g} s",
                )
            if cap is not None and self.rows_in_flight + rows > cap:
                self.refused += 1
                raise ModelLimitError(
                    self.model,
                    "max_rows_in_flight",
                    cap,
                    ROWS_RETRY_AFTER_S,
                    f"has {self.rows_in_flight} rows in flight and this request adds {rows}",
                )
            self.rows_in_flight += rows
            if rate is not None:
                self._admitted.append(now)


__all__ = ["RATE_WINDOW_S", "ROWS_RETRY_AFTER_S", "ModelLimitError", "ModelLimits"]
