"""`art.utils`: ART's helpers for training loops (datasets in steps, retries, concurrency limits)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, NamedTuple, ParamSpec, TypeVar

from tqdm.auto import tqdm

from journeyman.errors import InvalidFieldError

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")


class DatasetBatch(NamedTuple, Generic[T]):
    """One step's scenarios: `.items`, `.epoch`, `.step` (global), `.epoch_step`; also unpacks as
    ART's older tuple `(items, epoch, step, epoch_step)`."""

    items: list[T]
    epoch: int
    step: int
    epoch_step: int


def iterate_dataset(
    dataset: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
) -> Iterator[DatasetBatch[T]]:
    """Batches of `groups_per_step` scenarios over `num_epochs` epochs, each epoch shuffled by a seed
    of its number (the same order on a rerun), from global step `initial_step` on (resume with
    `initial_step=await model.get_step()`)."""
    if groups_per_step < 1:
        raise InvalidFieldError("groups_per_step", groups_per_step, "must be at least 1")
    if num_epochs < 0 or initial_step < 0:
        raise InvalidFieldError("num_epochs/initial_step", (num_epochs, initial_step), "must be >= 0")
    size = len(dataset)
    if size == 0:
        return
    per_epoch = math.ceil(size / groups_per_step)
    bar = (
        tqdm(initial=initial_step, total=per_epoch * num_epochs, desc="dataset", unit="step")
        if use_tqdm
        else None
    )
    try:
        for epoch in range(num_epochs):
            order = list(range(size))
            random.Random(epoch).shuffle(order)
            for epoch_step in range(per_epoch):
                step = epoch * per_epoch + epoch_step
                if step < initial_step:
                    continue
                picked = order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
                yield DatasetBatch([dataset[i] for i in picked], epoch, step, epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()


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


__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry"]
