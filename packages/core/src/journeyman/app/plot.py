"""Reward curves from a run's history.jsonl, as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from journeyman._extras import require_backend
from journeyman.errors import InvalidFieldError


def plot_history(
    history: list[dict[str, Any]], out: Path, title: str = "reward", metric: str = "reward"
) -> Path:
    """`train/<metric>` per step and `<split>/<metric>` of each held-out split, with `<split>/<metric>_sem`
    error bars where recorded. A metric no row holds is refused, naming those that rows hold."""
    recorded = sorted({k.split("/", 1)[1] for r in history for k in r if "/" in k and not k.endswith("_sem")})
    if metric not in recorded:
        raise InvalidFieldError(
            "metric", metric, f"no row of the history has it; recorded: {', '.join(recorded)}"
        )
    require_backend("plotting a run", ("matplotlib",))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    train = [(r["step"], r[f"train/{metric}"]) for r in history if f"train/{metric}" in r]
    if train:
        ax.plot(*zip(*train, strict=True), marker=".", label="train (rollouts of each step)")
    splits = sorted({r["split"] for r in history if r.get("split") not in (None, "train")})
    for split in splits:
        pts = [
            (r["step"], r[f"{split}/{metric}"])
            for r in history
            if r.get("split") == split and f"{split}/{metric}" in r
        ]
        # the SEM may sit in the same row or in a row of its own at the same step
        sems = {r["step"]: r[f"{split}/{metric}_sem"] for r in history if f"{split}/{metric}_sem" in r}
        errs = [sems.get(step, 0.0) for step, _ in pts]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=f"{split} (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"mean {metric}")
    ax.set_title(title)
    return save_figure(fig, ax, out)


def save_figure(fig: Any, ax: Any, out: Path) -> Path:
    """Finish a one-axes plot (grid, legend, tight layout) and write it to `out` as a PNG."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


__all__ = ["plot_history", "save_figure"]
