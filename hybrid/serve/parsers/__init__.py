"""Tool calls and reasoning in each model family's own format (one file per family), found from the checkpoint's
tokenizer: `family_of(tokenizer)`; `OutputParser(family.calls, reasoning)` splits a response as it streams."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Optional

from hybrid.serve.parsers import deepseek, kimi
from hybrid.serve.parsers.base import (END_THINK, THINK, CallArgs, CallStart, CallSyntax, Event, Parsed, Text,
                                       ToolCall)
from hybrid.serve.parsers.output import OutputParser

__all__ = ["Family", "family_of", "OutputParser", "CallArgs", "CallStart", "Event", "Parsed", "Text", "ToolCall",
           "THINK", "END_THINK"]


@dataclass(frozen=True)
class Family:
    name: str
    calls: CallSyntax
    call_text: Callable[[str, int, str], str]  # (name, index, arguments) -> one call as the model writes it
    renders_tools: bool  # the template writes the tools into the prompt itself
    thinking_switch: bool  # the template reads `thinking` / `enable_thinking`

    def section(self, calls: list[tuple[str, str]]) -> str:
        """Calls [(name, arguments)] as the model writes them."""
        sep = "\n" if self.calls is deepseek.V3 else ""
        return self.calls.section_begin + sep.join(
            self.call_text(n, i, a) for i, (n, a) in enumerate(calls)) + self.calls.section_end

    def tool_prompt(self, tools: list[dict]) -> str:
        """The tools and the call format, for a template that does not render `tools` (a system message)."""
        lines = ["## Tools", "You have access to the following tools:"]
        for t in tools:
            f = t["function"]
            lines += ["", f"### {f['name']}", f"Description: {f.get('description') or ''}", "",
                      f"Parameters: {json.dumps(f.get('parameters') or {}, ensure_ascii=False)}"]
        example = self.section([("tool_call_name", "tool_call_arguments")])
        return "\n".join(lines + ["", "IMPORTANT: ALWAYS adhere to this exact format for tool use:", example])


_V31_ORDER = re.compile(r"name'\]\s*(?:\}\}|\+)\s*'?" + re.escape(deepseek.SEP))


def family_of(tokenizer) -> Optional[Family]:
    """The family whose tool-call markers the tokenizer has (None: no tool calling)."""
    template = tokenizer.chat_template or ""
    known = set(tokenizer.markers) | {m for m in (kimi.SECTION_BEGIN, deepseek.CALLS_BEGIN) if m in template}
    renders, switch = "tools" in template, bool(re.search(r"\b(thinking|enable_thinking)\b", template))
    if kimi.SECTION_BEGIN in known:
        return Family("kimi_k2", kimi.K2, kimi.k2_call, renders, switch)
    if deepseek.CALLS_BEGIN in known:
        if _V31_ORDER.search(template):
            return Family("deepseek_v31", deepseek.V31, lambda n, i, a: deepseek.v31_call(n, a), renders, switch)
        return Family("deepseek_v3", deepseek.V3, lambda n, i, a: deepseek.v3_call(n, a), renders, switch)
    return None


def opens_reasoning(prompt_text: str) -> bool:
    """Whether the prompt leaves the model inside its reasoning (it ends with <think>)."""
    return prompt_text.rstrip().endswith(THINK)
