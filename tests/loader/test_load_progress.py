"""The load progress bar: shown on a terminal for a large model, never in a pipe or a log."""

from __future__ import annotations

import io

from kvflow.loader.load_progress import BIG_MODEL_BYTES, LoadProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_large_model_on_a_terminal_gets_a_bar_that_counts_every_tensor():
    out = Terminal()
    progress = LoadProgress("big.gguf", 3, BIG_MODEL_BYTES, stream=out, mininterval=0)
    assert list(progress.track(["a"])) == ["a"]  # the packed pass
    assert list(progress.track(["b", "c"])) == ["b", "c"]  # the float pass
    progress.close()
    text = out.getvalue()
    assert "loading big.gguf" in text and "3/3" in text


def test_no_bar_in_a_pipe_or_for_a_small_model():
    for stream, size in ((io.StringIO(), 10 * BIG_MODEL_BYTES), (Terminal(), BIG_MODEL_BYTES - 1)):
        progress = LoadProgress("m.gguf", 2, size, stream=stream, mininterval=0)
        assert list(progress.track([1, 2])) == [1, 2]
        progress.close()
        assert stream.getvalue() == ""
