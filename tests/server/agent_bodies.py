"""Request bodies shaped like what the coding agents send (recorded through a logging proxy on 2026-12-06:
Codex CLI 0.171.0 on the Responses API, Claude Code 2.1.197 on Anthropic's Messages API, Qwen Code 0.15.10
and OpenClaw 2026.9.6 on chat completions), cut down to a few hundred tokens and a small token budget. Each
function returns a fresh copy, with the model name filled in."""

from __future__ import annotations

# Codex's apply_patch grammar (a custom tool with a Lark grammar).
APPLY_PATCH_LARK = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''

def _shell_params() -> dict:
    return {"type": "object", "properties": {"command": {"type": "string"}, "workdir": {"type": "string"},
                                             "timeout_ms": {"type": "number"}},
            "required": ["command"], "additionalProperties": False}


def codex(model: str) -> dict:
    """A Codex turn after a tool round trip: developer and user messages, its reasoning item, a shell call
    and its output, a namespaced MCP call, an apply_patch custom call; its tools include a namespace, a
    custom tool with a Lark grammar and the hosted web_search."""
    return {
        "model": model, "instructions": "You are Codex, a coding agent. Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context><cwd>/repo</cwd></environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": None},
            {"type": "function_call", "id": "fc_1", "name": "shell_command", "call_id": "call_1",
             "arguments": "{\"command\": \"ls\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"},
            {"type": "function_call", "name": "search", "namespace": "mcp__docs__", "call_id": "call_2",
             "arguments": "{\"query\": \"ls\"}"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "ls lists files"}]},
            {"type": "custom_tool_call", "call_id": "call_3", "name": "apply_patch",
             "input": "*** Begin Patch\n*** Add File: c.txt\n+hi\n*** End Patch\n"},
            {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Done!"},
            {"type": "item_reference", "id": "msg_0"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. Summarize."}]},
        ],
        "tools": [
            {"type": "function", "name": "shell_command", "description": "Runs a shell command.", "strict": False,
             "parameters": _shell_params()},
            {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
             "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}},
            {"type": "namespace", "name": "mcp__docs__", "description": "Tools of the docs MCP server.", "tools": [
                {"type": "function", "name": "search", "description": "Search the docs.", "strict": False,
                 "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                "required": ["query"]}}]},
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "text": {"verbosity": "medium"},
        "client_metadata": {"thread_id": "0199a1b2"}, "max_output_tokens": 2,
    }


def claude_code(model: str) -> dict:
    """A Claude Code turn after a tool round trip: its system blocks with cache_control, a system-role
    message inside messages, a tool_use and its tool_result (list content), and the fields it always sends."""
    return {
        "model": model, "max_tokens": 2, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "You are an interactive CLI tool. Be concise.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Today is 2026-12-06.</system-reminder>"},
                {"type": "text", "text": "List the files here.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "The working directory is /repo."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should run ls.", "signature": "sig"},
                {"type": "text", "text": "Running ls."},
                {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01",
                 "content": [{"type": "text", "text": "a.txt\nb.txt"}], "is_error": False},
                {"type": "text", "text": "Summarize.", "cache_control": {"type": "ephemeral"}}]},
        ],
        "tools": [
            {"name": "Bash", "description": "Executes a bash command.", "input_schema": {
                "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                "required": ["command"], "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#"}},
            {"name": "Read", "description": "Reads a file.", "cache_control": {"type": "ephemeral"},
             "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                              "required": ["file_path"]}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "metadata": {"user_id": "user_0123_account__session_4567"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }


def _read_file() -> dict:
    return {"type": "function", "function": {
        "name": "read_file", "description": "Reads a file.",
        "parameters": {"type": "object", "properties": {"absolute_path": {"type": "string"}},
                       "required": ["absolute_path"], "$schema": "http://json-schema.org/draft-07/schema#"}}}


def qwen_code(model: str) -> dict:
    """Qwen Code's streamed chat completion, after a tool round trip."""
    return {
        "model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 2,
        "temperature": 0.7, "top_p": 0.8, "metadata": {"sessionId": "s-1", "promptId": "p-1"},
        "messages": [
            {"role": "system", "content": "You are Qwen Code, an interactive CLI agent."},
            {"role": "user", "content": [{"type": "text", "text": "Read /repo/a.txt",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "read_file", "arguments": "{\"absolute_path\": \"/repo/a.txt\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
        ],
        "tools": [_read_file()],
    }


def openclaw(model: str) -> dict:
    """OpenClaw's streamed chat completion."""
    return {
        "model": model, "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 2,
        "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
        "messages": [{"role": "system", "content": "You are a personal assistant running inside OpenClaw."},
                     {"role": "user", "content": "What is in /repo/a.txt?"}],
        "tools": [_read_file()],
    }


def ollama_chat(model: str) -> dict:
    """A chat on Ollama's API, as agents that speak it send one."""
    return {
        "model": model, "stream": True, "keep_alive": "5m", "think": False,
        "options": {"num_predict": 2, "num_ctx": 32768, "temperature": 0.7},
        "messages": [{"role": "system", "content": "You are a coding agent."},
                     {"role": "user", "content": "List the files."},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"function": {"name": "read_file", "arguments": {"absolute_path": "/repo"}}}]},
                     {"role": "tool", "content": "a.txt", "tool_name": "read_file"}],
        "tools": [_read_file()],
    }


# route -> body builder
AGENT_BODIES = {
    "/v1/responses": codex, "/v1/messages": claude_code, "/v1/chat/completions": qwen_code,
    "/v1/chat/completions#openclaw": openclaw, "/api/chat": ollama_chat,
}
