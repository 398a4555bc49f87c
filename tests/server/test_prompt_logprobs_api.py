"""Scoring a text over HTTP (issue 24): `echo` with `logprobs` and `max_tokens=0` on /v1/completions, as
lm-evaluation-harness and perplexity scripts ask for it, and vLLM's `prompt_logprobs`, on the default
model in float32 against transformers' log_softmax on the same weights, with a cold and a warm cache."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI

from server.conftest import DEFAULT_NAME

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin of Germany."


@pytest.fixture(scope="module")
def client(default_server) -> OpenAI:
    return OpenAI(base_url=f"{default_server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def scored(default_server, hf_default) -> tuple[list[int], torch.Tensor]:
    """The text's token ids as the server tokenizes it, and the reference log_softmax at every position."""
    ids = httpx.post(f"{default_server.base_url}/tokenize", json={"prompt": TEXT}).json()["tokens"]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_default(torch.tensor([ids])).logits[0].float(), -1)
    return ids, ref


def check_echoed(lp, ids: list[int], ref: torch.Tensor) -> None:
    """An OpenAI completions logprobs block over the prompt: null first, then each token given the ones before."""
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - ref[pos - 1, ids[pos]].item()) < 1e-3, pos
        best = ref[pos - 1].max().item()
        assert abs(max(lp.top_logprobs[pos].values()) - best) < 1e-3, pos
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_max_tokens_zero_scores_the_prompt_cold_and_warm(client, scored):
    ids, ref = scored
    for _ in ("cold", "warm"):
        r = client.completions.create(model=DEFAULT_NAME, prompt=TEXT, echo=True, max_tokens=0, logprobs=1)
        choice = r.choices[0]
        assert choice.text == TEXT and choice.finish_reason == "length"
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
        assert len(choice.logprobs.tokens) == len(ids)
        check_echoed(choice.logprobs, ids, ref)


def test_lm_eval_loglikelihood_request(client, scored):
    """lm-evaluation-harness's local-completions: echo, max_tokens=1, logprobs=1, then sums the
    continuation's token_logprobs and checks each was the greedy choice."""
    ids, ref = scored
    context = 12
    r = client.completions.create(model=DEFAULT_NAME, prompt=ids, echo=True, max_tokens=1, logprobs=1,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    total = sum(lp.token_logprobs[context:-1])
    expected = sum(ref[p - 1, ids[p]].item() for p in range(context, len(ids)))
    assert abs(total - expected) < 1e-2
    greedy = [max(t, key=t.get) == tok for t, tok in zip(lp.top_logprobs[context:-1], lp.tokens[context:-1])]
    expected_greedy = [int(ref[p - 1].argmax()) == ids[p] for p in range(context, len(ids))]
    assert greedy == expected_greedy


def test_streamed_echo_carries_the_prompt_logprobs_first(client, scored):
    ids, ref = scored
    chunks = list(client.completions.create(model=DEFAULT_NAME, prompt=TEXT, echo=True, max_tokens=3, logprobs=2,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == TEXT and len(first.logprobs.tokens) == len(ids)
    check_echoed(first.logprobs, ids, ref)
    later = [t for ch in chunks[1:] for t in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    assert len(later) == 3 and all(v is not None for v in later)


def test_vllm_prompt_logprobs_on_completions_and_chat(client, default_server, scored):
    ids, ref = scored
    r = client.completions.create(model=DEFAULT_NAME, prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        entry = got[pos]
        own = entry[str(ids[pos])]
        assert abs(own["logprob"] - ref[pos - 1, ids[pos]].item()) < 1e-3
        assert own["rank"] == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        top2 = torch.topk(ref[pos - 1], 2).indices.tolist()
        assert {str(t) for t in top2} <= set(entry) and len(entry) <= 3
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=DEFAULT_NAME, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    prompt_ids = httpx.post(f"{default_server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
    scored_chat = chat.model_extra["prompt_logprobs"]
    assert len(scored_chat) == len(prompt_ids) == chat.usage.prompt_tokens
    assert all(set(e) == {str(t)} for e, t in zip(scored_chat[1:], prompt_ids[1:]))
    assert chat.choices[0].message.content  # the answer is generated as usual


def test_bad_prompt_logprobs_is_400(default_server):
    r = httpx.post(f"{default_server.base_url}/v1/completions", json={"prompt": "hi", "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = httpx.post(f"{default_server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
