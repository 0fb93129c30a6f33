"""What an open and a close cost on the step path, as they travel now (SeqStep messages beside the
columnar plain entries): a decoding batch of ``--batch`` sequences in a free-text JSON string
(deepseek-v4), steps through ``MaskClient`` to ``maskd serve --threads 1`` in a process of its
own on 127.0.0.1. In turns, step by step: a plain step (every sequence one token, all columnar);
a step with a close riding on it (the batch one sequence fewer: as vLLM's plugin sends a finished
request's close with the step it sends ahead); a step with an open by grammar id (the new
sequence's first step among the rest, a SeqStep message; the batch back to ``--batch``); and both
at once (a request finishes and a new one starts). The step's round trip (``step``: request
built, sent, answered, rows decoded) and the server's time (``server_seconds``), medians over
``--steps`` steps per kind, ms.

  .venv/bin/python docs/benchmarks/scripts/step_opens_closes.py [--batch 32,128] [--steps 100]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

KINDS = ("plain", "a close", "an open", "close + open")
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


class Batch:
    """Sequences decoding the string, each fed its next token per step (none on its open's step)."""

    def __init__(self, mc, grammar_id: str, tokens: list[int], serials: itertools.count, tag: str) -> None:
        self.mc, self.grammar_id, self.tokens, self.serials, self.tag = mc, grammar_id, tokens, serials, tag
        self.fed: dict[str, int] = {}

    def start(self) -> str:
        sid = f"{self.tag}-{next(self.serials)}"
        self.mc.open(sid, {"json_schema": SCHEMA}, grammar_id=self.grammar_id)
        self.fed[sid] = 0
        return sid

    def end(self, sid: str) -> None:
        self.mc.close(sid)             # waits for the next step (close_linger_s)
        del self.fed[sid]

    def request(self) -> dict[str, list[int]]:
        out = {}
        for sid, n in self.fed.items():
            out[sid] = [] if n == 0 else [self.tokens[(n - 1) % len(self.tokens)]]
            self.fed[sid] = n + 1
        return out


def run_batch(mc, grammar_id: str, tokens: list[int], size: int, steps: int, serials: itertools.count) -> str:
    from maskd_client import SeqStatus

    batch = Batch(mc, grammar_id, tokens, serials, f"b{size}")
    live = [batch.start() for _ in range(size)]
    for _ in range(12):
        mc.step(batch.request())
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    server: dict[str, list[float]] = {k: [] for k in KINDS}
    for step in range(len(KINDS) * steps):
        kind = KINDS[step % len(KINDS)]
        if kind in ("a close", "close + open"):
            batch.end(live.pop(0))
        if kind in ("an open", "close + open"):
            live.append(batch.start())
        request = batch.request()
        t0 = time.perf_counter()
        result = mc.step(request)
        times[kind].append(time.perf_counter() - t0)
        server[kind].append(result.server_seconds)
        bad = [s for s in result.status.tolist() if s != SeqStatus.READY]
        if bad:
            raise SystemExit(f"a step answered {bad[:3]}, not READY")
    for sid in live:
        batch.end(sid)
    mc.flush_closes()
    return f"batch {size}: " + "; ".join(
        f"{k} round trip {statistics.median(times[k]) * 1e3:.3f} ms, server {statistics.median(server[k]) * 1e3:.3f} ms"
        for k in KINDS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="32,128", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per kind and batch size")
    ap.add_argument("--tokenizer", default="deepseek-v4")
    args = ap.parse_args()

    from maskd.server.tokenizers import load_tokenizer
    from maskd.tools.bench import common
    from maskd_client import MaskClient

    tok = load_tokenizer(args.tokenizer)
    tokens = tok.encode('{"text": "' + "the quick brown fox jumps over the lazy dog " * 80)
    server = common.subprocess_server(args.tokenizer, 1)
    try:
        with MaskClient(server.address, want_forced_tokens=False, timeout_s=120, close_linger_s=60) as mc:
            grammar_id = mc.register({"json_schema": SCHEMA}, wait=True)
            print(f"{args.tokenizer} ({tok.ll.vocab_size} ids), free-text JSON string, maskd serve --threads 1 "
                  f"at {server.address}")
            serials = itertools.count()
            for size in (int(b) for b in args.batch.split(",")):
                print(run_batch(mc, grammar_id, tokens, size, args.steps, serials))
    finally:
        server.close()


if __name__ == "__main__":
    main()
