"""One chat turn as the agent APIs ask for it, whatever the endpoint (chat completions, Anthropic messages,
responses): OpenAI-shaped messages and tools in; the prompt through the checkpoint's chat template (tools rendered
by it, or by the family's tool prompt where the template has none), the grammar that `tool_choice` or
`response_format` asks for, and a parser of the output into reasoning, content and tool calls.

    turn = prepare(tokenizer, vocab_size, messages, tools=..., tool_choice=..., response_format=...)  # blocking
    params = SamplingParams(..., logits_processors=turn.processors())   # a fresh grammar state per choice
    stream = turn.stream(); events = stream.feed(text_delta) ...; events, parsed = stream.finish()
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from hybrid.errors import CheckpointError
from hybrid.serve.grammar import Constraint, Grammars
from hybrid.serve.parsers import Family, OutputParser, family_of, opens_reasoning

_GRAMMARS: "weakref.WeakKeyDictionary[Any, Grammars]" = weakref.WeakKeyDictionary()


class TurnError(ValueError):
    """A request the turn cannot be built from: the message says why, `param` names the field."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Turn:
    prompt: list[int]
    prompt_text: str
    family: Optional[Family]
    parse_tools: bool  # the output's tool-call markers become tool calls
    reasoning: bool  # the prompt leaves the model inside its reasoning
    grammar: Optional[str] = None
    grammars: Optional[Grammars] = None

    def processors(self) -> tuple[Constraint, ...]:
        return (self.grammars.constraint(self.grammar),) if self.grammar is not None else ()

    def stream(self, separate_reasoning: bool = True) -> OutputParser:
        return OutputParser(self.family.calls if self.parse_tools else None, self.reasoning, separate_reasoning)


def grammars_for(tokenizer, vocab_size: int) -> Grammars:
    g = _GRAMMARS.get(tokenizer)
    if g is None or g.vocab_size != vocab_size:
        g = _GRAMMARS[tokenizer] = Grammars(tokenizer, vocab_size)
    return g


def prepare(tokenizer, vocab_size: int, messages: list[dict], tools: Optional[list[dict]] = None,
            tool_choice: Any = None, parallel_tool_calls: Optional[bool] = None,
            response_format: Optional[dict] = None, template_kwargs: Optional[dict] = None,
            continue_final: bool = False) -> Turn:
    """continue_final: the prompt ends inside the last message (an assistant's), which the model goes on with."""
    tools = _check_tools(tools)
    choice = _check_choice(tool_choice, tools)
    family = family_of(tokenizer)
    if tools and choice != "none" and family is None:
        raise TurnError("this model's chat template has no tool-call format: send the request without tools",
                        "tools")
    shown = tools if choice != "none" else None
    chat = [_message(m, i) for i, m in enumerate(messages)]
    if shown and not family.renders_tools:
        chat = _with_system(chat, family.tool_prompt(shown))
    kwargs = dict(template_kwargs or {})
    for reserved in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "continue_final"):
        if reserved in kwargs:
            raise TurnError(f"chat_template_kwargs.{reserved} is set by the server", "chat_template_kwargs")
    if continue_final and (chat[-1]["role"] != "assistant" or not chat[-1]["content"]):
        raise TurnError("continue_final_message needs a last message from the assistant with text to continue",
                        "continue_final_message")
    try:
        text = tokenizer.render_chat(chat, shown, continue_final, **kwargs)
    except CheckpointError as e:
        raise TurnError(f"{e}: use /v1/completions with this model", "messages", "no_chat_template")
    except Exception as e:  # the template's own checks (raise_exception) or its errors on these messages
        raise TurnError(f"the chat template failed on these messages: {type(e).__name__}: {e}", "messages")
    prompt = tokenizer.encode(text, add_bos=False)
    turn = Turn(prompt, text, family, bool(shown), opens_reasoning(text))
    schema = _response_schema(response_format)
    if choice in ("required",) or isinstance(choice, dict):
        wanted = shown if choice == "required" else [t for t in shown if t["function"]["name"] == choice["name"]]
        turn.grammars = grammars_for(tokenizer, vocab_size)
        turn.grammar = turn.grammars.tool_calls(family, wanted, parallel_tool_calls is not False and choice ==
                                                "required", turn.reasoning)
    elif schema is not None:
        turn.grammars = grammars_for(tokenizer, vocab_size)
        turn.grammar = turn.grammars.json_schema(schema, turn.reasoning)
    if turn.grammar is not None:
        turn.processors()  # compiles here (off the event loop): a schema it cannot enforce is the client's 400
    return turn


