"""hybrid.bench.grammar on a tokenizer directory (--tokenizer): the model's vocabulary from --vocab, config.json or
the tokenizer; every row for both grammars, walks and modes; the text walk feeds tokens the grammar allows; a
directory without a chat template gets the family's."""
from __future__ import annotations

import json

from hybrid.bench import grammar
from hybrid.weights.tokenizer_files import write_byte_tokenizer


def _rows(capsys, *argv) -> list[dict]:
    grammar.main(["--skip-generated", "--steps", "6", "--forward-ms", "0", *argv])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_tokenizer_directory_rows(tmp_path, capsys):
    d = tmp_path / "tok"
    d.mkdir()
    write_byte_tokenizer(d, 320, 0, 1, "deepseek_v3")
    (d / "config.json").write_text(json.dumps({"vocab_size": 384}))  # the model's logits wider than the tokenizer
    rows = _rows(capsys, "--tokenizer", str(d))
    setup, *rest = rows
    assert setup["what"] == "tokenizer_setup_ms" and setup["vocab"] == 384 and setup["tokenizer_tokens"] == 320
    assert setup["chat_template"] == "tokenizer_config.json"
    walks = [r for r in rest if r["what"] == "processor_us_median"]
    assert {(r["grammar"], r["walk"], r["prefetch"]) for r in walks} == {
        (g, w, p) for g in ("json_schema", "tool_call") for w in ("random", "text") for p in (False, True)}
    assert all(r["vocab"] == 384 and r["tokenizer"] == str(d) for r in rest)
    for r in walks:
        assert r["value"] > 0 and r["p90_us"] >= r["value"] and r["mask_us_median"] > 0 and r["apply_us_median"] > 0
        assert r["tokens"] == 6 if r["walk"] == "text" else 1 <= r["tokens"] <= 6
    assert [r["grammar"] for r in rest if r["what"] == "compile_ms"] == ["json_schema", "tool_call"]


def test_vocab_option_and_missing_template(tmp_path, capsys):
    d = tmp_path / "tok"
    d.mkdir()
    write_byte_tokenizer(d, 320, 0, 1, "deepseek_v3")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    setup = _rows(capsys, "--tokenizer", str(d), "--vocab", "400")[0]
    assert setup["vocab"] == 400 and setup["chat_template"].startswith("deepseek_v3")


def test_text_walk_crosses_texts(tmp_path):
    """More tokens than one text: fresh grammar states, each token allowed (the walk raises otherwise)."""
    from hybrid.serve import agent
    from hybrid.tokenizer import Tokenizer

    write_byte_tokenizer(tmp_path, 320, 0, 1, "deepseek_v3")
    tok = Tokenizer(tmp_path)
    turn = agent.prepare(tok, 320, [{"role": "user", "content": "hi"}], tools=grammar.TOOLS, tool_choice="required")
    texts = grammar._texts(tok, turn, "tool_call")
    steps = sum(map(len, texts)) + 5
    assert len(grammar._walk(turn, 320, steps, False, 0.0, texts)["processor"]) == steps
