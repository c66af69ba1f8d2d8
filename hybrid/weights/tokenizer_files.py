"""A byte-level tokenizer in the Hugging Face layout (tokenizer.json + tokenizer_config.json), for generated
checkpoints: every byte is a token, so any text round-trips."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def write_byte_tokenizer(dst: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """Specials at bos_id / eos_id, the 256 bytes after them, reserved tokens up to vocab_size."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = {bos_id: BOS, eos_id: EOS}
    free = [i for i in range(vocab_size) if i not in specials]
    if len(free) < len(alphabet) + 2:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= 260, got {vocab_size}")
    vocab = {ch: free[i] for i, ch in enumerate(alphabet)}
    vocab.update({BOS: bos_id, EOS: eos_id})
    vocab.update({"<｜User｜>": free[256], "<｜Assistant｜>": free[257]})
    vocab.update({f"<|reserved_{i}|>": i for i in free[258:]})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, "<｜User｜>", "<｜Assistant｜>"])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 16384, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2, ensure_ascii=False))
