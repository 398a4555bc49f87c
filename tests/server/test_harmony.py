"""gpt-oss's harmony answers: the parser on answers written the way gpt-oss writes them (thinking, final
content, tool calls with the recipient before or after the channel, a preamble, a tag cut in two), whole
and streamed in every chunking; and a harmony template (modelled on gpt-oss's) through kvflow's chat
preparation on a small tokenizer that has harmony's tags as special tokens: the prompt, tools and tool
results in it, the tokens that end the answer, the text the detokenizer makes, and the grammars that
tool_choice and response_format impose."""

from __future__ import annotations

import json
import random

import pytest

from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.sampling_params import SamplingParams
from kvflow.server.answer_parser import answer_pieces
from kvflow.server.chat_pipeline import ChoiceDelta, prepare_chat
from kvflow.server.chat_tools import template_knows_tools
from kvflow.server.harmony import HARMONY, HarmonyParser, is_harmony
from kvflow.server.openai_api import ChoiceChunks
from kvflow.server.protocol import ChatCompletionRequest

PROMPT = "<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>assistant"
ARGS = '{"location": "Paris"}'

# (the model's text, expected reasoning, expected content, expected [(name, arguments)])
ANSWERS = [
    ("<|channel|>analysis<|message|>We need to answer: the capital of France.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>The capital is Paris.<|return|>",
     "We need to answer: the capital of France.", "The capital is Paris.", []),
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>", "Need weather.", "",
     [("get_weather", ARGS)]),
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
     f"<|channel|>commentary json<|message|>{ARGS}<|call|>", "Need weather.", "", [("get_weather", ARGS)]),
    (f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>", "", "",
     [("get_weather", ARGS)]),
    # a preamble: commentary with no recipient is shown to the user
    ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Checking the forecast.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
     f"<|constrain|>json<|message|>{ARGS}<|call|>", "Look it up.", "Checking the forecast.", [("get_weather", ARGS)]),
    # several analysis messages: one thinking, a line apart
    ("<|channel|>analysis<|message|>First, a < b.<|end|><|start|>assistant<|channel|>analysis<|message|>"
     "Then | is a pipe.<|end|><|start|>assistant<|channel|>final<|message|>Done: <|x|> is literal text.<|return|>",
     "First, a < b.\nThen | is a pipe.", "Done: <|x|> is literal text.", []),
    # gpt-oss at times drops <|channel|> before a tool call's channel name
    (f"commentary to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{ARGS}<|call|>", "", "",
     [("get_weather", ARGS)]),
    # a message missing its <|end|> still ends where the next one starts
    ("<|channel|>analysis<|message|>Quick.<|start|>assistant<|channel|>final<|message|>Yes.<|return|>",
     "Quick.", "Yes.", []),
    # arguments whole but the call cut before <|call|> (a grammar ends generation there): still a call
    (f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}", "", "",
     [("get_weather", ARGS)]),
    # a header's tag in a body (a malformed answer) is not shown
    ("<|channel|>final<|message|>Hi<|constrain|> there.<|return|>", "", "Hi there.", []),
    # not harmony at all: plain content
    ("The capital is Paris.", "", "The capital is Paris.", []),
    # thinking cut short by the token budget stays thinking
    ("<|channel|>analysis<|message|>The user wants", "The user wants", "", []),
    # the budget ends the answer after a '<' that could have begun a tag: it was text after all
    ("<|channel|>final<|message|>Paris <|en", "", "Paris <|en", []),
    # a header cut short is dropped
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>fin", "Hmm.", "", []),
]


