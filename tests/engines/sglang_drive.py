"""Driving maskd through SGLang's own classes, as SGLang's scheduler does.

``backend_from_registry`` builds the backend the way ``create_grammar_backend`` does for a custom
name (``GRAMMAR_BACKEND_REGISTRY[name](server_args, tokenizer, vocab_size, eos_token_ids)``; the
function itself needs SGLang's published server config, which imports every model config and with
it torchvision, whose PyPI build cannot load next to a CPU torch). ``compile`` goes through
``get_cached_or_future_value`` / ``set_cache`` as SGLang's GrammarManager does; ``masks`` is
``SamplingBatchInfo.update_regex_vocab_mask`` on a batch's grammars.
"""
from __future__ import annotations

import json
import types

import numpy as np
import torch
from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY, InvalidGrammarObject
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

import maskd_client.sglang  # noqa: F401  (registers "maskd")
from maskd_tools import conformance
from maskd_tools.bench.common import llguidance_grammar


def backend_from_registry(vocab_size: int, eos_ids, server_args=None):
    args = server_args or types.SimpleNamespace(host="127.0.0.1", port=30000, nccl_port=0, dist_init_addr=None)
    return GRAMMAR_BACKEND_REGISTRY["maskd"](args, None, vocab_size, set(eos_ids))


def compile(backend, key):
    """A request's grammar for ``key`` (SGLang's (type, string)): (grammar, error message)."""
    value, hit = backend.get_cached_or_future_value(key, False)
    if not hit:
        value = value.result()
        backend.set_cache(key, value.copy())
    if isinstance(value, InvalidGrammarObject):
        return None, value.error_message
    return value, None


def masks(grammars, vocab_size: int) -> torch.Tensor:
    """SGLang's per-step mask for a batch (None entries: requests without a grammar)."""
    batch = types.SimpleNamespace(grammars=list(grammars), temperatures=torch.ones(len(grammars)),
                                  vocab_size=vocab_size, device="cpu", grammar_mask=None)
    SamplingBatchInfo.update_regex_vocab_mask(batch)
    return batch.grammar_mask.vocab_mask


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def run_conformance(backend, tok, suite, *, mode: str, batch: int = 64) -> dict:
    """MaskBench through SGLang's registry and grammar objects: the report of maskd conformance."""
    import time
    t0 = time.perf_counter()
    tally = conformance._VerdictTally()
    errors: dict[str, str] = {}
    keys = {}
    for name, schema, _ in suite:
        key = ("json", json.dumps(schema, ensure_ascii=False))
        grammar, error = compile(backend, key)
        if error is not None:
            errors[name] = error
        else:
            keys[name] = key
    eos = backend.info.eos_token_ids[0]
    width = backend.width
    source = conformance._instances(suite, set(keys), tok.encode)
    active: list = []          # [instance, grammar, position]
    exhausted = False
    while active or not exhausted:
        while not exhausted and len(active) < batch:
            inst = next(source, None)
            if inst is None:
                exhausted = True
                break
            grammar, _ = compile(backend, keys[inst.file])
            active.append([inst, grammar, 0])
        if not active:
            break
        mask = masks([g for _, g, _ in active], width)
        keep = []
        for i, item in enumerate(active):
            inst, grammar, pos = item
            at_end = pos >= len(inst.tokens)
            token = eos if at_end else inst.tokens[pos]
            ok = allowed(mask[i], token)
            tally.masks += 1
            if not ok or at_end:
                tally.verdict(inst, ok, "" if ok else ("EOS not allowed at the end" if at_end
                                                       else f"token {pos} ({token}) not allowed"))
                grammar.finished = True
                continue
            grammar.accept_token(token)
            item[2] = pos + 1
            keep.append(item)
        active = keep
    return conformance._report(suite, errors, tally, time.perf_counter() - t0, "SGLang registry -> maskd", mode)


def llguidance_rows(tok, schema_text: str, tokens) -> np.ndarray:
    """In-process llguidance: the row at every position of ``tokens`` and after the last."""
    import llguidance
    import llguidance.torch as lt
    m = llguidance.LLMatcher(tok.ll, llguidance_grammar(schema_text), log_level=0)
    out = lt.allocate_token_bitmask(len(tokens) + 1, tok.ll.vocab_size)
    for i, t in enumerate([*tokens, None]):
        lt.fill_next_token_bitmask(m, out, i)
        if t is not None:
            assert m.consume_token(t), m.get_error()
    return out.numpy()
