"""Build a Hugging Face tokenizer from the tokenizer metadata inside a GGUF file.

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary, merges, token types, special
token ids and chat template as metadata. We rebuild the matching `tokenizers` pipeline here ourselves,
instead of calling transformers' own GGUF converter, so that our parity tests compare two
independent implementations.

Two vocabularies are supported, named by `tokenizer.ggml.model`:
  "gpt2"  byte-level BPE (SmolLM2, Llama 3, Qwen2, ...), split by the regex `tokenizer.ggml.pre` names;
  "llama" SentencePiece BPE with byte fallback and the "▁" metaspace (Llama 2, TinyLlama, Mistral).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from kvflow.loader.gguf_reader import MappedGGUFReader

logger = logging.getLogger(__name__)

SUPPORTED_MODELS = ("gpt2", "llama")
_METASPACE = "\u2581"


@dataclass
class GGUFVocab:
    """The tokenizer metadata of one GGUF file, under plain names."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < len(self.tokens) else None


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    # contents() turns even a vocabulary-sized array into a list quickly enough to need no raw-part reading.
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf_vocab(reader: gguf.GGUFReader) -> GGUFVocab:
    """Pull the tokenizer keys llama.cpp writes out of an open GGUF file."""
    model = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ValueError("GGUF file has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens)
    return GGUFVocab(
        model=model,
        pre=_field(reader, "tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=[int(t) for t in token_types],
        scores=_field(reader, "tokenizer.ggml.scores"),
        merges=_field(reader, "tokenizer.ggml.merges"),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        unk_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        # llama.cpp adds BOS by default for SentencePiece vocabularies that do not say otherwise.
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


# ---- byte-level BPE ("gpt2") -------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable bytes stand for themselves, the rest are
    shifted past 255 so that no token ever contains whitespace or control characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama 3's split with single digits.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# GPT-4o's (o200k: gpt-oss): words split at case changes keep their contraction; "/" joins a run of symbols.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_REGEX = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is GPT-2's.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm"/"starcoder" split: every digit alone, then GPT-2's regex (as SmolLM2's tokenizer.json).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


# tokenizer.ggml.pre -> (pre-tokenizer, ignore_merges). llama.cpp's llama-vocab.cpp groups pre types the same way.
_PRE_TOKENIZERS: dict[str, tuple[Callable[[], pre_tokenizers.PreTokenizer], bool]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"), (_gpt2_split, False)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (_digits_then_gpt2_split, False),
    ),
    # Llama 3's vocabulary comes from tiktoken: a whole word found in the vocabulary wins over the merges.
    **dict.fromkeys(
        ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral"),
        (lambda: _split_then_bytes(_LLAMA3_REGEX), True),
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (lambda: _split_then_bytes(_QWEN2_REGEX), False)
    ),
    # tiktoken's o200k (gpt-oss): as Llama 3's, a whole piece found in the vocabulary wins.
    "gpt-4o": (lambda: _split_then_bytes(_GPT4O_REGEX), True),
}


def _byte_level_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    spell = _byte_alphabet()
    byte_chars = set(spell.values())
    matched_whole = {gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED}
    entries: dict[str, int] = {}
    for token_id, (token, token_type) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        # Added tokens keep their raw text, which is how they are matched in input; a normal token outside
        # the byte alphabet is respelled so that BPE can still reach it.
        if token_type not in matched_whole and not set(token) <= byte_chars:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        entries.setdefault(token, token_id)
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges or []]

    pre = vocab.pre or "default"
    if pre not in _PRE_TOKENIZERS:
        logger.warning("GGUF pre-tokenizer %r is unknown; splitting text as GPT-2 does", pre)
        pre = "default"
    make_pre_tokenizer, ignore_merges = _PRE_TOKENIZERS[pre]

    tokenizer = Tokenizer(
        models.BPE(vocab=entries, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
    )
    tokenizer.pre_tokenizer = make_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


# ---- SentencePiece BPE ("llama") ---------------------------------------------------------------------


def _merges_from_scores(vocab: GGUFVocab, entries: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece files store scores, not merges. SentencePiece BPE merges first the adjacent pair whose
    joined piece scores highest, so every way of cutting a piece in two becomes a merge ranked by its score."""
    mergeable = {gguf.TokenType.NORMAL, gguf.TokenType.USER_DEFINED}
    scores = vocab.scores or [-float(i) for i in range(len(vocab.tokens))]
    ranked = []
    for token_id, token in enumerate(vocab.tokens):
        if vocab.token_types[token_id] not in mergeable or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = entries.get(left), entries.get(right)
            if left_id is None or right_id is None:
                continue
            if vocab.token_types[left_id] in mergeable and vocab.token_types[right_id] in mergeable:
                ranked.append((-scores[token_id], token_id, left_id, right_id, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    entries: dict[str, int] = {}
    for token_id, token in enumerate(vocab.tokens):
        entries.setdefault(token, token_id)
    if vocab.merges:
        merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    else:
        merges = _merges_from_scores(vocab, entries)
    tokenizer = Tokenizer(
        models.BPE(
            vocab=entries,
            merges=merges,
            unk_token=vocab.token(vocab.unk_id),
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # Spaces become "▁"; with add_space_prefix the text also gets one in front, as SentencePiece does.
    prepend = "first" if vocab.add_space_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_METASPACE, prepend_scheme=prepend, split=False
    )
    steps = [decoders.Replace(_METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


# ---- common parts ------------------------------------------------------------------------------------

_BUILDERS: dict[str, Callable[[GGUFVocab], Tokenizer]] = {
    "gpt2": _byte_level_tokenizer,
    "llama": _sentencepiece_tokenizer,
}


def _add_whole_tokens(tokenizer: Tokenizer, vocab: GGUFVocab) -> None:
    """Control and unknown tokens become special tokens (dropped by skip_special_tokens); user-defined
    ones become plain added tokens, still matched whole, still shown on decode (as llama.cpp does)."""
    special, plain = [], []
    for token, token_type in zip(vocab.tokens, vocab.token_types, strict=True):
        if token_type in (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == gguf.TokenType.USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)


def _post_processor(vocab: GGUFVocab) -> processors.TemplateProcessing:
    bos, eos = vocab.token(vocab.bos_id), vocab.token(vocab.eos_id)
    prefix = [bos] if vocab.add_bos and bos is not None else []
    suffix = [eos] if vocab.add_eos and eos is not None else []
    single = [f"{t}:0" for t in prefix] + ["$A:0"] + [f"{t}:0" for t in suffix]
    pair = single + [f"{t}:1" for t in prefix] + ["$B:1"] + [f"{t}:1" for t in suffix]
    ids = {**({bos: vocab.bos_id} if prefix else {}), **({eos: vocab.eos_id} if suffix else {})}
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=list(ids.items())
    )


def build_gguf_tokenizer(vocab: GGUFVocab) -> PreTrainedTokenizerFast:
    """The Hugging Face fast tokenizer that `vocab` describes, chat template and special tokens included."""
    backend, kwargs = gguf_tokenizer_parts(vocab)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def gguf_tokenizer_parts(vocab: GGUFVocab) -> tuple[Tokenizer, dict[str, Any]]:
    """The `tokenizers` pipeline that `vocab` describes, and PreTrainedTokenizerFast's keyword arguments
    around it (special tokens, chat template: JSON values, so that loader/tokenizer_cache can keep them)."""
    if vocab.model not in _BUILDERS:
        raise ValueError(
            f"unsupported GGUF tokenizer model {vocab.model!r}; supported: {', '.join(SUPPORTED_MODELS)}"
        )
    tokenizer = _BUILDERS[vocab.model](vocab)
    _add_whole_tokens(tokenizer, vocab)
    tokenizer.post_processor = _post_processor(vocab)
    named = {
        "bos_token": vocab.token(vocab.bos_id),
        "eos_token": vocab.token(vocab.eos_id),
        "unk_token": vocab.token(vocab.unk_id),
        "pad_token": vocab.token(vocab.pad_id),
    }
    kwargs = {name: token for name, token in named.items() if token is not None}
    # llama.cpp decodes text verbatim; no "clean-up" of spaces before punctuation.
    kwargs.update(add_bos_token=vocab.add_bos, add_eos_token=vocab.add_eos, chat_template=vocab.chat_template,
                  clean_up_tokenization_spaces=False)
    return tokenizer, kwargs


def load_gguf_tokenizer(reader: gguf.GGUFReader, path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Build the tokenizer stored in an open GGUF file; given the file's path, through the cache of built
    tokenizers (loader/tokenizer_cache)."""
    if path is None:
        return build_gguf_tokenizer(read_gguf_vocab(reader))
    from kvflow.loader.tokenizer_cache import cached_tokenizer

    return cached_tokenizer(Path(path), lambda: gguf_tokenizer_parts(read_gguf_vocab(reader)))


def load_gguf_tokenizer_from_path(path: str | Path) -> PreTrainedTokenizerFast:
    """Build the tokenizer stored in the GGUF file at `path`."""
    return load_gguf_tokenizer(MappedGGUFReader(str(path)))