# -- checks and conversions -------------------------------------------------------------------------------------
def _check_tools(tools: Optional[list]) -> list[dict]:
    out = []
    for i, t in enumerate(tools or ()):
        t = dict(t)
        f = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(f, dict):
            raise TurnError(f"tools[{i}]: only function tools are served ({{\"type\": \"function\", \"function\": "
                            f"{{\"name\", \"parameters\"}}}})", f"tools[{i}]")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise TurnError(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise TurnError(f"tools[{i}].function.parameters must be a JSON schema object",
                            f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {k: v for k, v in f.items() if v is not None}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise TurnError("tools: two functions have the same name", "tools")
    return out


def _check_choice(choice: Any, tools: list[dict]):
    """"none" | "auto" | "required" | {"name": NAME}."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise TurnError(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")
        if choice == "required" and not tools:
            raise TurnError("tool_choice is required but no tools were given", "tool_choice")
        return choice
    choice = dict(choice)
    name = (choice.get("function") or {}).get("name") if "function" in choice else choice.get("name")
    if not isinstance(name, str):
        raise TurnError("tool_choice: give a function as {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice")
    if name not in [t["function"]["name"] for t in tools]:
        raise TurnError(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    return {"name": name}


def _response_schema(fmt: Optional[dict]) -> Optional[dict]:
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None and isinstance(spec, dict):
            return {"type": "object"}
        if not isinstance(schema, dict):
            raise TurnError("response_format.json_schema.schema must be a JSON schema object",
                            "response_format.json_schema.schema")
        return schema
    raise TurnError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                    "response_format.type")


def _text(content: Any) -> Optional[str]:
    if content is None or isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", None))


def _message(m: dict, i: int) -> dict:
    """One OpenAI message as the templates read it: text content, developer as system, tool calls' arguments as
    JSON text."""
    role = {"developer": "system", "function": "tool"}.get(m.get("role"), m.get("role"))
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
    if role != "assistant":
        out["content"] = out["content"] or ""
    for key in ("name", "tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            out[key] = m[key]
    if role == "tool" and "tool_call_id" not in out and m.get("name"):
        out["tool_call_id"] = m["name"]
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            f = dict(c.get("function") or {})
            args = f.get("arguments", "{}")
            calls.append({"id": c.get("id"), "type": "function",
                          "function": {"name": f.get("name", ""),
                                       "arguments": args if isinstance(args, str) else json.dumps(args)}})
        out["tool_calls"] = calls
    return out


def _with_system(chat: list[dict], text: str) -> list[dict]:
    if chat and chat[0]["role"] == "system":
        return [{**chat[0], "content": f"{chat[0]['content']}\n\n{text}"}] + chat[1:]
    return [{"role": "system", "content": text}] + chat


# -- the OpenAI chat shape of the output --------------------------------------------------------------------------
def chat_delta(event) -> dict:
    """A streamed chunk's `delta` for one parser event."""
    from hybrid.serve.parsers import CallArgs, CallStart, Text

    if isinstance(event, Text):
        return {"content": event.text} if event.kind == "content" else {"reasoning_content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    assert isinstance(event, CallArgs)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def chat_message(parsed) -> dict:
    """The assistant message of a whole output: content (None beside tool calls when empty), reasoning_content
    where the model reasoned, tool_calls where it called."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.calls
                           else None}
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in parsed.calls]
    return msg


def finish_reason(parsed, engine_reason: str) -> str:
    """"tool_calls" when the model called and stopped by itself, else the engine's reason."""
    return "tool_calls" if parsed.calls and engine_reason == "stop" else engine_reason
