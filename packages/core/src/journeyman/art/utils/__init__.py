"""`art.utils`: ART's helpers for training loops (datasets in steps, retries, concurrency limits);
`art.utils.sft` for SFT from a file."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from journeyman.art._unsupported import module_getattr
from journeyman.art.utils.iterate_dataset import DatasetBatch, iterate_dataset
from journeyman.errors import InvalidFieldError

P = ParamSpec("P")
R = TypeVar("R")


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Retry a function (sync or async) on `exceptions`, waiting `delay` x `backoff_factor`^k between
    attempts; the last attempt's exception is raised."""
    if max_attempts < 1:
        raise InvalidFieldError("max_attempts", max_attempts, "must be at least 1")

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                wait = delay
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await fn(*args, **kwargs)
                    except exceptions as e:
                        if attempt == max_attempts:
                            raise
                        if on_retry is not None:
                            on_retry(e, attempt)
                        await asyncio.sleep(wait)
                        wait *= backoff_factor
                raise AssertionError("unreachable")

            return run_async  # pyright: ignore[reportReturnType]

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            wait = delay
            for attempt in range(1, max_attempts + 1):
                try:
                    return fn(*args, **kwargs)
                except exceptions as e:
                    if attempt == max_attempts:
                        raise
                    if on_retry is not None:
                        on_retry(e, attempt)
                    time.sleep(wait)
                    wait *= backoff_factor
            raise AssertionError("unreachable")

        return run

    return decorate


def limit_concurrency(
    n: int, derive_key: Callable[..., str] | None = None
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """At most `n` calls of the decorated coroutine function at once (per `derive_key(*args)`, if given)."""
    if n < 1:
        raise InvalidFieldError("n", n, "must be at least 1")
    limits: dict[str, asyncio.Semaphore] = {}

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> R:
            key = derive_key(*args, **kwargs) if derive_key is not None else ""
            async with limits.setdefault(key, asyncio.Semaphore(n)):
                return await fn(*args, **kwargs)

        return run

    return decorate


__getattr__ = module_getattr("art.utils", __name__)  # ART's helpers we lack: named errors

__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry"]
