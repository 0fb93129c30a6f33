"""What the SGLang scripts share (``sglang_step.py``, ``sglang_open_by_id.py``): ``maskd serve``
in a process of its own on 127.0.0.1, maskd's backend from SGLang 0.5.23's registry, the mask of a
batch as SGLang's scheduler computes it once per step, and a batch decoding a free-text JSON
string."""
from __future__ import annotations

import contextlib
import json
import os
import types
from collections.abc import Iterator
from typing import Any

FREE_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


class SGLangBatch:
    def __init__(self, tok, backend) -> None:
        self.tok, self.backend = tok, backend
        self.text = backend.dispatch_json(json.dumps(FREE_TEXT))
        self.letter = tok.encode("a")[0]

    def masks(self, grammars: list) -> Any:
        """``SamplingBatchInfo.update_regex_vocab_mask`` on these grammars: the step's mask."""
        import torch
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

        batch = types.SimpleNamespace(grammars=list(grammars), temperatures=torch.ones(len(grammars)),
                                      vocab_size=self.tok.ll.vocab_size, device="cpu", grammar_mask=None)
        SamplingBatchInfo.update_regex_vocab_mask(batch)
        return batch.grammar_mask.vocab_mask

    def decoding(self, size: int) -> list:
        """``size`` requests inside the free-text string, each step taking one more letter."""
        grammars = [self.text.copy() for _ in range(size)]
        for t in self.tok.encode('{"text": "'):
            self.masks(grammars)
            for g in grammars:
                g.accept_token(t)
        return grammars

    def take_letter(self, grammars: list) -> None:
        for g in grammars:
            g.accept_token(self.letter)


@contextlib.contextmanager
def sglang_batch(tokenizer: str) -> Iterator[SGLangBatch]:
    from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY

    import maskd_client.sglang  # noqa: F401  (registers "maskd")
    from maskd.server.tokenizers import load_tokenizer
    from maskd.tools.bench import common

    tok = load_tokenizer(tokenizer)
    handle = common.subprocess_server(tokenizer, 1)
    try:
        os.environ["MASKD_TARGET"] = handle.address
        server_args = types.SimpleNamespace(host="127.0.0.1", port=30000, nccl_port=0, dist_init_addr=None)
        backend = GRAMMAR_BACKEND_REGISTRY["maskd"](server_args, None, tok.ll.vocab_size, set(tok.eos_token_ids))
        try:
            yield SGLangBatch(tok, backend)
        finally:
            backend.shutdown()
    finally:
        handle.close()
