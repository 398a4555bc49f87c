"""The tokenizer (with its chat template) for a resolved model."""

from __future__ import annotations

from kvflow.errors import ModelLoadError
from kvflow.loader.resolve import ResolvedModel


def load_tokenizer(resolved: ResolvedModel, gguf_reader=None):
    """A transformers PreTrainedTokenizerFast. GGUF files carry theirs in metadata; folders in tokenizer.json."""
    if resolved.kind == "gguf":
        from kvflow.loader.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(gguf_reader, resolved.path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(resolved.path))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {resolved.path}: {exc}") from exc
