"""Prompt tokenization in the engine."""

from __future__ import annotations

from kvflow import LLM


def test_chat_rendered_prompt_gets_no_second_bos(tiny_checkpoints):
    from tokenizers.processors import TemplateProcessing

    llm = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory=8 << 20)
    tokenizer = llm.get_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    plain = llm.engine.tokenize("hello world")
    rendered = llm.engine.tokenize(llm.apply_chat_template([{"role": "user", "content": "hello"}]))
    assert plain[0] == bos and plain[1] != bos  # a plain prompt gets the tokenizer's BOS
    assert rendered[0] == bos and rendered[1] != bos  # the template's own BOS, not two
