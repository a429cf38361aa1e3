"""Where a served model's distillation teacher runs, and the step's groups scored by it before they train.

`score_for_step` is what a GRPO step with `TrainConfig.distill` does first: the groups' records get
the teacher's logprobs (`rewards/teacher.py`), counted in the step's metrics and the run's spend. A
teacher is resolved once per model and teacher (`Teacher` as given), its tokenizer checked then:
- `base_url`: that server (`EndpointScorer`);
- `base_model` (+ `checkpoint`): loaded here, with a copy of its base of its own;
- otherwise `model` names a model registered on this backend, scored by its policy at its served step.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from journeyman.data.config import LoraConfig, Teacher
from journeyman.data.types import TrajectoryGroup
from journeyman.errors import InvalidFieldError, UnknownModelError
from journeyman.rewards.teacher import EndpointScorer, Scorer, check_tokenizer, score_groups

if TYPE_CHECKING:
    from journeyman.backends.service import ServedModel

__all__ = ["ModelScorer", "score_for_step", "teacher_scorer"]


async def teacher_scorer(s: ServedModel, teacher: Teacher) -> Scorer:
    """The scorer of `teacher` for the student `s`, made and checked on first use."""
    key = teacher.model_dump_json()
    if key in s.teachers:
        return s.teachers[key]
    scorer: Scorer
    if teacher.base_url is not None:
        scorer = EndpointScorer(teacher)
    elif teacher.base_model is not None:
        policy = await s.engine.call(_load_policy, s, teacher)
        scorer = ModelScorer(policy.model, policy.tokenizer, s.engine.call)
    else:
        assert teacher.model is not None
        if s.peers is None:
            raise InvalidFieldError(
                "teacher.model", teacher.model, "no other model is registered with this one"
            )
        try:
            peer = s.peers(teacher.model)
        except UnknownModelError as e:
            raise InvalidFieldError(
                "teacher.model", teacher.model, f"is not registered on this backend ({e}); or give base_url"
            ) from None
        scorer = ModelScorer(peer.policy.model, peer.policy.tokenizer, peer.engine.call, peer.policy.editing)
    tokenizer = s.policy.tokenizer
    await check_tokenizer(
        scorer,
        lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        lambda ids: str(tokenizer.decode(ids)),
    )
    s.teachers[key] = scorer
    return scorer


def _load_policy(s: ServedModel, teacher: Teacher) -> Any:
    """The teacher as a LoRA policy on a copy of its base of its own, with its checkpoint's adapter
    (its saved rank, alpha and target modules), or none (the base as it is)."""
    from journeyman.policy.lora import LoraPolicy
    from journeyman.policy.weights import resolve_base_model

    assert teacher.base_model is not None
    path = resolve_base_model(teacher.base_model)
    lora = LoraConfig()
    ckpt = Path(teacher.checkpoint) if teacher.checkpoint is not None else None
    if ckpt is not None:
        config = ckpt / "adapter_config.json"
        if not config.is_file():
            raise InvalidFieldError(
                "teacher.checkpoint", str(ckpt), "has no adapter_config.json (a run's checkpoints/<step>)"
            )
        saved = json.loads(config.read_text())
        targets = saved.get("target_modules") or "all-linear"
        lora = LoraConfig(
            r=int(saved["r"]),
            alpha=int(saved["lora_alpha"]),
            target_modules=sorted(targets) if isinstance(targets, list) else targets,
        )
    # its own copy of the base, even when it is the student's: on a shared base neither would merge its
    # adapter to sample (`BaseWeights.attach`); a teacher registered on the backend shares it instead
    policy = LoraPolicy(path, lora, device=str(s.base.device), dtype=s.base.dtype_name)
    if ckpt is not None:
        policy.load(ckpt)
    return policy


async def score_for_step(s: ServedModel, groups: list[TrajectoryGroup], teacher: Teacher) -> dict[str, float]:
    """Score `groups` with `teacher` for a step of `s`: the counts for its metrics. A teacher is a
    judge of every token: what it reads counts as the run's judge tokens (`Budget.judge_tokens`),
    and past that budget it is not asked (`BudgetExceededError`, before anything is written)."""
    if s.meter is not None:
        s.meter.check("judging")
    scorer = await teacher_scorer(s, teacher)
    counts = await score_groups(groups, scorer, teacher)
    if s.meter is not None and counts["teacher_tokens"]:
        s.meter.add(judge_tokens=int(counts["teacher_tokens"]))
    return counts


class ModelScorer:
    """A causal LM in this process (a PEFT model: the adapter on, as it samples). `run` places the
    forward passes (the engine's thread, which keeps one OpenMP team busy at a time)."""

    def __init__(
        self,
        policy_model: Any,
        tokenizer: Any,
        run: Callable[[Callable[[], list[list[float]]]], Awaitable[list[list[float]]]],
        hold: Callable[[], Any] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.run, self.hold = policy_model, tokenizer, run, hold

    async def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return await self.run(lambda: self._forward(sequences))

    def _forward(self, sequences: list[list[int]]) -> list[list[float]]:
        import contextlib

        import torch

        from journeyman.training.loss import head_logprobs

        causal_lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        device = next(self.model.parameters()).device
        out: list[list[float]] = []
        with torch.inference_mode(), self.hold() if self.hold is not None else contextlib.nullcontext():
            for seq in sequences:  # one at a time: no padding, and a long one sets no batch's width
                ids = torch.tensor([seq], device=device)
                hidden = causal_lm.model(input_ids=ids).last_hidden_state[0, :-1]  # the head in chunks
                out.append(head_logprobs(hidden, causal_lm.lm_head, ids[0, 1:]).tolist())
        return out

    async def text_of(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))
