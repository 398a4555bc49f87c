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


def assert_close_outputs(a_outs, b_outs, tolerance: float, ties: bool = True) -> None:
    """Greedy tokens alike and logprobs within `tolerance` nats. Two modes that round differently may part
    where two tokens tie (seen on the generic tier: 1e-4 nats apart); with `ties`, a parting is accepted
    only at such a tie, each side's token within `tolerance` of the other's in both modes, and the
    comparison of that sequence ends there."""
    for a, b in zip(a_outs, b_outs):
        a_ids, b_ids = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert len(a_ids) == len(b_ids)
        for ta, tb, lp_a, lp_b in zip(a_ids, b_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            shared = lp_a.keys() & lp_b.keys()
            assert shared
            assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in shared) < tolerance
            if ta != tb:
                assert ties, f"greedy tokens part: {ta} against {tb}"
                assert {ta, tb} <= shared, "a parting that is not between the two modes' top tokens"
                assert abs(lp_a[ta].logprob - lp_a[tb].logprob) < tolerance
                assert abs(lp_b[ta].logprob - lp_b[tb].logprob) < tolerance
                break