def _run(parser: HarmonyParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning, content, calls = "", "", []
    for piece in [*pieces, None]:
        out = parser.feed(piece) if piece is not None else parser.finish()
        reasoning, content, calls = reasoning + out.reasoning, content + out.content, calls + out.calls
    return reasoning, content, [(c.name, c.arguments) for c in calls]


def _chunkings(text: str, trials: int = 30):
    yield [text]
    yield list(text)  # character by character
    rng = random.Random(text)
    for _ in range(trials):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("text, reasoning, content, calls", ANSWERS)
def test_whole_and_in_every_chunking(text, reasoning, content, calls):
    for pieces in _chunkings(text):
        assert _run(HarmonyParser(PROMPT), pieces) == (reasoning, content, calls), pieces


def test_streaming_holds_back_only_a_possible_tag():
    parser = HarmonyParser(PROMPT)
    assert parser.feed("<|channel|>final").content == ""  # a header is held whole
    assert parser.feed("<|message|>Paris is nice <|e").content == "Paris is nice "
    assert parser.feed("nd|>").content == ""
    out = parser.feed("<|start|>assistant<|channel|>final<|message|> and <b>big</b>.<|ret")
    assert out.content == "\n and <b>big</b>."
    assert parser.feed("urn|>").content == "" and parser.finish().content == ""


def test_the_parser_starts_where_the_prompt_leaves_off():
    # continue_final_message: the prompt ends inside the final message, whose text the client has
    parser = HarmonyParser(PROMPT + "<|channel|>final<|message|>The capital")
    assert _run(parser, [" is Paris.<|return|>"]) == ("", " is Paris.", [])
    # a prompt with no harmony in it: the answer's text is all content
    assert _run(HarmonyParser("hello"), ["Hi there."]) == ("", "Hi there.", [])


def test_call_ids_differ():
    text = "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{}<|call|>"
    ids = {HarmonyParser(PROMPT).whole(text).calls[0].id for _ in range(3)}
    assert len(ids) == 3 and all(i.startswith("call_") for i in ids)


def test_streamed_chat_completion_chunks():
    """The chunks /v1/chat/completions streams for a harmony answer, token by token: reasoning_content,
    then the call (its name, then its arguments), and finish_reason tool_calls."""
    parser, chunks = HarmonyParser(PROMPT), ChoiceChunks()

    def step(text: str, finish: str | None) -> list:
        pieces = answer_pieces(parser, text, finish is not None)
        return chunks.deltas(ChoiceDelta(0, pieces, text, [], [], finish))

    text = ANSWERS[1][0]
    deltas = [d for i, ch in enumerate(text) for d in step(ch, "stop" if i == len(text) - 1 else None)]
    reasoning = "".join(d.get("reasoning_content", "") for d, _ in deltas)
    calls = [d["tool_calls"][0] for d, _ in deltas if "tool_calls" in d]
    assert reasoning == "Need weather." and not any("content" in d for d, _ in deltas)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[1]["function"]["arguments"] == ARGS
    assert deltas[-1] == ({}, "tool_calls")


# ---- a harmony template through kvflow's chat preparation ---------------------------------------------
TAGS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
        "<|call|>"]
# Modelled on gpt-oss's: the first system message is the developer's, tools are described in the developer
# message, a call renders as `to=functions.NAME` with its thinking before it, and a tool result is named
# after the call before it.
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% if messages[0].role == 'system' %}{% set dev = messages[0].content %}{% set rest = messages[1:] %}"
    "{% else %}{% set dev = '' %}{% set rest = messages %}{% endif %}"
    "{% if dev or tools %}<|start|>developer<|message|>{{ dev }}{% if tools %}# Tools\n"
    "{% for t in tools %}type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n"
    "{% endfor %}{% endif %}<|end|>{% endif %}"
    "{% set last = namespace(name=none) %}"
    "{% for m in rest %}"
    "{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and 'tool_calls' in m %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{% set call = m.tool_calls[0].function %}{% set last.name = call.name %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained in-process, with harmony's tags as special tokens (one id each, as in
    gpt-oss's vocabulary) and <|return|> as its EOS, as gpt-oss's tokenizer has it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=TAGS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["assistant analysis final commentary to=functions.get_weather json", "The capital is Paris.",
              '{"location": "Paris"} We need the weather.'] * 20
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", chat_template=TEMPLATE)


def _chat(tokenizer, **body):
    return prepare_chat(tokenizer, ChatCompletionRequest.model_validate(body))


