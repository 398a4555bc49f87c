"""SamplingParams: every bad value is refused at construction, naming the field; good values normalise."""

from __future__ import annotations

import pytest

from kvflow.sampling_params import SamplingParams

INVALID = [
    ("n", 0),
    ("n", 1.5),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -3.0),
    ("seed", 1.5),
    ("seed", "7"),
    ("max_tokens", -1), ("prompt_logprobs", 21), ("prompt_logprobs", True),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", [f"s{i}" for i in range(65)]),  # each step checks every stop string: their count is bounded
    ("stop", ["x" * 1025]),  # and so is their length (text that may begin one is held back and re-scanned)
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("logprobs", -1),
    ("logprobs", 21),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_raises_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}:"):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens:.*max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_values_are_normalised() -> None:
    params = SamplingParams(stop="###", stop_token_ids=None, top_k=-1)
    assert params.stop == ["###"]
    assert params.stop_token_ids == []
    assert params.top_k == 0
    assert SamplingParams(stop=None).stop == []


def test_boundary_values_are_accepted() -> None:
    params = SamplingParams(
        temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, logprobs=20
    )
    assert params.logprobs == 20 and params.min_p == 1.0


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [({"temperature": 0.0}, True), ({"top_k": 1}, True), ({"temperature": 0.7}, False), ({}, False)],
)
def test_greedy_property(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy
