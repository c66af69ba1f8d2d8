"""Constrained decoding with llguidance: a request's grammar masks the logits at each step, so the model can only
write text the grammar accepts — JSON for `response_format` (json_object, json_schema), a tool-call section in the
family's own markers for `tool_choice` "required" or a named function.

    g = Grammars(tokenizer, vocab_size)             # once per engine: the tokenizer as llguidance sees it
    c = g.constraint(g.json_schema(schema))         # per request (compile off the event loop: it can take ms)
    SamplingParams(..., logits_processors=(c,))     # the sampler calls c(output_ids, logits_row) -> masked row

The mask of the next step depends only on the tokens so far: `Constraint.prefetch(ids)` computes it on a worker
thread as soon as a step's token is known (the sampler calls it: Prefetching) (while the next step's forward runs);
the processor then only applies it. Without a prefetch it is computed in the processor (tens of µs on a CPU:
docs/perf/grammar.md)."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch

from hybrid.engine.requests import RequestError
from hybrid.serve.parsers import Family, deepseek

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps' layout
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters` takes none
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-grammar")


def _closed(schema):
    """The schema with objects that list their properties closed to others (what OpenAI's strict mode asks): a
    weak model cannot wander off into made-up keys; what it writes still validates against the schema given."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _styled(schema: dict) -> dict:
    return {**_closed(schema), "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class Grammars:
    """Grammars for one tokenizer and vocabulary (the model's logits may be wider than the tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self.llg, self.tokenizer = llguidance, tokenizer
        self.vocab_size = vocab_size
        self.lltok = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                            eos_token=sorted(tokenizer.eos_ids))

    # -- grammars (llguidance's serialized form) ----------------------------------------------------------------
    def json_schema(self, schema: dict, after_reasoning: bool = False) -> str:
        if not after_reasoning:
            return self.llg.LLMatcher.grammar_from_json_schema(_styled(schema))
        body = "%json" + json.dumps(_styled(schema), ensure_ascii=False)
        return self.llg.LLMatcher.grammar_from_lark(
            f"start: reasoning {self._token('</think>')} {body}\nreasoning: /(?s:.*)/")

    def tool_calls(self, family: Family, tools: Sequence[dict], parallel: bool = True,
                   after_reasoning: bool = False) -> str:
        """One tool-call section of `tools` (OpenAI function tools) in the family's markers: one call, or one or
        more when `parallel`. after_reasoning: the prompt left the model in its reasoning, which comes first."""
        s, tok = family.calls, self._token
        calls = []
        for i, t in enumerate(tools):
            f = t["function"]
            args = "%json" + json.dumps(_styled(f.get("parameters") or NO_PARAMETERS), ensure_ascii=False)
            name = _lark_str(f["name"])
            if s is deepseek.V3:
                calls.append(f'f{i}: "function" {tok(deepseek.SEP)} {name} "\\n```json\\n" {args} "\\n```"')
            elif family.name == "kimi_k2":
                calls.append(f'f{i}: "functions." {name} ":" /[0-9]{{1,4}}/ '
                             f'{tok("<|tool_call_argument_begin|>")} {args}')
            else:
                calls.append(f'f{i}: {name} {tok(deepseek.SEP)} {args}')
        sep = '"\\n" ' if s is deepseek.V3 else ""
        more = f"({sep}call)*" if parallel else ""
        lines = [f"start: {'reasoning ' + tok('</think>') + ' ' if after_reasoning else ''}"
                 f"{tok(s.section_begin)} call {more} {tok(s.section_end)}",
                 f"call: {tok(s.call_begin)} ({' | '.join(f'f{i}' for i in range(len(tools)))}) {tok(s.call_end)}",
                 "reasoning: /(?s:.*)/", *calls]
        return self.llg.LLMatcher.grammar_from_lark("\n".join(lines))

    def _token(self, text: str) -> str:
        """A marker as a lark terminal: its token where it is one, else its text."""
        i = self.tokenizer.markers.get(text)
        return f"<[{i}]>" if i is not None else _lark_str(text)

    # -- per request ------------------------------------------------------------------------------------------------
    def constraint(self, grammar: str) -> "Constraint":
        """A fresh matcher of the grammar (RequestError naming the grammar's fault when it does not compile)."""
        matcher = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the schema cannot be enforced: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One request's grammar state; called by the sampler as a logits processor."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.consumed = 0  # output tokens the matcher has seen
        self.allowed_V: Optional[torch.Tensor] = None  # the mask after `consumed` tokens (None: not computed)
        self.lock = threading.Lock()

    def __call__(self, output_ids: Sequence[int], logits_V: torch.Tensor) -> torch.Tensor:
        allowed_V = self.advance(output_ids)
        width = logits_V.shape[-1]
        if width > allowed_V.shape[0]:
            allowed_V = torch.cat([allowed_V, allowed_V.new_zeros(width - allowed_V.shape[0])])
        return logits_V.masked_fill(~allowed_V[:width].to(logits_V.device), float("-inf"))

    def advance(self, output_ids: Sequence[int]) -> torch.Tensor:
        """The mask after `output_ids` (the tokens not seen yet are consumed first)."""
        with self.lock:
            if len(output_ids) != self.consumed or self.allowed_V is None:
                for t in output_ids[self.consumed:]:
                    if not self.matcher.consume_token(int(t)):
                        raise RuntimeError(f"the grammar refused token {t}: {self.matcher.get_error()}")
                self.consumed = len(output_ids)
                bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
                self.allowed_V = torch.from_numpy(bits[:self.vocab_size].astype(bool))
            return self.allowed_V

    def prefetch(self, output_ids: Sequence[int]) -> None:
        """Computes the next mask on the worker thread (the engine's next step finds it ready)."""
        ids = list(output_ids)
        _WORKER.submit(self._prefetch, ids)

    def _prefetch(self, ids: list[int]) -> None:
        try:
            if len(ids) > self.consumed:
                self.advance(ids)
        except Exception:  # the processor meets the same failure and reports it for the request
            pass
