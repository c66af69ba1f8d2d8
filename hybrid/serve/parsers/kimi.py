"""Kimi-K2's tool-call markers; a call's id is `functions.NAME:INDEX`, which the template writes back:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>ARGS<|tool_call_end|>
    (…)*<|tool_calls_section_end|>
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from hybrid.serve.parsers.base import CallSyntax

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
ID_RE = re.compile(r"functions\.[^:<]+:\d+")


@dataclass(frozen=True)
class KimiSyntax(CallSyntax):
    def new_id(self, name: str, index: int, given: Optional[str]) -> str:
        return given if given and ID_RE.fullmatch(given) else f"functions.{name}:{index}"


K2 = KimiSyntax("kimi_k2", SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END,
                re.compile(r"\s*(?P<id>(?:functions\.)?(?P<name>[^<:]+?)(?::\d+)?)\s*" + re.escape(ARGS_BEGIN)))


def k2_call(name: str, index: int, arguments: str) -> str:
    return f"{CALL_BEGIN}functions.{name}:{index}{ARGS_BEGIN}{arguments}{CALL_END}"
