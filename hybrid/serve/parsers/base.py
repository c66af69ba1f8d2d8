"""What the model's text holds besides the answer: reasoning (`<think>…</think>`) and tool calls in a family's own
markers. `OutputParser` splits the text as it streams into events, holding back only the tail that may still
become a marker; the same parser, fed the whole text at once, gives the non-streamed message.

Events: `Text(kind, text)` with kind "content" or "reasoning"; `CallStart(index, id, name)` once a call's name is
known; `CallArgs(index, text)` as its JSON arguments arrive."""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class Text:
    kind: str  # "content" | "reasoning"
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


Event = Union[Text, CallStart, CallArgs]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True)
class CallSyntax:
    """A family's tool-call markers: `section_begin` (call_begin header args call_end)+ `section_end`, where the
    header (`header_re`, matched at the call's start, group `name`, optional group `id`) ends where the arguments
    begin; `args_suffix` is stripped from the arguments' end (a code fence)."""
    name: str
    section_begin: str
    section_end: str
    call_begin: str
    call_end: str
    header_re: re.Pattern
    args_suffix: str = ""

    def new_id(self, name: str, index: int, given: Optional[str]) -> str:
        return given or f"call_{uuid.uuid4().hex[:24]}"


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers` (to hold back while streaming)."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