def test_harmony_templates_are_recognised():
    assert is_harmony(TEMPLATE) and template_knows_tools(TEMPLATE)
    assert not is_harmony("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    assert template_knows_tools("{{ '<|start|>' }}{{ '<|channel|>' }}{{ '<|message|>' }}")  # even one naming no tools


def test_prompt_parser_and_end_tokens(tokenizer):
    chat = _chat(tokenizer, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                 reasoning_effort="high")
    assert chat.prompt == ("<|start|>system<|message|>Reasoning: high<|end|><|start|>developer<|message|>Be brief."
                           "<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert chat.reasoning == HARMONY and chat.tool_format is None and chat.constraint is None
    assert isinstance(chat.answer_parser(), HarmonyParser)
    params = chat.sampling(SamplingParams(stop_token_ids=[99]))
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>", "<|endoftext|>"])
    assert params.skip_special_tokens is False and params.stop_token_ids == [99, *ends]
    assert chat.sampling(SamplingParams(ignore_eos=True)).stop_token_ids == []  # ignore_eos: nothing ends it


def test_the_detokenized_answer_keeps_the_tags(tokenizer):
    """Token by token through the engine's detokenizer with the chat's params, then the parser."""
    chat = _chat(tokenizer, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    text = ANSWERS[2][0]
    ids = tokenizer.encode(text)
    assert tokenizer.convert_tokens_to_ids("<|channel|>") in ids  # each tag is one token
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(chat.prompt), chat.sampling(SamplingParams()))
    pieces = [detok.add([i]).text_delta for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert _run(chat.answer_parser(), pieces) == ("Need weather.", "", [("get_weather", ARGS)])


def test_tools_and_their_results_round_trip(tokenizer):
    chat = _chat(tokenizer, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need weather.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert chat.tool_format == HARMONY
    assert 'type get_weather = (_: {"type": "object", "properties": {"location": {"type": "string"}}' in chat.prompt
    assert chat.prompt.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|>"
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant")


def test_parallel_calls_in_the_history_render_one_each(tokenizer):
    """The template renders one call per assistant message and names a result after the call before it:
    several calls of one turn come apart, each with its own result (paired by id, whatever their order)."""
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    chat = _chat(tokenizer, tools=[WEATHER, TIME], messages=[
        {"role": "user", "content": "Weather and time?"}, {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "noon"}, {"role": "tool", "tool_call_id": "a", "content": "sunny"}])
    assert chat.prompt.endswith(
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>'
        "<|start|>assistant")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from kvflow.structured.compiler import GrammarCompiler

    return GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def _accepts(compiler, spec, text: str) -> bool:
    matcher = compiler.matcher(spec)
    return all(matcher.consume_token(t) for t in compiler._hf_tokenizer.encode(text)) and matcher.is_accepting()


def test_a_required_call_comes_after_free_analysis(tokenizer, compiler):
    chat = _chat(tokenizer, tools=[WEATHER, TIME], tool_choice="required", messages=[{"role": "user", "content": "?"}])
    assert chat.constraint_field == "tools"
    call = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
    assert _accepts(compiler, chat.constraint, call)
    assert _accepts(compiler, chat.constraint, "<|channel|>analysis<|message|>Think {\"a\"<|end|><|start|>assistant" + call)
    assert not _accepts(compiler, chat.constraint, call.replace('"Paris"', "1"))  # arguments held to the schema
    assert not _accepts(compiler, chat.constraint, "<|channel|>final<|message|>It is sunny.")
    named = _chat(tokenizer, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                  messages=[{"role": "user", "content": "?"}])
    assert not _accepts(compiler, named.constraint, call)
    assert _accepts(compiler, named.constraint, "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}")


def test_response_format_applies_to_the_final_message(tokenizer, compiler):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    chat = _chat(tokenizer, messages=[{"role": "user", "content": "2 + 2?"}],
                 response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    answer = '<|channel|>analysis<|message|>2 + 2 is "4".<|end|><|start|>assistant<|channel|>final<|message|>{"answer": 4}'
    assert _accepts(compiler, chat.constraint, answer)
    assert not _accepts(compiler, chat.constraint, answer.replace("4}", '"4"}'))
    assert not _accepts(compiler, chat.constraint, '{"answer": 4}')  # not outside a message
    assert _run(chat.answer_parser(), [answer]) == ('2 + 2 is "4".', '{"answer": 4}', [])


# ---- through the server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harmony_server(tiny_model_dir, tmp_path_factory):
    """The tiny random model with a harmony template whose prompt opens an analysis message: all it writes
    is thinking (its vocabulary has no harmony tags, so it never closes the message)."""
    import shutil

    from server.server_process import ServerProcess

    folder = tmp_path_factory.mktemp("harmony") / "tiny-harmony"
    shutil.copytree(tiny_model_dir, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE.replace("<|start|>assistant{% endif %}",
                                               "<|start|>assistant<|channel|>analysis<|message|>{% endif %}")
    config_file.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    server = ServerProcess("--model", str(folder), "--kv-cache-memory", "64MiB", "--dtype", "float32")
    yield server
    server.stop()


def test_the_apis_carry_the_analysis_as_thinking(harmony_server):
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=f"{harmony_server.base_url}/v1", api_key="unused", max_retries=0)
    options = {"model": "tiny-harmony", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
               "temperature": 0, "tools": [WEATHER], "extra_body": {"ignore_eos": True}}
    message = client.chat.completions.create(**options).choices[0].message
    assert message.content == "" and message.reasoning_content and not message.tool_calls
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**options, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)
    r = httpx.post(f"{harmony_server.base_url}/api/chat", timeout=60, json={
        "model": "tiny-harmony", "messages": options["messages"], "stream": False, "think": "low",
        "options": {"temperature": 0, "num_predict": 12}})
    assert r.json()["message"]["thinking"] and r.json()["message"]["content"] == ""
