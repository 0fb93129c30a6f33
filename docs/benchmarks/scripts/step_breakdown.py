"""Where a step's service time goes (embedded server, one process): per-step means over 200 steps.

    .venv/bin/python docs/benchmarks/scripts/step_breakdown.py 64

Needs ../shared/maskbench-dev (120 files). Timers wrap the client's step build, the server's
Session.step (consume + fill + session work), the RowBlockEncoder, the reply's arrival on the client's
reader thread, the row decode and the result's hand-over to the caller.
"""
import random, statistics, sys, time, types
import numpy as np
from maskd.tools.bench import common, serve
from maskd.server.tokenizers import load_tokenizer
import maskd.rowcodec as rc, maskd_client.stream as cs, maskd.server.session as ss
from maskd.specs import GrammarSpec

import sys as _s; _s.setswitchinterval(float(__import__("os").environ.get("SWI", "0.005")))
B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
tok = load_tokenizer("deepseek-v4")
schemas = [s for s in common.load_schemas(common.pathlib.Path("../shared/maskbench-dev"), tok, 120) if s.instances]
srv = common.open_server("embedded", "deepseek-v4", 2, None, log_path=common.pathlib.Path("/tmp/probe.log"))
LAST = [0.0]
T = {k: [] for k in ("encode", "session", "decode", "arrive", "resolve_total", "step_build", "wake")}
orig_enc, orig_dec, orig_step, orig_res = rc.RowBlockEncoder.encode, rc.RowBlockDecoder.decode, ss.Session.step, cs.StepStream._resolve
def enc(self, *a, **k):
    t = time.perf_counter(); r = orig_enc(self, *a, **k); T["encode"].append(time.perf_counter() - t); return r
def dec(self, *a, **k):
    t = time.perf_counter(); r = orig_dec(self, *a, **k); T["decode"].append(time.perf_counter() - t); return r
def step(self, *a, **k):
    t = time.perf_counter(); r = orig_step(self, *a, **k); T["session"].append(time.perf_counter() - t); return r
def res(self, item, reply):
    t = time.perf_counter(); T["arrive"].append(t - item.sent_at); orig_res(self, item, reply)
    T["resolve_total"].append(time.perf_counter() - t); LAST[0] = time.perf_counter()
rc.RowBlockEncoder.encode, rc.RowBlockDecoder.decode, ss.Session.step, cs.StepStream._resolve = enc, dec, step, res
try:
    mc0 = serve._client(srv.address)
    with mc0 as mc:
        errors = common.register_all(mc, schemas)
    pool = common.instance_pool(schemas, errors, 0, "step_breakdown")
    svc = []
    with serve._client(srv.address) as mc:
        b = serve._Batch(mc, pool, B, tok.eos_token_ids[0], "p", 0)
        for k in range(230):
            req, plan = b.request()
            t0 = time.perf_counter(); fut = mc.step_async(req); t1 = time.perf_counter(); r = fut.result(); t2 = time.perf_counter()
            rows = r.bitmask.numpy() if hasattr(r.bitmask, "numpy") else np.asarray(r.bitmask)
            if k >= 30:
                svc.append(t2 - t0); T["wake"].append(t2 - LAST[0]); T["step_build"].append(t1 - t0)
            b.sample(r, rows)
finally:
    srv.close()
med = lambda x: statistics.mean(x[-200:]) * 1e3
print(f"batch {B}: service mean {med(svc):.3f} ms")
for k, v in T.items():
    print(f"  {k:14s} mean {med(v):.3f} ms  (n={len(v)})")

