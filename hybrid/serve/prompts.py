"""How the load drivers (hybrid/serve/load.py, sessions.py) make and send their prompts: random token ids drawn from
a pool, sent as ids (`Prompts.ids`: exact lengths, a server of the model's vocabulary), or as text (`Prompts.text`:
for a gateway that takes text prompts only, as sglang-router, or another server). The text pool holds the tokens
whose texts, joined, the tokenizer splits back into the same ids — words that begin with a space where the
tokenizer has enough of them (its pre-tokenizer splits there), else single letters — so lengths stay exact on this
model's tokenizer (`exact`: checked on a sample) and close on another's."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

FIRST_TOKEN_ID = 3  # ids below are often specials (BOS, EOS, padding)
MIN_WORDS = 64  # word tokens needed to prefer them over single letters
SAMPLE = 2048  # ids in the round-trip check
_WORD, _LETTERS = re.compile(r" [A-Za-z]{2,}"), re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Prompts:
    pool: Sequence[int]  # the ids prompts are drawn from
    texts: Optional[Mapping[int, str]] = None  # id -> its text: prompts are sent as text
    exact: bool = True  # the text of drawn ids tokenizes back into those ids

    @staticmethod
    def ids(vocab_size: int) -> "Prompts":
        if vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
        return Prompts(range(FIRST_TOKEN_ID, vocab_size))

    @staticmethod
    def text(tokenizer, seed: int = 0) -> "Prompts":
        """The text pool of `tokenizer` (hybrid.tokenizer.Tokenizer)."""
        texts = {}
        for i in range(tokenizer.vocab_size):
            if i in tokenizer.special_ids or i in tokenizer.markers.values():
                continue
            s = tokenizer.decode([i])
            if (_WORD.fullmatch(s) or _LETTERS.fullmatch(s)) and tokenizer.encode(s, add_bos=False) == [i]:
                texts[i] = s
        words = {i: s for i, s in texts.items() if s.startswith(" ")}
        texts = words if len(words) >= MIN_WORDS else {i: s for i, s in texts.items() if not s.startswith(" ")}
        if len(texts) < 2:
            raise ValueError("this tokenizer has too few plain word or letter tokens for text prompts")
        pool = sorted(texts)
        rng = random.Random(seed)
        sample = [rng.choice(pool) for _ in range(SAMPLE)]
        exact = tokenizer.encode("".join(texts[i] for i in sample), add_bos=False) == sample
        return Prompts(pool, texts, exact)

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.pool) for _ in range(n)]

    def payload(self, ids: Sequence[int]) -> Union[str, list[int]]:
        """What is sent: the ids, or their text."""
        return list(ids) if self.texts is None else "".join(self.texts[i] for i in ids)

    def stand_in(self, ids: Sequence[int]) -> list[int]:
        """Ids of the pool in place of generated ones, as many (a text conversation re-sends an answer as text: a
        random model's answer would not tokenize back to its ids)."""
        return list(ids) if self.texts is None else [self.pool[i % len(self.pool)] for i in ids]
