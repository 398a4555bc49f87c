"""Bad model inputs: each gives one clear error naming the problem, and the CLI exits non-zero without a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_files import write_gguf

from kvflow.config import ModelConfig
from kvflow.errors import ModelLoadError, UnsupportedModelError
from kvflow.executors.model_setup import load_model


def run_cli(model: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "kvflow", "generate", "--model", model, "--max-tokens", "1", "hi"],
        capture_output=True, text=True, timeout=180, env=env,
    )


def assert_cli_fails_cleanly(model: str, *words: str) -> None:
    proc = run_cli(model)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def bad_cases(tmp_path: Path, default_gguf: Path) -> dict[str, tuple[str, type, list[str]]]:
    """name -> (model argument, expected error class, words the message must contain)."""
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(b"")
    truncated = tmp_path / "truncated.gguf"
    with open(default_gguf, "rb") as src:
        truncated.write_bytes(src.read(3_000_000))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 100)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    return {
        "missing path": (str(tmp_path / "does" / "not" / "exist"), ModelLoadError, ["not found"]),
        "folder without config.json": (str(no_config), ModelLoadError, ["no config.json"]),
        "truncated gguf": (str(truncated), ModelLoadError, ["truncated.gguf", "corrupt or truncated"]),
        "corrupt gguf": (str(garbage), ModelLoadError, ["garbage.gguf", "not a valid GGUF"]),
        "unsupported architecture": (str(gpt2), UnsupportedModelError, ["GPT2LMHeadModel", "LlamaForCausalLM"]),
        "unsupported gguf architecture": (
            str(write_gguf(tmp_path / "falcon.gguf", "falcon", "F32")), UnsupportedModelError, ["falcon", "llama"]
        ),
        "unsupported tensor type": (
            str(write_gguf(tmp_path / "q8k.gguf", "llama", "Q8_K")), UnsupportedModelError, ["Q8_K", "Q4_1"]
        ),
        "unknown alias": ("smollm9-1t", ModelLoadError, ["smollm9-1t", "alias", "smollm2-135m"]),
    }


CASES = [
    "missing path", "folder without config.json", "truncated gguf", "corrupt gguf", "unsupported architecture",
    "unsupported gguf architecture", "unsupported tensor type", "unknown alias",
]


@pytest.mark.parametrize("case", CASES)
def test_load_model_error(case, tmp_path, default_gguf):
    model, error, words = bad_cases(tmp_path, default_gguf)[case]
    with pytest.raises(error) as info:
        load_model(ModelConfig(model=model))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("case", CASES)
def test_cli_error_is_one_line(case, tmp_path, default_gguf):
    model, _, words = bad_cases(tmp_path, default_gguf)[case]
    assert_cli_fails_cleanly(model, *words)


def test_hub_id_resolves_through_the_local_cache(tmp_path, tiny_checkpoints, monkeypatch):
    """A hub id goes through huggingface_hub; offline, it is served from the usual cache layout."""
    from kvflow.loader.resolve import resolve_model

    cache = tmp_path / "hub"
    snapshot = cache / "models--kvflow-test--tiny-llama" / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_checkpoints["llama"], snapshot)
    (cache / "models--kvflow-test--tiny-llama" / "refs").mkdir()
    (cache / "models--kvflow-test--tiny-llama" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    resolved = resolve_model("kvflow-test/tiny-llama")
    assert resolved.kind == "hf" and resolved.path == snapshot
    loaded = load_model(ModelConfig(model="kvflow-test/tiny-llama", dtype="float32"))
    assert loaded.arch.architecture == "LlamaForCausalLM"

    with pytest.raises(ModelLoadError, match="kvflow-test/absent"):
        resolve_model("kvflow-test/absent")
