"""The public names of journeyman, and what `import journeyman` costs: the API changes only on purpose."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import journeyman


def test_public_names() -> None:
    assert sorted(journeyman.__all__) == [
        "AuthenticationError",
        "Backend",
        "BackendUnavailableError",
        "BaseModelNotFoundError",
        "CAPTURE_HEADER",
        "Capture",
        "CapturedCall",
        "ChatTemplateError",
        "CheckpointError",
        "DEFAULT_BASE_MODEL",
        "EmptyGroupError",
        "EngineDownError",
        "EngineTimeoutError",
        "History",
        "Inference",
        "InvalidFieldError",
        "JourneymanError",
        "LocalBackend",
        "LoraConfig",
        "ModelConfig",
        "NoTrainableTokensError",
        "OnError",
        "ProtocolMismatchError",
        "RemoteBackend",
        "RemoteError",
        "RolloutDroppedError",
        "RolloutException",
        "RulerConfig",
        "RulerJudgeError",
        "SFTConfig",
        "TokenRecord",
        "TooManyExceptionsError",
        "Tracker",
        "TrainConfig",
        "TrainResult",
        "TrainableModel",
        "TrainerConfig",
        "TrainerRankError",
        "Trajectory",
        "TrajectoryGroup",
        "UnknownModelError",
        "VLLMConfig",
        "capture_scope",
        "current_backend",
        "gather_trajectory_groups",
        "open_backend",
        "read_trajectories",
        "record_of",
        "ruler_score_group",
        "write_trajectories",
    ]
    for name in journeyman.__all__:
        assert getattr(journeyman, name) is not None


# Run in a fresh interpreter: this test process has long since imported torch for other tests.
_PROBE = """
import json, sys, threading
before = threading.active_count()
import journeyman
heavy = sorted(m for m in ("torch", "transformers", "fastapi", "uvicorn") if m in sys.modules)
print(json.dumps({"heavy": heavy, "threads": [before, threading.active_count()]}))
"""


def test_import_is_light(tmp_path: Path) -> None:
    """Engines, the trainer and the HTTP server load when a backend first serves a model, not before."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [], f"`import journeyman` imports {report['heavy']}"
    before, after = report["threads"]
    assert after == before, f"`import journeyman` started {after - before} thread(s)"
