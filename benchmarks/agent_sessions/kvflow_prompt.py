"""A captured body in kvflow's chat form: what its /v1/messages or /v1/responses prefills for it, as the
/tokenize chat form (messages, tools, chat_template_kwargs). kvflow offers no HTTP way to tokenize a Messages
or Responses body, so this is the one place the benchmarks import the server's own translation of them
(MessagesRequest.as_chat, ResponsesRequest.as_chat); when those move or are renamed, only this changes.
"""

from __future__ import annotations


def chat_form(body: dict, api: str) -> dict:
    """The /tokenize chat form of a body on `api` ("chat", "messages" or "responses"): the messages and tools
    kvflow's endpoint for that API hands its chat prompt renderer."""
    if api == "chat":
        return {"messages": body["messages"], "tools": body.get("tools")}
    if api == "messages":
        from kvflow.server.anthropic_protocol import MessagesRequest

        chat = MessagesRequest.model_validate(body).as_chat()
    elif api == "responses":
        from kvflow.server.responses_protocol import ResponsesRequest

        chat, _ = ResponsesRequest.model_validate(body).as_chat()
    else:
        raise ValueError(f"unknown API {api!r}")
    dumped = chat.model_dump(mode="json", exclude_none=True, by_alias=True)
    return {"messages": dumped["messages"], "tools": dumped.get("tools"),
            "chat_template_kwargs": chat.template_kwargs() or None}
