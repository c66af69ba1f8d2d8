"""A byte-level tokenizer in the Hugging Face layout (tokenizer.json + tokenizer_config.json), for generated
checkpoints: every byte is a token, so any text round-trips. The chat template, BOS/EOS and the special tokens are
a model family's (hybrid/weights/chat_templates.py); the tool-call and reasoning markers are added tokens that
decoding keeps, as in the published DeepSeek tokenizers."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hybrid.weights.chat_templates import FAMILIES

BOS, EOS = FAMILIES["deepseek_v3"][2:]
ROLE_TOKENS = {"<｜User｜>", "<｜Assistant｜>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
               "<|im_middle|>"}  # special: dropped when decoding


def write_byte_tokenizer(dst: Path, vocab_size: int, bos_id: int, eos_id: int, family: str = "deepseek_v3") -> None:
    """BOS/EOS at bos_id / eos_id, the 256 bytes after them, the family's tokens, reserved tokens up to
    vocab_size."""
    if family not in FAMILIES:
        raise ValueError(f"chat template family must be one of {sorted(FAMILIES)}, got {family!r}")
    template, extra, bos, eos = FAMILIES[family]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    free = [i for i in range(vocab_size) if i not in (bos_id, eos_id)]
    if len(free) < len(alphabet) + len(extra):
        raise ValueError(f"a byte-level tokenizer with {family}'s tokens needs vocab_size >= "
                         f"{len(alphabet) + len(extra) + 2}, got {vocab_size}")
    vocab = {ch: free[i] for i, ch in enumerate(alphabet)}
    vocab.update({bos: bos_id, eos: eos_id})
    vocab.update({t: free[256 + i] for i, t in enumerate(extra)})
    vocab.update({f"<|reserved_{i}|>": i for i in free[256 + len(extra):]})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([bos, eos] + [t for t in extra if t in ROLE_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra if t not in ROLE_TOKENS])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": family.startswith("deepseek"), "add_eos_token": False, "bos_token": bos, "eos_token": eos,
        "chat_template": template, "model_max_length": 16384, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2, ensure_ascii=False))
    if family.startswith("kimi"):  # a Kimi turn ends with <|im_end|> (generation_config.json's eos_token_id)
        (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab["<|im_end|>"]}))
