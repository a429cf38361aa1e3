"""Review in Langfuse, train on what people scored.

1. Export: roll out the built-in task; every trajectory becomes a Langfuse trace (one generation per
   policy call, exact token records in its metadata, the reward as score `reward`).
2. Review: people score traces in Langfuse (annotation queue or the trace view) under a score
   name, here `review`. `--auto-review` stands in for them so the example runs unattended: it gives
   1 to on-topic answers shorter than their group's median, 0 otherwise.
3. Import: pull the scored traces back as TrajectoryGroups (same token ids as were sampled) and
   train one GRPO step on the review scores.

    export LANGFUSE_PUBLIC_KEY=pk-lf-... LANGFUSE_SECRET_KEY=sk-lf-... LANGFUSE_BASE_URL=https://cloud.langfuse.com
    uv run --extra langfuse python examples/langfuse_review.py --auto-review

Without --auto-review the script stops after export and prints the tag to filter on; score the
traces in Langfuse, then run it again with `--import-tag <tag>` to pull them and train.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from pathlib import Path

import journeyman as jm
from journeyman.integrations import TRACE_ID_KEY, export_to_langfuse, fetch_review_set, tasks


async def export_run(
    model: jm.TrainableModel, tag: str, prompts: int, group_size: int
) -> list[jm.TrajectoryGroup]:
    exporter = export_to_langfuse(tags=["journeyman-example", tag])
    client = model.openai_client()
    groups = await jm.gather_trajectory_groups(
        (
            jm.TrajectoryGroup(tasks.rollout(model, client, s, max_tokens=40) for _ in range(group_size))
            for s in tasks.scenarios("train", prompts, seed=7)
        ),
        pbar_desc="rollouts",
    )
    exporter.flush()
    print(f"exported {exporter.stats}")
    return groups


def auto_review(groups: list[jm.TrajectoryGroup]) -> None:
    """What a reviewer would click, as a rule: the on-topic answers in the shorter half of each group are good."""
    from langfuse import get_client

    lf = get_client()
    for group in groups:
        lengths = sorted(int(t.metrics["completion_tokens"]) for t in group.trajectories)
        median = lengths[len(lengths) // 2]
        for t in group.trajectories:
            good = bool(t.metrics["on_topic"]) and int(t.metrics["completion_tokens"]) < median
            lf.create_score(name="review", value=1.0 if good else 0.0, trace_id=t.metadata[TRACE_ID_KEY])
    lf.flush()


async def main(args: argparse.Namespace) -> None:
    async with jm.LocalBackend(path=args.path) as backend:
        model = jm.TrainableModel(name="reviewed", project="langfuse-example")
        await model.register(backend)
        tag = args.import_tag
        if tag is None:
            tag = f"run-{uuid.uuid4().hex[:8]}"
            groups = await export_run(model, tag, args.prompts, args.group_size)
            if not args.auto_review:
                print(f"Score the traces tagged {tag!r} in Langfuse (score name 'review'), then run:\n"
                      f"  uv run python examples/langfuse_review.py --import-tag {tag}")  # fmt: skip
                return
            auto_review(groups)
            await asyncio.sleep(args.ingest_wait_s)  # Langfuse ingests asynchronously
        review = await fetch_review_set(score="review", tags=[tag])
        print(review.summary())
        result = await model.train(review.groups, config=jm.TrainConfig(learning_rate=2e-4))
        print(f"trained step {result.step}: {result.metrics}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", type=Path, default=Path(".journeyman"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--auto-review", action="store_true", help="score traces by a rule instead of by hand")
    ap.add_argument("--import-tag", help="skip export; pull traces with this tag that were scored 'review'")
    ap.add_argument("--ingest-wait-s", type=float, default=15.0)
    asyncio.run(main(ap.parse_args()))
