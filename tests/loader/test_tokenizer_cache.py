"""The cache of tokenizers built from GGUF metadata (kvflow/loader/tokenizer_cache.py): a later load reads
what the first one built and behaves the same; a broken entry is rebuilt; a changed file misses; "off"
writes nothing."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import default_gguf_path

from kvflow.loader import gguf_tokenizer, tokenizer_cache
from kvflow.loader.gguf_reader import MappedGGUFReader
from kvflow.loader.gguf_tokenizer import load_gguf_tokenizer

TEXTS = ["The quick brown fox. It's 'quoted', isn't it?", "안녕하세요 🎉🚀 x\n\n\tdef f(a):\n    return a",
         "<|im_start|>user\nHi<|im_end|>", "   leading spaces and 12345 digits"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    """A copy of the default model (its modification time is the test's to change) and an empty cache."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(default_gguf_path(), path)
    monkeypatch.setenv("KVFLOW_TOKENIZER_CACHE", str(tmp_path / "cache"))
    return path


def load(path):
    return load_gguf_tokenizer(MappedGGUFReader(str(path)), path)


def assert_same(a, b) -> None:
    assert len(a) == len(b) and a.all_special_tokens == b.all_special_tokens
    assert (a.bos_token, a.eos_token, a.chat_template) == (b.bos_token, b.eos_token, b.chat_template)
    for text in TEXTS:
        ids = a.encode(text)
        assert ids == b.encode(text)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == b.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)


def test_a_later_load_reads_the_built_tokenizer(model_file, monkeypatch):
    built = load(model_file)
    entries = list((model_file.parent / "cache").glob("*"))
    assert sorted(p.name.split(".", 1)[1] for p in entries) == ["settings.json", "tokenizer.json"]

    def no_build(vocab):
        raise AssertionError("built again")

    monkeypatch.setattr(gguf_tokenizer, "gguf_tokenizer_parts", no_build)
    assert_same(built, load(model_file))


def test_an_unreadable_entry_is_rebuilt(model_file, caplog):
    built = load(model_file)
    (backend,) = (model_file.parent / "cache").glob("*.tokenizer.json")
    backend.write_text("{ not json")
    again = load(model_file)
    assert "cannot be read" in caplog.text
    assert_same(built, again)
    assert backend.read_text().startswith("{")
    assert_same(built, load(model_file))  # the rewritten entry reads


def test_a_changed_file_misses(model_file):
    load(model_file)
    before = tokenizer_cache.entry_key(model_file)
    stat = model_file.stat()
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert tokenizer_cache.entry_key(model_file) != before
    load(model_file)
    assert len(list((model_file.parent / "cache").glob("*.settings.json"))) == 2


def test_off_writes_nothing(model_file, monkeypatch):
    monkeypatch.setenv("KVFLOW_TOKENIZER_CACHE", "off")
    load(model_file)
    assert not (model_file.parent / "cache").exists()
