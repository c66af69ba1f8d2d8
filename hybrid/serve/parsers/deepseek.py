"""DeepSeek's tool-call markers. V3 and R1 wrap each call's arguments in a JSON code fence after the type and the
name; V3.1 puts the arguments right after the name:

    V3/R1  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
           (\\n<｜tool▁call▁begin｜>…)*<｜tool▁calls▁end｜>
    V3.1   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>(…)*<｜tool▁calls▁end｜>
"""
from __future__ import annotations

import re

from hybrid.serve.parsers.base import CallSyntax

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# the name ends at a newline; the fence follows (or, without one, the arguments start at once)
V3 = CallSyntax("deepseek_v3", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END,
                re.compile(r"\s*(?:\w+)?" + SEP + r"(?P<name>[^\n<]+)\n(?:```(?:json)?\n|(?=[^`]))"), args_suffix="```")
V31 = CallSyntax("deepseek_v31", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END,
                 re.compile(r"\s*(?P<name>[^<]+?)" + SEP))


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"
