"""The streaming parser of a model's output: reasoning first (when the prompt opened it, or the output opens it
with <think>), then content, then the tool-call section (when tools were given)."""
from __future__ import annotations

from typing import Optional

from hybrid.serve.parsers.base import (END_THINK, THINK, CallArgs, CallStart, CallSyntax, Event, Parsed, Text,
                                       ToolCall, held_tail)


class OutputParser:
    def __init__(self, calls: Optional[CallSyntax], reasoning: bool, separate: bool = True):
        """calls: the family's syntax, None to leave tool markers in the content; reasoning: the text starts
        inside the reasoning (the prompt ends with <think>); separate false: the reasoning stays in the content,
        markers and all."""
        self.syntax = calls
        self.buf = ""  # text not yet turned into events
        self.state = ("reasoning" if reasoning else "start") if separate else "content"
        self.calls: list[ToolCall] = []
        self.args = ""  # the current call's arguments not yet handed out (their end may be a fence to strip)
        self.parsed = Parsed()

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while True:
            step = getattr(self, f"_{self.state}")(events, final=False)
            if not step:
                break
        self._record(events)
        return events

    def finish(self) -> tuple[list[Event], Parsed]:
        """The events of what was held back, and the whole output parsed."""
        events: list[Event] = []
        while getattr(self, f"_{self.state}")(events, final=True):
            pass
        self._record(events)
        return events, self.parsed

    # -- states: each consumes from buf, appends events, returns whether to go on ------------------------------
    def _start(self, events, final) -> bool:
        stripped = self.buf.lstrip()
        if stripped.startswith(THINK):
            self.buf = stripped[len(THINK):]
            self.state = "reasoning"
            return True
        if not final and THINK.startswith(stripped):
            return False  # may still open with <think>
        self.state = "content"
        return True

    def _reasoning(self, events, final) -> bool:
        ends = (END_THINK,) + ((self.syntax.section_begin,) if self.syntax else ())
        at, marker = min(((self.buf.find(m), m) for m in ends if m in self.buf), default=(-1, ""))
        if at < 0:
            keep = 0 if final else held_tail(self.buf, ends)
            self._emit(events, "reasoning", self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            if final:
                self.state = "done"
            return False
        self._emit(events, "reasoning", self.buf[:at])
        self.buf = self.buf[at + (len(marker) if marker == END_THINK else 0):]
        self.state = "content"
        return True

    def _content(self, events, final) -> bool:
        if self.syntax is None:
            self._emit(events, "content", self.buf)
            self.buf = ""
            return False
        begins = (self.syntax.section_begin, self.syntax.call_begin)
        at, marker = min(((self.buf.find(m), m) for m in begins if m in self.buf), default=(-1, ""))
        if at < 0:
            keep = 0 if final else held_tail(self.buf, begins)
            self._emit(events, "content", self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._emit(events, "content", self.buf[:at])
        self.buf = self.buf[at + (len(marker) if marker == self.syntax.section_begin else 0):]
        self.state = "section"
        return True

    def _section(self, events, final) -> bool:
        s = self.syntax
        self.buf = self.buf.lstrip()
        if self.buf.startswith(s.call_begin):
            self.buf = self.buf[len(s.call_begin):]
            self.state = "header"
            return True
        if self.buf.startswith(s.section_end):
            self.buf = self.buf[len(s.section_end):]
            self.state = "after"
            return True
        if final or (self.buf and not any(m.startswith(self.buf) for m in (s.call_begin, s.section_end))):
            self.state = "after"  # text that is no call: kept as content
            return True
        return False

    def _header(self, events, final) -> bool:
        m = self.syntax.header_re.match(self.buf)
        if m is None:
            if final:
                self.state = "done"
            return False
        index = len(self.calls)
        name = m.group("name").strip()
        given = m.groupdict().get("id")
        call = ToolCall(self.syntax.new_id(name, index, given), name)
        self.calls.append(call)
        events.append(CallStart(index, call.id, name))
        self.buf = self.buf[m.end():]
        self.state = "args"
        return True

    def _args(self, events, final) -> bool:
        s = self.syntax
        at = self.buf.find(s.call_end)
        done = at >= 0 or final
        cut = at if at >= 0 else len(self.buf) - (0 if final else held_tail(self.buf, (s.call_end,)))
        text = self.buf[:cut]
        self.buf = self.buf[at + len(s.call_end):] if at >= 0 else self.buf[cut:]
        self.args += text
        if done:
            out = self.args.rstrip()
            if s.args_suffix and out.endswith(s.args_suffix):
                out = out[:-len(s.args_suffix)].rstrip()
            self._args_event(events, out)
            self.args = ""
            self.state = "section" if at >= 0 else "done"
            return at >= 0
        body = self.args.rstrip()  # trailing space, and what may be the start of the closing fence, wait
        k = next((k for k in range(min(len(body), len(s.args_suffix)), 0, -1) if s.args_suffix.startswith(body[-k:])),
                 0)
        sent = len(body[:len(body) - k].rstrip())
        self._args_event(events, self.args[:sent])
        self.args = self.args[sent:]
        return False

    def _after(self, events, final) -> bool:
        self._emit(events, "content", self.buf)
        self.buf = ""
        return False

    def _done(self, events, final) -> bool:
        return False

    # -- helpers --------------------------------------------------------------------------------------------------
    def _emit(self, events: list[Event], kind: str, text: str) -> None:
        if text:
            events.append(Text(kind, text))

    def _args_event(self, events: list[Event], text: str) -> None:
        if text:
            events.append(CallArgs(len(self.calls) - 1, text))

    def _record(self, events: list[Event]) -> None:
        p = self.parsed
        for e in events:
            if isinstance(e, Text):
                if e.kind == "content":
                    p.content += e.text
                else:
                    p.reasoning += e.text
            elif isinstance(e, CallArgs):
                self.calls[e.index].arguments += e.text
        p.calls = self.calls
