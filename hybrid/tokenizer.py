"""Tokenizer of a checkpoint: tokenizer.json through the `tokenizers` library, the chat template (Jinja) and the
special tokens from tokenizer_config.json.

The template renders as Hugging Face's `apply_chat_template` does (sandboxed Jinja, trim_blocks and lstrip_blocks,
loop controls, `tojson` keeping non-ASCII text, `raise_exception`), with `tools` and extra variables (`thinking`,
`enable_thinking`, ...) passed through. Decoding drops special tokens but keeps the tool-call and reasoning markers
(`MARKERS`), which the server parses out of the text."""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer as _Tokenizer

from hybrid.errors import CheckpointError

MARKERS = frozenset([
    "<think>", "</think>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
])


def _token_text(v) -> Optional[str]:
    return v.get("content") if isinstance(v, dict) else v


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(template)


class Tokenizer:
    def __init__(self, path: Path):
        path = Path(path)
        try:
            self._tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the library raises a bare Exception for missing or malformed files
            raise CheckpointError(f"{path / 'tokenizer.json'}: cannot load tokenizer ({e})")
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.chat_template: Optional[str] = cfg.get("chat_template")
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        eos = gen.get("eos_token_id")
        # where a turn ends: generation_config.json's end-of-sequence ids (Kimi-K2's chat turns end with
        # <|im_end|>, not config.json's [EOS]) and the tokenizer's eos token
        self.eos_ids: frozenset[int] = frozenset(
            [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
            + [i for i in [self.token_id(self.eos_token)] if i is not None])
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special and t.content not in MARKERS)
        self.markers = {t.content: i for i, t in added.items() if t.content in MARKERS}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """tokenizer.json's text (for the grammar library)."""
        return self._tok.to_str()

    def token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token)
        if (self.add_bos if add_bos is None else add_bos) and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ids; special tokens dropped (but the markers) unless skip_special_tokens is false."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._tok.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages: list[dict], tools: Optional[list[dict]] = None,
                    continue_final: bool = False, **kwargs: Any) -> str:
        """The template's text for `messages` with a generation prompt; the template places the BOS itself.
        continue_final: no generation prompt, and the text ends with the last message's content (an assistant
        message the model goes on with; ValueError if the template does not write it)."""
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat_template (set chat=false)")
        text = _compile(self.chat_template).render(
            messages=messages, tools=tools or None, add_generation_prompt=not continue_final,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        if not continue_final:
            return text
        final = messages[-1].get("content") or ""
        at = text.rfind(final) if final else -1
        if at < 0:
            raise ValueError("the chat template does not write the final message's content as it is")
        return text[:at + len(final)]

    def apply_chat_template(self, messages: list[dict], tools: Optional[list[dict]] = None,
                            **kwargs: Any) -> list[int]:
        return self._tok.encode(self.render_chat(messages, tools, **kwargs), add_special_tokens=False).ids
