"""The public names of journeyman (pinned in public_names.txt beside this file), and what `import journeyman`
costs: the API changes only on purpose."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import journeyman
import pytest
from _support import check_public_names


def test_public_names() -> None:
    check_public_names("journeyman", __file__)


def test_the_pin_fails_on_a_name_added_removed_or_listed_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check every package's test_imports.py shares (`_support.check_public_names`)."""
    (tmp_path / "public_names.txt").write_text("a\nb\n")
    package = types.SimpleNamespace(a=1, b=2, c=3, __all__=["b", "a"])
    monkeypatch.setitem(sys.modules, "pinned_package", package)
    test_file = str(tmp_path / "test_imports.py")
    check_public_names("pinned_package", test_file)
    for exported, why in ((["a", "b", "c"], r"added \['c'\], removed \[\]"), (["a"], r"removed \['b'\]")):
        package.__all__ = exported
        with pytest.raises(AssertionError, match=why):
            check_public_names("pinned_package", test_file)
    package.__all__ = ["a", "b", "b"]
    with pytest.raises(AssertionError, match="listed twice"):
        check_public_names("pinned_package", test_file)


# Run in a fresh interpreter: this test process has long since imported torch for other tests.
_PROBE = """
import json, sys, threading
before = threading.active_count()
import journeyman
from journeyman import RemoteBackend, TrainableModel, gather_trajectory_groups, read_trajectories, ruler_score_group
import journeyman.integrations
threads = [before, threading.active_count()]
heavy = sorted(m for m in HEAVY if m in sys.modules)
upper = sorted(m for m in sys.modules if m.startswith("journeyman.") and m.split(".")[1] in TRAINER_LAYERS)
journeyman.LocalBackend  # a lazy name: its module loads now, and still no heavy library
heavy_after = sorted(m for m in HEAVY if m in sys.modules)
print(json.dumps({"heavy": heavy, "upper": upper, "threads": threads, "heavy_after": heavy_after}))
"""
# What the `backend` extra installs, and the layers only the machine that trains needs.
HEAVY = ("torch", "transformers", "peft", "safetensors", "gguf", "xgrammar", "matplotlib")
HEAVY += ("fastapi", "starlette", "uvicorn")
TRAINER_LAYERS = ("policy", "engine", "training", "serving", "backends", "app")


def test_import_is_light(tmp_path: Path) -> None:
    """`import journeyman`, the light client's names and `journeyman.integrations` load no library of
    the backend extra and no module of the layers that train; engines, the trainer and the HTTP
    server load when a backend first serves a model."""
    probe = f"HEAVY = {HEAVY!r}\nTRAINER_LAYERS = {TRAINER_LAYERS!r}\n{_PROBE}"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [], f"`import journeyman` imports {report['heavy']}"
    assert report["upper"] == [], f"`import journeyman` imports {report['upper']}"
    assert report["heavy_after"] == [], f"`journeyman.LocalBackend` imports {report['heavy_after']}"
    before, after = report["threads"]
    assert after == before, f"`import journeyman` started {after - before} thread(s)"


def test_lazy_names_resolve_and_are_listed() -> None:
    from journeyman.backends.local import LocalBackend
    from journeyman.engine.vllm_server import VLLMConfig

    assert journeyman.LocalBackend is LocalBackend and journeyman.VLLMConfig is VLLMConfig
    assert set(journeyman.__all__) <= set(dir(journeyman))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        journeyman.nope  # noqa: B018


def test_a_missing_backend_package_names_the_extra() -> None:
    """The light install's error (tests/test_light_client.py meets it for real, in a venv without torch)."""
    from journeyman._extras import require_backend

    require_backend("this test", ("json",))  # present: no error
    with pytest.raises(
        ImportError, match=r"needs no_such_pkg_a, no_such_pkg_b, .*pip install 'journeyman\[backend\]'"
    ) as e:
        require_backend("this test", ("json", "no_such_pkg_a", "no_such_pkg_b"))
    assert e.value.name == "no_such_pkg_a"
