"""Prompts for the serving benchmark: random text of a requested token length, and agent conversations.

Without a tokenizer we draw from common short English words that each encode to one token (with a
leading space) in the BPE vocabularies of Llama-family models, so N words is about N tokens.  With a
tokenizer (``--tokenizer PATH``) prompts are trimmed to the exact token count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who its now find long down day "
    "did get come made may part over new sound take only little work know place year live me back give most "
    "very after thing our just name good man think say great where help through much before line right too "
    "mean old any same tell boy follow came want show also around form three small set put end does another "
    "well large must big even such because turn here why ask went men read need land different home us move "
    "try kind hand picture again change off play spell air away animal house point page letter mother answer"
).split()


class PromptMaker:
    """Makes prompts of a given token length, optionally sharing their first ``shared_prefix_len`` tokens."""

    def __init__(self, seed: int = 0, tokenizer_path: str | None = None, shared_prefix_len: int = 0) -> None:
        self.rng = random.Random(seed)
        self.tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None
        # The shared prefix comes from its own generator so it is the same for any seed.
        self.prefix = self._text(shared_prefix_len, random.Random(0x5EED)) if shared_prefix_len else ""
        self.shared_prefix_len = shared_prefix_len

    def _words(self, n: int, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def _text(self, n_tokens: int, rng: random.Random) -> str:
        if n_tokens <= 0:
            return ""
        if self.tokenizer is None:
            return self._words(n_tokens, rng)
        # Words may split into several tokens under a real tokenizer: overshoot, then trim exactly.
        ids = self.tokenizer.encode(self._words(n_tokens + 8, rng), add_special_tokens=False)
        while len(ids) < n_tokens:
            ids += self.tokenizer.encode(" " + self._words(n_tokens, rng), add_special_tokens=False)
        return self.tokenizer.decode(ids[:n_tokens])

    def prompt(self, n_tokens: int) -> str:
        """A prompt of about ``n_tokens`` tokens (exactly, with a tokenizer), starting with the prefix."""
        rest = self._text(max(n_tokens - self.shared_prefix_len, 0), self.rng)
        if not self.prefix:
            return rest
        return f"{self.prefix} {rest}" if rest else self.prefix

    def count_tokens(self, text: str) -> int:
        """Token count of ``text``: exact with a tokenizer, else one per word."""
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # optional, heavy: only when asked for

    return AutoTokenizer.from_pretrained(path)


def parse_range(spec: str) -> tuple[int, int]:
    """'a:b' -> (a, b), inclusive."""
    lo, hi = (int(x) for x in spec.split(":"))
    if lo > hi or lo < 0:
        raise ValueError(f"bad range {spec!r}: want a:b with 0 <= a <= b")
    return lo, hi


@dataclass
class RequestSpec:
    prompt: str
    prompt_len: int  # tokens we intended (the server's usage figure is preferred when reported)
    output_len: int


def make_requests(
    num_prompts: int,
    input_len: int | tuple[int, int],
    output_len: int | tuple[int, int],
    maker: PromptMaker,
) -> list[RequestSpec]:
    """``num_prompts`` requests with fixed lengths or lengths drawn uniformly from inclusive ranges."""

    def draw(spec: int | tuple[int, int]) -> int:
        return spec if isinstance(spec, int) else maker.rng.randint(*spec)

    specs = []
    for _ in range(num_prompts):
        n_in, n_out = draw(input_len), draw(output_len)
        specs.append(RequestSpec(maker.prompt(n_in), n_in, n_out))
    return specs


TOOL_TEMPLATE = (
    "Tool {i}: {name}\nDescription: {desc}\nParameters: {{\"type\": \"object\", \"properties\": "
    "{{\"query\": {{\"type\": \"string\"}}, \"limit\": {{\"type\": \"integer\"}}}}}}\n"
)


@dataclass
class AgentConversation:
    """A conversation whose context grows each turn: a long system prompt with tool descriptions,
    then per turn a new user message (the previous answer is appended by the runner)."""

    system: str
    user_messages: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]

    def add_user(self, turn: int) -> None:
        self.messages.append({"role": "user", "content": self.user_messages[turn]})

    def add_answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def as_prompt(self) -> str:
        """The conversation flattened for /v1/completions, ending where the assistant speaks."""
        parts = [f"{m['role'].capitalize()}: {m['content']}" for m in self.messages]
        return "\n\n".join(parts) + "\n\nAssistant:"


def make_agent_conversation(
    maker: PromptMaker, system_len: int, user_len: int, turns: int, conversation_seed: int
) -> AgentConversation:
    """System prompt and tools (shared by every conversation: agents share them) of about
    ``system_len`` tokens, and ``turns`` user messages of about ``user_len`` tokens each."""
    shared = random.Random(0xA6E7)
    n_tools = max(1, system_len // 400)
    tools = "".join(
        TOOL_TEMPLATE.format(i=i, name=f"tool_{i}", desc=maker._text(max(system_len // n_tools - 60, 8), shared))
        for i in range(n_tools)
    )
    system = "You are a helpful agent. You can call these tools.\n\n" + tools
    own = random.Random(conversation_seed)
    users = [maker._text(user_len, own) for _ in range(turns)]
    return AgentConversation(system, users)
