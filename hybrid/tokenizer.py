"""Tokenizer of a checkpoint: tokenizer.json through the `tokenizers` library, the chat template (Jinja) and the
special tokens from tokenizer_config.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as _Tokenizer

from hybrid.errors import CheckpointError


def _token_text(v) -> Optional[str]:
    return v.get("content") if isinstance(v, dict) else v


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

    def token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token)
        if (self.add_bos if add_bos is None else add_bos) and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Render the template with a generation prompt; it places the BOS itself."""
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat_template (set chat=false)")
        import jinja2

        text = jinja2.Environment().from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "")
        return self._tok.encode(text, add_special_tokens=False).ids
