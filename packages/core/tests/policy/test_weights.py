"""`base_model` names: one no backend could load is refused at once, before anything loads, naming
the field, the value, the models known here and the forms that would do."""

from __future__ import annotations

import time
from pathlib import Path

import journeyman as jm
import pytest
from journeyman.policy.weights import resolve_base_model


def test_an_unknown_bare_name_is_refused_at_once_naming_the_known_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "models--HuggingFaceTB--SmolLM2-360M-Instruct").mkdir()  # a hub model cached here
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(jm.BaseModelNotFoundError) as e:
        jm.TrainableModel(name="m", project="p", base_model="not-a-model")
    assert time.monotonic() - t0 < 1  # no hub asked, nothing loaded (42 s before, from the CLI)
    assert (e.value.field, e.value.value) == ("base_model", "not-a-model")
    message = str(e.value)
    assert message.startswith("base_model='not-a-model': no such model; known here: ")
    assert "smollm2-135m-instruct (embedded), HuggingFaceTB/SmolLM2-360M-Instruct." in message
    assert "owner/name" in message and "\n" not in message  # one line, with the forms that would do
    with pytest.raises(jm.BaseModelNotFoundError):  # the loader's own check, for a name set by hand
        resolve_base_model("not-a-model")


def test_paths_hub_ids_and_directories_pass_to_the_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("owner/name", "./model", "~/model", str(tmp_path), jm.DEFAULT_BASE_MODEL):
        assert jm.TrainableModel(name="m", project="p", base_model=name).base_model == name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local-model").mkdir()  # a bare name that is a directory here
    assert jm.TrainableModel(name="m", project="p", base_model="local-model").base_model == "local-model"
    with pytest.raises(jm.BaseModelNotFoundError) as e:  # the loader then says what the directory lacks
        resolve_base_model("local-model")
    assert "has no config.json" in str(e.value) and e.value.field == "base_model"
