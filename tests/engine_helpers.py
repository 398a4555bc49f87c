"""Helpers shared by the engine tests: build engines over an already loaded model, run prompts greedily."""

from __future__ import annotations

from kvflow import LLM, SamplingParams

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

PROMPTS = [
    "The history of the Roman Empire began",
    "Write a Python function that reverses a linked list.",
    "My favourite recipe for pancakes is",
    "In quantum mechanics, the uncertainty principle states",
    "The quick brown fox",
    "Here is a list of the planets in our solar system:",
    "Dear hiring manager, I am writing to apply for",
    "Translate to French: The weather is nice today.",
    "A haiku about autumn leaves:",
    "The main causes of the First World War were",
    "To install a package with pip, run",
    "Once upon a time in a small village there lived",
    "The derivative of sin(x) is",
    "Machine learning models are trained by",
    "The best way to learn a new language is",
    "SELECT name, age FROM users WHERE",
]


def make_llm(loaded, **options) -> LLM:
    """An LLM over `loaded`. Speculation is off unless asked for: these tests count steps and rows of
    one token per sequence; the speculative ones (test_invariance_speculative.py, test_speculative.py) ask."""
    options.setdefault("kv_cache_memory", 64 << 20)
    options.setdefault("speculative_config", "off")
    return LLM(loaded_model=loaded, **options)


def llm_builder(loaded, **defaults):
    """A function that makes LLMs over `loaded` with these options, each call's own on top: the `model`
    fixture the invariance tests (test_invariance.py and the modules that rerun it) take."""

    def build(**extra) -> LLM:
        return make_llm(loaded, **{**defaults, **extra})

    return build


def greedy_tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY_32) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
