"""The server's step protocol over the engine's own work, in one process (no gRPC, no codec).

    taskset -c 0 .venv/bin/python docs/benchmarks/scripts/session_step_overhead.py --batch 64 --mode strict

B sequences of MaskBench-dev valid instances (deepseek-v4) are opened on a ``Session`` (the
server's step protocol, its grammar cache and engine as ``maskd serve`` builds them, 1 fill
thread) and stepped with columnar decode steps, a token each; beside them the same B grammars
run as bare engine matchers (``consume_batch`` + ``fill_batch``). Each step times
``Session.step`` plus the reply's answers (``entries.answer``) against the bare consume + fill,
alternating which goes first; rows are compared bit for bit. ``--repeat`` sends each step's request
a second time right after (what a lockstep tensor-parallel rank sends) and times that apart. The difference is what the step
protocol's Python (admission, routing, readiness, the answers kept for repeats, document checks
in complete mode, the row ring) costs per step. ``--phases`` times each phase too.

Needs ../shared/maskbench-dev.
"""
from __future__ import annotations

import argparse
import collections
import gc
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--mode", choices=("strict", "complete"), default="strict", help="JSON-schema mode")
    p.add_argument("--phases", action="store_true", help="time each phase of Session.step too")
    p.add_argument("--repeat", action="store_true",
                   help="after each step, the same request again (a lockstep tensor-parallel rank's), timed apart")
    args = p.parse_args()

    from maskd.server import session as session_module
    from maskd.server.config import Limits
    from maskd.server.engines import create_engine
    from maskd.server.entries import answer
    from maskd.server.grammar_cache import GrammarCache
    from maskd.server.session import Session
    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tools.bench import common
    from maskd.v1 import maskd_pb2 as pb

    tok = load_tokenizer("deepseek-v4")
    engine = create_engine("llguidance", tok, threads=1, json_schema_mode=args.mode)
    cache = GrammarCache(engine, compile_threads=1)
    schemas = [s for s in common.load_schemas("../shared/maskbench-dev", tok, 48) if s.instances]
    pool = [i for i in common.instance_pool(schemas, {}, 0, "session") if len(i.tokens) > args.steps + 1]
    compiled = [i for i in pool
                if cache.wait(cache.lookup(GrammarSpec.from_proto(i.spec_pb), ""), 60).compiled is not None]
    insts = [compiled[i % len(compiled)] for i in range(args.batch)]
    session = Session("bench", engine, cache, Limits())
    opened = session.step(pb.StepRequest(seqs=[pb.SeqStep(seq_id=f"s{i}", step=0, spec=inst.spec_pb)
                                               for i, inst in enumerate(insts)]))
    handles = [r.handle for r in opened.results]
    if opened.release:
        opened.release()
    bare = [engine.new_matcher(session.by_handle[h].entry.compiled) for h in handles]
    rows = engine.allocate(args.batch)

    phases: dict[str, list[float]] = collections.defaultdict(list)
    if args.phases:
        def timed(owner, name: str, key: str) -> None:
            original = getattr(owner, name)

            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return original(*a, **kw)
                finally:
                    phases[key].append(time.perf_counter() - t0)
            setattr(owner, name, wrapper)

        timed(session_module.entries, "parse", "parse")
        for name in ("_admit", "_route", "_advance", "_consume", "_fill"):
            timed(Session, name, name.strip("_"))

    stepped, alone, repeated = [], [], []
    gc.collect()
    gc.freeze()
    for k in range(1, args.steps):
        tokens = [inst.tokens[k - 1] for inst in insts]
        request = pb.StepRequest(handles=np.array(handles, "<u4").tobytes(),
                                 steps=np.full(args.batch, k, "<u4").tobytes(),
                                 token_counts=np.ones(args.batch, "<u4").tobytes(),
                                 tokens=np.array(tokens, "<i4").tobytes())

        def step_protocol(request=request):
            t0 = time.perf_counter()
            outcome = session.step(request)
            answer(outcome.results, pb.StepResponse(), False, outcome.block)
            stepped.append(time.perf_counter() - t0)
            if args.repeat:
                if outcome.release:
                    outcome.release()
                t0 = time.perf_counter()
                again = session.step(request)
                answer(again.results, pb.StepResponse(), False, again.block)
                repeated.append(time.perf_counter() - t0)
                if not (again.rows == outcome.rows).all():
                    raise SystemExit(f"step {k}: the repeat's rows differ")
                if again.release:
                    again.release()
                outcome.release = None
            return outcome

        def engine_alone(tokens=tokens):
            t0 = time.perf_counter()
            engine.consume_batch(bare, [[t] for t in tokens])
            engine.fill_batch(bare, list(range(args.batch)), None, rows)
            alone.append(time.perf_counter() - t0)

        if k % 2:
            outcome = step_protocol()
            engine_alone()
        else:
            engine_alone()
            outcome = step_protocol()
        if not (outcome.rows == rows).all():
            raise SystemExit(f"step {k}: the session's rows differ from the engine's")
        if outcome.release:
            outcome.release()
    s, e = np.median(stepped) * 1e3, np.median(alone) * 1e3
    print(f"batch {args.batch}, {args.mode} mode, {len(stepped)} steps: Session.step + answers p50 {s:.3f} ms, "
          f"engine consume + fill p50 {e:.3f} ms: the step protocol {s - e:+.3f} ms "
          f"({(s - e) / args.batch * 1e3:.1f} us a sequence)")
    if repeated:
        print(f"  the same request again (a lockstep rank's repeat): p50 {np.median(repeated) * 1e3:.3f} ms "
              f"({np.median(repeated) / args.batch * 1e6:.1f} us a sequence)")
    for key, values in phases.items():
        print(f"  {key:8s} p50 {np.median(values) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
