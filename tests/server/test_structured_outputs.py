"""Structured output through the server on the default model: every schema of the committed suite gives
valid JSON, streamed and not; the openai client's parse() helper; completions and Ollama's `format`;
bad constraints are 400s that name the field and change nothing else."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import pytest
from openai import OpenAI
from pydantic import BaseModel
from structured.schema_suite import CASES, chat_prompt, violation

from server.conftest import DEFAULT_NAME
from server.test_errors import assert_error, assert_still_serves, post

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def client(agent_server) -> OpenAI:
    return OpenAI(base_url=f"{agent_server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def _response_format(case: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True}}


def _ask(client: OpenAI, case: dict, stream: bool) -> str:
    kwargs = dict(model=DEFAULT_NAME, messages=chat_prompt(case), response_format=_response_format(case),
                  temperature=0, max_tokens=MAX_TOKENS)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# Every schema whole; streamed, every third (the constraint is applied by the same engine either way: the
# streamed run checks the chunks add up to valid JSON, which a third of the suite shows as well as all of it).
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_schema_of_the_suite_gives_valid_json(client, stream):
    cases = CASES[::3] if stream else CASES
    with ThreadPoolExecutor(16) as pool:  # all at once: one batch, as an agent fleet would send them
        texts = list(pool.map(lambda case: _ask(client, case, stream), cases))
    failures = {case["name"]: why for case, text in zip(cases, texts) if (why := violation(text, case["schema"]))}
    assert not failures, failures


def test_json_object(client):
    case = next(c for c in CASES if c["name"] == "nested_order")
    r = client.chat.completions.create(model=DEFAULT_NAME, messages=chat_prompt(case), temperature=0,
                                       max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
    assert violation(r.choices[0].message.content, {"type": "object"}) is None


class City(BaseModel):
    name: str
    country: str
    population: int


def test_openai_parse_helper_returns_the_pydantic_object(client):
    done = client.chat.completions.parse(
        model=DEFAULT_NAME, temperature=0, max_tokens=MAX_TOKENS, response_format=City,
        messages=[{"role": "user", "content": "Describe the city of Paris as JSON."}])
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_completions_take_response_format_and_vllm_fields(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    base = dict(model=DEFAULT_NAME, prompt="What is 2 + 2? Answer in JSON:", temperature=0, max_tokens=40)
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
                  {"structured_outputs": {"json": schema}}, {"guided_json": schema}):
        text = client.completions.create(**base, extra_body=extra).choices[0].text
        assert violation(text, schema) is None, extra
    text = client.completions.create(**base, extra_body={"guided_choice": ["four", "five"]}).choices[0].text
    assert text in ("four", "five")
    text = client.completions.create(**base, extra_body={"guided_regex": r"[0-9]{2}-[a-z]{3}"}).choices[0].text
    assert len(text) == 6 and text[:2].isdigit() and text[2] == "-" and text[3:].isalpha()


def test_ollama_format_json_and_schema(agent_server):
    c = ollama.Client(host=agent_server.base_url)
    schema = City.model_json_schema()
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    messages = [{"role": "user", "content": "Describe Rome as JSON."}]
    for fmt in ("json", schema):
        text = c.chat(model=DEFAULT_NAME, messages=messages, format=fmt, options=options).message.content
        assert violation(text, schema if fmt != "json" else {"type": "object"}) is None
        streamed = "".join(p.message.content for p in c.chat(model=DEFAULT_NAME, messages=messages, format=fmt,
                                                               options=options, stream=True))
        assert violation(streamed, schema if fmt != "json" else {"type": "object"}) is None
    text = c.generate(model=DEFAULT_NAME, prompt="Three colours as a JSON list:", options=options,
                      format={"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}).response
    assert violation(text, {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}) is None


@pytest.mark.parametrize("path, body, param, message, code", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "invalid JSON schema: Invalid type", "invalid_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "ipv9"}}}},
     "response_format", "Unknown format", "invalid_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}},
     "response_format", "does not exist", "invalid_schema"),
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex", "invalid regex", "invalid_schema"),
    ("/v1/completions", {"guided_json": {}, "guided_regex": "a"}, "guided_regex", "give one output constraint", None),
    ("/v1/completions", {"guided_grammar": "start: missing"}, "guided_grammar", "invalid grammar", "invalid_schema"),
])
def test_bad_constraints_are_400s_naming_the_field(agent_server, path, body, param, message, code):
    base = {"max_tokens": 4, **({"prompt": "hi"} if path == "/v1/completions" else
                                {"messages": [{"role": "user", "content": "hi"}]})}
    assert_error(post(agent_server, path, {**base, **body}), 400, param, code, message)
    assert_still_serves(agent_server)


def test_ollama_bad_format_is_400(agent_server):
    r = httpx.post(f"{agent_server.base_url}/api/chat", json={
        "model": DEFAULT_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "format": {"type": "objekt"}}, timeout=60)
    assert r.status_code == 400 and "Invalid type" in r.json()["error"]
