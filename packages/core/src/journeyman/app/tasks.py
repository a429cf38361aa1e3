"""A built-in task the embedded model can learn on a CPU in minutes: short, on-topic answers.

Each scenario asks about one topic, with the system prompt "Answer in one short sentence." Reward = on-topic (the answer names the topic) x brevity
(1 - completion tokens / max_tokens). The base SmolLM2-135M mostly ignores the instruction and runs
to the token limit (held-out greedy reward about 0.2 at 48 tokens); GRPO learns to answer briefly and stay on topic.
Train and held-out topics are disjoint.
"""

from __future__ import annotations

import random

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel

from journeyman.client.model import TrainableModel
from journeyman.data.types import Trajectory, record_of

_TOPICS = [
    "apple",
    "bicycle",
    "camera",
    "desert",
    "elephant",
    "forest",
    "guitar",
    "harbor",
    "island",
    "jungle",
    "kettle",
    "lantern",
    "mountain",
    "notebook",
    "ocean",
    "piano",
    "quilt",
    "river",
    "satellite",
    "telescope",
    "umbrella",
    "volcano",
    "window",
    "yacht",
    "zebra",
    "bridge",
    "castle",
    "dolphin",
    "engine",
    "feather",
    "garden",
    "hammer",
    "igloo",
    "jacket",
    "kite",
    "ladder",
    "magnet",
    "needle",
    "orchestra",
    "pencil",
    "rainbow",
    "saddle",
    "tractor",
    "violin",
    "wallet",
    "anchor",
    "balloon",
    "candle",
    "diamond",
    "eagle",
    "fountain",
    "glacier",
    "helmet",
    "insect",
    "jellyfish",
    "kangaroo",
    "lemon",
    "mirror",
    "nest",
    "owl",
    "parrot",
    "pyramid",
    "rocket",
    "sandwich",
    "tiger",
    "tornado",
    "trumpet",
    "tunnel",
    "vaccine",
    "whale",
    "windmill",
    "airport",
    "bakery",
    "cactus",
    "compass",
]
_TEMPLATES = (
    "What is a {t}?",
    "Tell me about the {t}.",
    "Describe a {t}.",
    "What is a {t} used for?",
    "Explain what a {t} is.",
)


SYSTEM = "Answer in one short sentence."


class Scenario(BaseModel):
    topic: str
    prompt: str


def scenarios(split: str, n: int, seed: int = 0) -> list[Scenario]:
    """`split` "train" or "val": disjoint topics; deterministic for a seed."""
    rng = random.Random(f"{split}-{seed}")
    cut = len(_TOPICS) * 2 // 3
    topics = _TOPICS[:cut] if split == "train" else _TOPICS[cut:]
    out = []
    for _ in range(n):
        t = rng.choice(topics)
        out.append(Scenario(topic=t, prompt=rng.choice(_TEMPLATES).format(t=t)))
    return out


def reward(scenario: Scenario, text: str, completion_tokens: int, max_tokens: int) -> float:
    on_topic = scenario.topic.lower() in text.lower()
    return float(on_topic) * max(0.0, 1.0 - completion_tokens / max_tokens)


async def rollout(
    model: TrainableModel,
    client: AsyncOpenAI,
    scenario: Scenario,
    *,
    max_tokens: int = 40,
    temperature: float = 1.0,
    seed: int | None = None,
) -> Trajectory:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": scenario.prompt},
    ]
    completion = await client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=max_tokens, temperature=temperature, seed=seed
    )
    choice = completion.choices[0]
    record = record_of(choice)
    n_tokens = (
        len(record.token_ids)
        if record
        else (completion.usage.completion_tokens if completion.usage else max_tokens)
    )
    r = reward(scenario, choice.message.content or "", n_tokens, max_tokens)
    return Trajectory(
        messages_and_choices=[*(dict(m) for m in messages), choice],  # TypedDicts -> plain messages
        reward=r,
        metrics={
            "completion_tokens": n_tokens,
            "on_topic": scenario.topic.lower() in (choice.message.content or "").lower(),
        },
        metadata={"topic": scenario.topic},
    )
