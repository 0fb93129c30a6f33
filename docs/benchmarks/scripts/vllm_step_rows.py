"""The engine core's part of a decode step with maskd, in vLLM's own StructuredOutputManager (vLLM
0.33's interfaces, maskd's plugin patched in): ``grammar_bitmask`` for a decoding batch whose step
went out ahead (``update_from_output``) and has come back, so what is timed is the rows put into
vLLM's bitmask, not the wait for the server. Every request decodes a free-text JSON string (rows
nearly all allowed, one new token per step); ``maskd serve`` runs in a process of its own on
127.0.0.1.

Two ways, alternating step by step on the same batch: ``per request`` (the plugin's ``rows``: an
entry per request, its row copied on its own) and ``gathered`` (a variant, measured and not landed:
the rows a step sent ahead brought, for every request without drafts, gathered into the bitmask at
once, as the SGLang adapter does). Medians over ``--steps`` steps per way, ms.

  VLLM_TARGET_DEVICE=cpu .venv-engines/bin/python docs/benchmarks/scripts/vllm_step_rows.py [--batch 32,128]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class _Config:
    """What StructuredOutputManager and maskd's engine side read of vLLM's VllmConfig."""

    def __init__(self, width: int, max_num_seqs: int) -> None:
        from vllm.config import StructuredOutputsConfig

        class Model:
            skip_tokenizer_init = True
            is_diffusion = False

            def get_vocab_size(self) -> int:
                return width

        class Plain:
            def __init__(self, **kw) -> None:
                self.__dict__.update(kw)

        self.model_config = Model()
        self.num_speculative_tokens = 0
        self.speculative_config = None
        self.scheduler_config = Plain(max_num_seqs=max_num_seqs)
        self.parallel_config = Plain(distributed_executor_backend="mp", data_parallel_rank=0)
        self.structured_outputs_config = StructuredOutputsConfig(backend="guidance")
        self.instance_id = "step-rows"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="32,128", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per way and batch size")
    ap.add_argument("--tokenizer", default="deepseek-v4")
    args = ap.parse_args()

    import llguidance.torch
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from maskd.server.tokenizers import load_tokenizer
    from maskd.tools.bench import common
    from maskd_client import vllm as plugin

    tok = load_tokenizer(args.tokenizer)
    text = '{"text":"' + "the quick brown fox jumps over the lazy dog and runs far away " * 40
    tokens = tok.encode(text)
    server = common.subprocess_server(args.tokenizer, 1)
    try:
        address = server.address
        os.environ["MASKD_TARGET"] = address
        width = tok.logits_width
        plugin.register()
        schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        print(f"{args.tokenizer} ({width} ids), free-text JSON string, maskd serve --threads 1 at {address}")
        original = plugin.MaskdStructuredOutputs.rows
        for batch in (int(b) for b in args.batch.split(",")):
            config = _Config(width, batch)
            manager = StructuredOutputManager(config)
            manager.backend = type("B", (), {"allocate_token_bitmask": staticmethod(
                lambda n: llguidance.torch.allocate_token_bitmask(n, width))})()
            requests = {}
            for i in range(batch):
                params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), max_tokens=4096)
                params._validate_structured_outputs(config.model_config, config.structured_outputs_config,
                                                    tokenizer=object())
                req = Request(f"r{batch}-{i}", [1, 2, 3], params, None)
                manager.grammar_init(req)
                req.structured_output_request._grammar.result(timeout=60)
                requests[req.request_id] = req
            ids = list(requests)
            maskd = manager._maskd
            manager.grammar_bitmask(requests, ids, {})          # the opens
            times = {"per request": [], "gathered": []}
            for step in range(2 * args.steps + 10):
                for r in ids:
                    requests[r].structured_output_request.grammar.accept_tokens(r, [tokens[step % len(tokens)]])
                maskd.step_ahead()
                if maskd.ahead is not None:
                    maskd.ahead[0].result(60)                    # answered: what follows is the engine core's
                way = "per request" if step % 2 else "gathered"
                plugin.MaskdStructuredOutputs.rows = original if way == "per request" else _gathered
                t0 = time.perf_counter()
                manager.grammar_bitmask(requests, ids, {})
                if step >= 10:
                    times[way].append(time.perf_counter() - t0)
            plugin.MaskdStructuredOutputs.rows = original
            failed = [r for r in ids if requests[r].structured_output_request.grammar.failure]
            print(f"batch {batch}: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms"
                                                 for k, v in times.items()) + f"; failed {len(failed)}")
            for r in ids:
                requests[r].structured_output_request.grammar.close()
            maskd.shutdown()
    finally:
        server.close()


def _gathered(self, manager, requests, req_ids, spec_tokens):
    """A variant measured and not landed: a plain decode step's rows (sent ahead, no drafts) gathered
    into the bitmask at once; the rest as the plugin's rows."""
    import numpy as np
    from vllm.v1.structured_output.utils import strip_speculative_padding

    from maskd_client import vllm as plugin

    self.settle()
    starts, total = plugin._bitmask_layout(manager, req_ids, spec_tokens)
    out = np.full((total, self.words), -1, dtype=np.int32)
    entries, places, answered = [], [], []
    for req_id, start in zip(req_ids, starts):
        request = requests[req_id]
        grammar = request.structured_output_request.grammar
        raw = spec_tokens.get(req_id, ())
        n = 1 + len(raw)
        prepared = grammar.prepared
        if grammar.failure is not None or grammar.terminated:
            out[start:start + n] = self.eos_row
        elif not raw and prepared is not None and not prepared[0] and not grammar.pending:
            if manager._get_constraint_bounds(request, ())[1] == 0:
                places.append(start)
                answered.append(prepared[1])
                grammar.prepared = None
        else:
            drafts = strip_speculative_padding(list(raw))
            begin, constrain = manager._get_constraint_bounds(request, drafts)
            if constrain <= len(drafts):
                e = plugin._Entry(grammar, start, n, range(constrain, len(drafts) + 1), begin, drafts[begin:])
                if prepared is not None and not grammar.pending and e.drafts == prepared[0][:len(e.drafts)]:
                    self._place(e, prepared[1], prepared[2], out)
                else:
                    entries.append(e)
                grammar.prepared = None
    if places:
        out[places] = np.concatenate(answered)
    if entries:
        self._step(entries, out)
    return out


if __name__ == "__main__":
    main()
