"""What sequences that step in turns cost the server: one session, GROUPS groups of B sequences
stepped one group per request (as pipeline micro-batches would), each sequence advancing one
token of a MaskBench-dev valid instance per turn. Each sequence's answers of its last 4 steps
must stay answerable, so when the session's ring of 6 row buffers comes round they are packed
(default) or the ring grows (--max-row-buffers-per-session). Reports the server's own step time
(StepResponse.server_seconds, p50 over the measured requests) for a fixed and a growing ring, and
for comparison the same sequences in lockstep (every group in one request).

    .venv/bin/python docs/benchmarks/scripts/ring_turns.py [B] [GROUPS] [STEPS]

Needs ../shared/maskbench-dev. Embedded servers (one process), 1 fill thread.
"""
import random
import statistics
import sys

from maskd.server import Limits, MaskServer, ServerConfig
from maskd.server.tokenizers import load_tokenizer
from maskd.tools.bench import common
from maskd_client import MaskClient, SeqStatus

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
GROUPS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 60
tok = load_tokenizer("deepseek-v4")
schemas = [s for s in common.load_schemas(common.pathlib.Path("../shared/maskbench-dev"), tok, 120) if s.instances]
pool = [(s, t) for s in schemas for t in s.instances if len(t) > STEPS + 2]
random.Random(0).shuffle(pool)


def run(max_buffers: int, turns: bool) -> dict:
    srv = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=1, json_schema_mode="strict",
                                  limits=Limits(max_row_buffers_per_session=max_buffers))).start()
    try:
        with MaskClient(srv.address, session="turns") as mc:
            errors = common.register_all(mc, [s for s, _ in pool])
            ok = [(s, t) for s, t in pool if s.name not in errors]
            live = [ok[i % len(ok)] for i in range(B * GROUPS)]      # instances repeat past the pool
            groups = [[(f"s{g}-{i}", s, t) for i, (s, t) in enumerate(live[g * B:(g + 1) * B])] for g in range(GROUPS)]
            for group in groups:
                for sid, s, _ in group:
                    mc.open(sid, s.spec)
                res = mc.step({sid: [] for sid, _, _ in group})
                assert all(res.seqs[sid].status is SeqStatus.READY for sid, _, _ in group)
            seconds = []
            for k in range(STEPS):
                batches = groups if turns else [[e for g in groups for e in g]]
                for batch in batches:
                    res = mc.step({sid: [t[k]] for sid, _, t in batch})
                    assert all(res.seqs[sid].has_rows for sid, _, _ in batch)
                    if k >= 8:                       # after the ring has come round
                        seconds.append(res.server_seconds)
            session = next(iter(srv.service.sessions.sessions()))
            return {"p50_ms": 1e3 * statistics.median(seconds), "ring": session.buffers.count,
                    "requests": len(seconds)}
    finally:
        srv.stop(grace=0.5)


print(f"B={B} per group, {GROUPS} groups, {STEPS} steps; server_seconds p50 per request")
for label, max_buffers, turns in (("lockstep, ring 6", 6, False), ("in turns, ring 6 (packed)", 6, True),
                                  (f"in turns, ring up to {6 * GROUPS + 2}", 6 * GROUPS + 2, True)):
    r = run(max_buffers, turns)
    print(f"  {label:32s} {r['p50_ms']:8.3f} ms per request ({r['requests']} requests), ring {r['ring']} buffers")
