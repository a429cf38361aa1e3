"""`art.utils.sft`: ART's `train_sft_from_file` (SFT on a JSONL file of conversations) over
Journeyman's `model.train_sft`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import journeyman as jm
from journeyman.art._unsupported import module_getattr, refuse
from journeyman.errors import InvalidFieldError

__getattr__ = module_getattr("art.utils.sft", __name__)  # ART's per-batch SFT iterator: a named error


def read_sft_file(file_path: str | Path) -> list[jm.Trajectory]:
    """ART's SFT file: one JSON object a line, `messages` (the conversation, ending with the assistant
    turns to learn) and optionally `tools`."""
    out = []
    for i, line in enumerate(Path(file_path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidFieldError(f"{file_path}:{i}", line[:80], f"not JSON: {e}") from None
        out.append(jm.Trajectory(messages_and_choices=row.get("messages", []), tools=row.get("tools")))
    return out


async def train_sft_from_file(
    model: jm.TrainableModel,
    file_path: str,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: Literal["cosine", "linear", "constant"] = "linear",
    warmup_ratio: float = 0.1,
    initial_step: int = 0,
    final_step: int | None = None,
    _config: Any = None,
    verbose: bool = False,
    shuffle_buffer_size: int = 10000,
    log_metrics: bool = True,
    assistant_turns: Literal["all", "last"] = "all",
) -> None:
    """Supervised fine-tuning of a registered model on `file_path`, as ART's helper is called:
    `epochs` passes in batches of `batch_size`, the learning rate warming up over `warmup_ratio` of
    the batches to `peak_lr`, then following `schedule_type`. One Journeyman SFT step of the run (one
    checkpoint), where ART counts a step per batch: resuming part-way (`initial_step`, `final_step`),
    ART's `_config` and `assistant_turns="last"` raise ArtFeatureNotSupported. The file is read
    whole (ART streams it; `shuffle_buffer_size` is not needed)."""
    del shuffle_buffer_size, log_metrics  # the step's metrics are recorded either way
    if initial_step or final_step is not None:
        refuse("art.utils.sft.train_sft_from_file(initial_step=)")
    if _config:
        refuse("art.dev.TrainSFTConfig")
    if assistant_turns != "all":
        refuse("art.TrainSFTConfig(assistant_turns=)")
    trajectories = read_sft_file(file_path)
    if verbose:
        print(f"File has {len(trajectories)} rows")
    if not trajectories:
        return
    config = jm.SFTConfig(
        learning_rate=peak_lr,
        epochs=epochs,
        batch_size=batch_size,
        lr_schedule=schedule_type,
        warmup_ratio=warmup_ratio,
    )
    result = await model.train_sft(trajectories, config)
    if verbose:
        print(f"SFT step {result.step}: {result.metrics}")


__all__ = ["read_sft_file", "train_sft_from_file"]
