"""Read a Hugging Face model folder: config.json and its weights (safetensors, single or sharded)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from kvflow.errors import ModelLoadError

log = logging.getLogger("kvflow")


# Image-text checkpoints whose text model kvflow runs alone: (the text model's architecture, model type).
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text")}


def read_config(folder: Path) -> dict:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{folder} has no config.json (not a Hugging Face model folder)") from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    return with_generation_eos(text_model_config(cfg), folder)


def with_generation_eos(cfg: dict, folder: Path) -> dict:
    """The config with generation_config.json's end-of-turn tokens added to its own: instruct models often
    list more there (Llama 3's <|eom_id|> and <|eot_id|>, gpt-oss's <|call|> beside <|return|>)."""
    try:
        extra = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return cfg
    ids = _token_ids(cfg.get("eos_token_id"))
    merged = ids + [t for t in _token_ids(extra) if t not in ids]
    return {**cfg, "eos_token_id": merged} if merged != ids else cfg


def _token_ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [int(value)] if isinstance(value, int) else [int(t) for t in value]


def text_model_config(cfg: dict) -> dict:
    """The config of an image-text checkpoint's text model (Gemma 3 4B and up), which kvflow runs alone;
    any other config as it is. Its weights keep their names (the model class maps them)."""
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in TEXT_MODELS or not isinstance(cfg.get("text_config"), dict):
        return cfg
    arch, model_type = TEXT_MODELS[archs[0]]
    log.info("%s: running its text model (%s); image inputs are not supported", archs[0], arch)
    text = {**cfg["text_config"], "architectures": [arch]}
    text.setdefault("model_type", model_type)
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "torch_dtype", "dtype"):
        if key in cfg:
            text.setdefault(key, cfg[key])
    return text


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards named in the index are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise ModelLoadError(f"{folder} has no weights (*.safetensors or pytorch_model*.bin)")


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in weight_files(folder):
        if file.suffix == ".bin":
            yield from torch.load(file, map_location="cpu", weights_only=True).items()
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
