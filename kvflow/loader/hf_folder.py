"""Read a Hugging Face model folder: config.json and its weights (safetensors, single or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from kvflow.errors import ModelLoadError


def read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{folder} has no config.json (not a Hugging Face model folder)") from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc


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
