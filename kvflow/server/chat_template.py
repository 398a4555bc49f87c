"""Render a conversation with the model's chat template, as the text the model continues."""

from __future__ import annotations

from kvflow.server.errors import bad_request


def render_chat(tokenizer, messages: list[dict], param: str = "messages") -> str:
    """The prompt text for messages, ending with the assistant's turn; a 400 when the template refuses them."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template, so it cannot chat; use the completions API",
                          param, "no_chat_template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2 raises TemplateError (or anything a template's raise_exception throws)
        raise bad_request(f"the chat template could not render these messages: {exc}", param) from None
