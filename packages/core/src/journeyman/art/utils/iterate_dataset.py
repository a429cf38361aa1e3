"""`art.utils.iterate_dataset`: a dataset in steps of `groups_per_step` scenarios, over epochs."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Generic, NamedTuple, TypeVar

from tqdm.auto import tqdm

from journeyman.errors import InvalidFieldError

T = TypeVar("T")


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


__all__ = ["DatasetBatch", "iterate_dataset"]
