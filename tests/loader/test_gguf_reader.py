"""kvflow's GGUF reader (loader/gguf_reader.py) against the `gguf` package's own: it reads metadata arrays in
bulk, and must give every field exactly as the package does."""

from __future__ import annotations

import gguf
import numpy as np

from kvflow.loader.gguf_reader import MappedGGUFReader


def assert_same_fields(path) -> None:
    ours, theirs = MappedGGUFReader(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in ours.fields.items():
        other = theirs.fields[name]
        assert field.types == other.types, name
        assert field.contents() == other.contents(), name
        assert field.offset == other.offset, name
        assert sum(int(p.nbytes) for p in field.parts) == sum(int(p.nbytes) for p in other.parts), name
    # A string array keeps one data index per element (vocabulary sizes are read as len(field.data)).
    tokens = "tokenizer.ggml.tokens"
    assert len(ours.fields[tokens].data) == len(theirs.fields[tokens].data) > 1000
    assert not isinstance(ours.fields[tokens].parts, list)  # made when read: most loads read none of them
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
           [(t.name, t.tensor_type, t.data_offset) for t in theirs.tensors]


def test_the_default_models_metadata_reads_as_the_gguf_package_reads_it(default_gguf):
    assert_same_fields(default_gguf)


def test_arrays_of_every_kind_read_as_the_gguf_package_reads_them(tmp_path):
    """Numbers of several widths, booleans, strings with multi-byte characters and an empty one, and a nested
    array (left to the package's own code). (The package's writer refuses empty arrays.)"""
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.ints", [1, -2, 3, 2**31 - 1])
    writer.add_array("test.floats", [0.5, -1.25, 3.0e-8])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3, 4]])
    writer.add_token_list(["<s>", "é", "日本", ""] + [f"tok{i}" for i in range(2000)])
    writer.add_token_scores([float(i) for i in range(2004)])
    writer.add_uint32("test.scalar", 7)
    writer.add_string("test.string", "ünïcode")
    writer.add_tensor("w", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_fields(path)
    ours = MappedGGUFReader(str(path))
    assert ours.fields["tokenizer.ggml.tokens"].contents()[:4] == ["<s>", "é", "日本", ""]
