"""GrammarCompiler: a StructuredOutput turned into an llguidance grammar, checked against the model's
tokenizer, and kept by its cache key, so a schema an agent sends on every turn is compiled once.

llguidance was chosen by measurement (benchmarks/grammar_engines.py, RESULTS.md): it compiles each schema
of the committed suite in under 1.5 ms, refuses none of them, and brings no dependencies of its own.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from copy import copy

import numpy as np

from kvflow.structured.spec import StructuredOutput

# JSON as models write it (json.dumps' separators), with no free whitespace: a small model given free
# whitespace can fill its whole budget with newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256
# Characters that only close an array or object (a quote before them closes a string).
CLOSING_BRACKETS = frozenset("]} ")


def lark_json(schema) -> str:
    """A Lark rule body (llguidance's %json) matching JSON valid against schema, written as kvflow writes
    JSON everywhere (JSON_OPTIONS); a true/false schema is any value / none."""
    if not isinstance(schema, dict):
        schema = {} if schema else {"not": {}}
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def lark_body(spec: StructuredOutput) -> str | None:
    """A Lark rule body for spec's JSON schema, regex or choice, to sit inside a larger grammar (after a
    think block, inside a harmony message); None for a Lark grammar, which applies from the first token."""
    if spec.json is not None:
        return lark_json(spec.json)
    if spec.regex is not None:
        return "/" + spec.regex.replace("/", "\\/") + "/"
    if spec.choice is not None:
        return "(" + " | ".join(json.dumps(c) for c in spec.choice) + ")"
    return None


class GrammarError(ValueError):
    """A constraint that cannot be compiled (a bad schema, an unsupported keyword, a bad regex)."""


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for spec (no tokenizer needed)."""
    from llguidance import LLMatcher

    if spec.json is not None:
        return LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return LLMatcher.grammar_from_lark(spec.grammar)


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe: the server checks a request's constraint on its
    event loop, the engine thread compiles it again (a cache hit) when the request is added."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._closing: np.ndarray | None = None
        self._closing_ids: tuple[np.ndarray, np.ndarray] = ()
        self._texts: list[str] | None = None

    @property
    def tokenizer(self):
        """llguidance's view of the vocabulary (about 0.3 s to build for 49K tokens, so built once)."""
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                backend = copy(self._hf_tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._tokenizer = LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self.eos_token_id)
            return self._tokenizer

    @property
    def token_texts(self) -> list[str]:
        """Each token's text alone (for following where a JSON output stands: json_state.py)."""
        if self._texts is None:
            count = min(self.vocab_size, len(self._hf_tokenizer))
            self._texts = [self._hf_tokenizer.decode([t]) for t in range(count)]
            self._texts += [""] * (self.vocab_size - count)
        return self._texts

    @property
    def closing_tokens(self) -> np.ndarray:
        """bool [2, vocab]: tokens that close a string (a quote, then only closing brackets), and tokens made
        only of closing brackets. A request about to run out of tokens is held to these where its grammar
        allows them (masks.wrap_up), so it ends as valid JSON instead of being cut off inside a string or a
        nesting that a small model keeps repeating."""
        if self._closing is None:
            closing = np.zeros((2, self.vocab_size), dtype=bool)
            for token, text in enumerate(self.token_texts):
                text = text.strip()
                if text and set(text[1:]) <= CLOSING_BRACKETS and text[0] in CLOSING_BRACKETS | {'"'}:
                    closing[0 if text[0] == '"' else 1, token] = True
            self._closing = closing
            self._closing_ids = (np.flatnonzero(closing[0]), np.flatnonzero(closing[1]))
        return self._closing

    @property
    def closing_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The token ids of closing_tokens' two rows, ascending."""
        self.closing_tokens  # noqa: B018 - built with them
        return self._closing_ids

    def compile(self, spec: StructuredOutput) -> str:
        """The checked grammar for spec; GrammarError naming the problem when it cannot be used."""
        key = spec.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._check(spec)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _check(self, spec: StructuredOutput) -> str:
        from llguidance import LLMatcher

        what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[spec.kind]
        try:
            grammar = grammar_text(spec)
        except Exception as exc:  # llguidance raises ValueError/RuntimeError with its reason
            raise GrammarError(f"invalid {what}: {_first_lines(str(exc))}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"invalid {what}: {_first_lines(messages[0]) if messages else 'rejected'}")
        return grammar

    def matcher(self, spec: StructuredOutput):
        """A fresh llguidance matcher for one sequence."""
        from llguidance import LLMatcher

        return LLMatcher(self.tokenizer, self.compile(spec), log_level=0)


def _first_lines(message: str) -> str:
    """llguidance's reason without the source excerpt and carets it draws under it."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [lines[0]] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(kept)
