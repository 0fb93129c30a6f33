"""``maskd bench serve``: a simulated GPU worker's decode loop through maskd.

The worker keeps B sequences in flight. Each replays the token stream of a MaskBench valid
instance; a finished one is closed and its slot refilled with the next instance, so the batch
stays full. Per batch size there are two phases, each on a fresh session stream:

``service`` (synchronous, no forward pass)
    Each step: ``step`` (request sent; the reply's rows decoded straight into the host buffer
    of ``BitmaskBuffers``, its ``out``) -> rows materialized as an int32 tensor = the step
    service time. Right after it, the same step in process: llguidance matchers mirroring the
    server's (one ``LLMatcher`` per sequence, ``deep_copy`` of a per-schema template on open)
    consume the same tokens, then ``fill_next_token_bitmask_par`` with an ``LLExecutor`` of the
    server's thread count fills the same batch = the in-process fill. Both are measured in the
    same steps, so differences and ratios are paired; the rows must be equal bit for bit.

``pipelined`` (the way a real worker uses maskd)
    Each step: the forward pass (``time.sleep(forward_ms)``, which releases the GIL as a GPU
    kernel launch would) -> ``result()`` of the previous ``step_async`` (the mask wait: zero
    when the reply was already there) -> rows to a tensor -> "sample" = the instance's next
    token, checked against its row (violations must be 0) -> ``step_async`` at once.

Then the server's resident memory per 1,000 live sequences: a ``maskd serve`` child process,
RSS before and after opening N sequences (grammars registered before the first reading, so
only per-sequence state counts) and advancing each by its instance's tokens but the last.
"""
from __future__ import annotations

import dataclasses
import gc
import time

import numpy as np

from maskd_tools.bench import common
from maskd_tools.progress import bar

QUICK_LIMIT = 48
QUICK_STEPS = 20
DEFAULT_STEPS = 200


@dataclasses.dataclass
class _ClientSlot:
    """A batch position stepped through the MaskClient session: its sequence and what it sends next."""
    sid: str
    inst: common.Instance
    applied: int = 0          # tokens the server has applied (as of the last reply)
    send: tuple = ()          # tokens the next request carries
    new: bool = True          # the next request opens it


class _Mirror(common.InProcessEngine):
    """The same batch in process: llguidance matchers replaying the server's sequences."""

    def step(self, plan) -> tuple[float, float, float]:
        """Applies one step's plan [(slot, new, schema, tokens)]; returns (open, consume, fill) seconds."""
        t0 = time.perf_counter()
        for i, new, schema, _ in plan:
            if new:
                self.open(i, schema)
        t1 = time.perf_counter()
        self.consume((i, tokens[0]) for i, _, _, tokens in plan if tokens)
        t2 = time.perf_counter()
        self.fill()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2


class _Batch:
    """B slots replaying instances through one MaskClient session."""

    def __init__(self, mc, pool: list[common.Instance], batch: int, eos: int, tag: str, start: int,
                 mirror: _Mirror | None = None) -> None:
        self.mc, self.pool, self.eos, self.tag = mc, pool, eos, tag
        self.cursor = start
        self.counter = 0
        self.mirror = mirror
        self.violations = self.eos_violations = self.failed = self.waiting = self.completed = 0
        self.masks_checked = 0
        self.slots: list[_ClientSlot] = [self._new_slot() for _ in range(batch)]

    def _new_slot(self) -> _ClientSlot:
        inst = self.pool[self.cursor % len(self.pool)]
        self.cursor += 1
        sid = f"{self.tag}-{self.counter}"
        self.counter += 1
        self.mc.open(sid, inst.spec_pb)
        if self.mirror is not None:
            self.mirror.template(inst.schema)   # compiled ahead, like a registered grammar
        return _ClientSlot(sid, inst)

    def request(self) -> tuple[dict, list]:
        req = {s.sid: list(s.send) for s in self.slots}
        plan = [(i, s.new, s.inst.schema, s.send) for i, s in enumerate(self.slots)]
        for s in self.slots:
            s.new = False
        return req, plan

    def sample(self, result, rows_np: np.ndarray) -> None:
        """Checks each sequence's next token (or EOS) against its row; sets what the next step sends.
        The result's arrays follow the request's order, which is the slots' order."""
        from maskd_client import SeqStatus

        status = result.status
        waiting = status == SeqStatus.WAITING
        has_rows = (status == SeqStatus.READY) | (status == SeqStatus.FINISHED)
        self.waiting += int(waiting.sum())
        check_slots, check_rows, check_tokens = [], [], []
        rows = result.row.tolist()
        for i, (s, w, h) in enumerate(zip(self.slots, waiting.tolist(), has_rows.tolist())):
            if w:
                s.send = ()
                continue
            if not h:
                self.failed += 1
                self._refill(i)
                continue
            s.applied += len(s.send)
            check_slots.append(i)
            check_rows.append(rows[i])
            check_tokens.append(s.inst.tokens[s.applied] if s.applied < len(s.inst.tokens) else self.eos)
        ok = common.allowed(rows_np, np.asarray(check_rows), np.asarray(check_tokens))
        self.masks_checked += len(check_slots)
        for i, tok, good in zip(check_slots, check_tokens, ok.tolist()):
            s = self.slots[i]
            at_end = s.applied >= len(s.inst.tokens)
            if at_end or not good:
                if not good:
                    if at_end:
                        self.eos_violations += 1
                    else:
                        self.violations += 1
                else:
                    self.completed += 1
                self._refill(i)
            else:
                s.send = (tok,)

    def _refill(self, i: int) -> None:
        self.mc.close(self.slots[i].sid)
        self.slots[i] = self._new_slot()

    @staticmethod
    def rows_of(result) -> np.ndarray:
        return result.row.astype(np.int64)

    def counts(self) -> dict:
        return {"masks_checked": self.masks_checked, "token_violations": self.violations,
                "eos_violations": self.eos_violations, "failed": self.failed, "waiting_steps": self.waiting,
                "instances_completed": self.completed}


def _client(address: str):
    from maskd_client import MaskClient
    return MaskClient(address, want_forced_tokens=False, timeout_s=600)


def _service_phase(address, tok, pool, batch, threads, steps, warmup, start, materializer) -> dict:
    mirror = _Mirror(tok, threads, batch)
    rec = {k: [] for k in ("service", "fill", "consume", "open", "server", "round_trip", "materialize")}
    mismatched_rows = 0
    with _client(address) as mc:
        b = _Batch(mc, pool, batch, tok.eos_token_ids[0], f"svc{batch}", start, mirror)
        for k in bar(range(warmup + steps), desc=f"B={batch} steps", unit="step"):
            req, plan = b.request()
            t0 = time.perf_counter()
            res = mc.step(req, out=materializer.out(batch))     # rows decoded into the upload's buffer
            t1 = time.perf_counter()
            rows = materializer(res.bitmask)
            t2 = time.perf_counter()
            t_open, t_consume, t_fill = mirror.step(plan)
            idx = b.rows_of(res)
            have = idx >= 0
            mismatched_rows += int((rows[idx[have]] != mirror.bm[have]).any(axis=1).sum())
            if k >= warmup:
                rec["service"].append(t2 - t0)
                rec["materialize"].append(t2 - t1)
                rec["server"].append(res.server_seconds)
                rec["round_trip"].append(res.round_trip_seconds)
                rec["fill"].append(t_fill)
                rec["consume"].append(t_consume)
                rec["open"].append(t_open)
            b.sample(res, rows)
        counts = b.counts()
    service, fill = np.asarray(rec["service"]), np.asarray(rec["fill"])
    inproc = fill + np.asarray(rec["consume"])
    s_p50, f_p50, i_p50 = (float(np.median(x)) * 1e3 for x in (service, fill, inproc))
    return {
        "steps": len(service),
        "service_ms": common.summarize(service),
        "inprocess_fill_ms": common.summarize(fill),
        "inprocess_consume_ms": common.summarize(rec["consume"]),
        "inprocess_fill_plus_consume_ms": common.summarize(inproc),
        "inprocess_open_ms": common.summarize(rec["open"]),
        "server_seconds_ms": common.summarize(rec["server"]),
        "round_trip_ms": common.summarize(rec["round_trip"]),
        "materialize_ms": common.summarize(rec["materialize"]),
        "p50_service_minus_fill_ms": round(s_p50 - f_p50, 4),
        "p50_service_over_fill": round(s_p50 / f_p50, 2) if f_p50 else None,
        "p50_service_minus_fill_plus_consume_ms": round(s_p50 - i_p50, 4),
        "p50_service_over_fill_plus_consume": round(s_p50 / i_p50, 2) if i_p50 else None,
        "paired_service_minus_fill_ms": common.summarize(service - fill),
        "paired_service_over_fill": common.summarize(service / np.maximum(fill, 1e-9), scale=1.0, digits=2),
        "rows_differing_from_in_process": mismatched_rows,
        **counts,
    }


def _pipelined_phase(address, tok, pool, batch, forward_s, steps, warmup, start, materializer) -> dict:
    rec = {k: [] for k in ("wait", "server", "round_trip", "materialize", "send", "period")}
    waited = 0
    with _client(address) as mc:
        b = _Batch(mc, pool, batch, tok.eos_token_ids[0], f"pipe{batch}", start)
        req, _ = b.request()
        fut = mc.step_async(req, out=materializer.out(batch))
        t_prev = time.perf_counter()
        for k in bar(range(warmup + steps), desc=f"B={batch} pipelined", unit="step"):
            time.sleep(forward_s)                       # forward pass t+1 (GIL released)
            done = fut.done()
            t0 = time.perf_counter()
            res = fut.result()
            t1 = time.perf_counter()
            rows = materializer(res.bitmask)
            t2 = time.perf_counter()
            b.sample(res, rows)
            req, _ = b.request()
            t3 = time.perf_counter()
            fut = mc.step_async(req, out=materializer.out(batch))
            t4 = time.perf_counter()
            if k >= warmup:
                rec["wait"].append(0.0 if done else t1 - t0)
                waited += 0 if done else 1
                rec["materialize"].append(t2 - t1)
                rec["send"].append(t4 - t3)
                rec["server"].append(res.server_seconds)
                rec["round_trip"].append(res.round_trip_seconds)
                rec["period"].append(t4 - t_prev)
            t_prev = t4
        fut.result()
        counts = b.counts()
    wait = np.asarray(rec["wait"])
    return {
        "steps": len(wait),
        "forward_ms": forward_s * 1e3,
        "mask_wait_ms": common.summarize(wait),
        "waited_steps": waited,
        "waited_share": round(waited / max(1, len(wait)), 4),
        "round_trip_ms": common.summarize(rec["round_trip"]),
        "server_seconds_ms": common.summarize(rec["server"]),
        "materialize_ms": common.summarize(rec["materialize"]),
        "client_send_ms": common.summarize(rec["send"]),
        "step_period_ms": common.summarize(rec["period"]),
        **counts,
    }


def _memory(args, tok, pool, n: int, log) -> dict:
    """RSS of a `maskd serve` child while n sequences are opened in chunks.

    Each sequence is opened and advanced by its instance's tokens but the last (so it stays
    live, mid-document). RSS is read after every chunk; the figure per 1,000 sequences is the
    least-squares slope over those readings, which is less sensitive than one before/after
    difference to the allocator reusing memory freed before the first reading.
    """
    import psutil

    from maskd_client import SeqStatus

    out: dict = {"sequences_requested": n}
    log_path = common.pathlib.Path(args.out) / "memory-server.log"
    chunk = max(1, min(128, n // 8 or 1))
    with common.subprocess_server(args.tokenizer, args.threads, log_path=log_path) as srv:
        proc = psutil.Process(srv.pid)
        with _client(srv.address) as mc:
            schemas = {i.schema.name: i.schema for i in pool}
            errors = common.register_all(mc, list(schemas.values()))
            time.sleep(1.0)
            rss0 = proc.memory_info().rss
            points = [(0, rss0)]
            live = tokens_applied = 0
            for start in range(0, n, chunk):
                insts = [pool[(start + j) % len(pool)] for j in range(min(chunk, n - start))]
                sids = [f"mem-{start + j}" for j in range(len(insts))]
                for sid, inst in zip(sids, insts):
                    mc.open(sid, inst.spec_pb)
                mc.step({sid: [] for sid in sids})
                advance = {sid: inst.tokens[:max(0, min(len(inst.tokens) - 1, 4000))]
                           for sid, inst in zip(sids, insts)}
                res = mc.step(advance)
                for sid in sids:
                    if res.seqs[sid].status in (SeqStatus.READY, SeqStatus.FINISHED):
                        live += 1
                        tokens_applied += len(advance[sid])
                points.append((live, proc.memory_info().rss))
            time.sleep(1.0)
            rss1 = proc.memory_info().rss
            points.append((live, rss1))
    xs = np.asarray([p[0] for p in points], dtype=np.float64)
    ys = np.asarray([p[1] for p in points], dtype=np.float64)
    slope = float(np.polyfit(xs, ys, 1)[0]) if len(set(xs.tolist())) > 1 else 0.0
    out.update({"live_sequences": live, "tokens_applied": tokens_applied,
                "mean_tokens_per_sequence": round(tokens_applied / max(1, live), 1),
                "rss_before_mib": round(rss0 / 2**20, 1), "rss_after_mib": round(rss1 / 2**20, 1),
                "rss_difference_per_1000_sequences_mib": round((rss1 - rss0) / max(1, live) * 1000 / 2**20, 2),
                "rss_per_1000_sequences_mib": round(slope * 1000 / 2**20, 2),
                "rss_readings_mib": [[int(x), round(y / 2**20, 1)] for x, y in zip(xs, ys)],
                "grammars_registered": len(schemas) - len(errors)})
    log(f"  memory: {live} live sequences: RSS {out['rss_before_mib']} -> {out['rss_after_mib']} MiB, "
        f"{out['rss_per_1000_sequences_mib']} MiB per 1,000 (slope; difference "
        f"{out['rss_difference_per_1000_sequences_mib']})")
    return out


def run(args, log=print) -> dict:

    from maskd.server.tokenizers import load_tokenizer

    limit = args.limit if args.limit is not None else (QUICK_LIMIT if args.quick else None)
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    mem_n = args.memory_sequences if args.memory_sequences is not None else 1000
    batches = common.positive_list(args.batch_sizes, int, "--batch-sizes", "maskd bench serve")
    out = common.Output(args.out, "serve", args.json_out)
    t_start = time.perf_counter()

    tok = load_tokenizer(args.tokenizer)
    schemas = [s for s in common.load_schemas(args.data, tok, limit) if s.instances]
    materializer = common.Materializer(max(batches), (tok.logits_width + 31) // 32)
    placement = common.placement_from(args)
    server_threads = len(placement.server_cpus) if placement else args.threads
    baseline_threads = len(placement.worker_cpus) if placement else args.threads
    srv = common.open_server(args.server, args.tokenizer, server_threads, args.target,
                             log_path=common.pathlib.Path(args.out) / "server.log",
                             cpus=placement.server_cpus if placement else None)
    try:
        with common.pinned_here(placement.worker_cpus if placement else None):
            with _client(srv.address) as mc:
                info = mc.info()
                errors = common.register_all(mc, schemas)
            pool = common.instance_pool(schemas, errors, args.seed, "serve")
            log(f"serve: {len(pool)} instances of {len(schemas) - len(errors)} schemas "
                f"({len(errors)} do not compile), server {srv.kind} at {srv.address}, {server_threads} fill threads "
                f"(in-process baseline {baseline_threads}), "
                + (placement.describe() + ", " if placement else "")
                + f"forward {args.forward_ms:g} ms, {steps} steps per phase")
            results = []
            start = 0
            for batch in batches:
                gc.collect()
                svc = _service_phase(srv.address, tok, pool, batch, baseline_threads, steps, warmup, start,
                                     materializer)
                pipe = _pipelined_phase(srv.address, tok, pool, batch, args.forward_ms / 1e3, steps, warmup, start,
                                        materializer)
                start += batch * 7
                results.append({"batch": batch, "service": svc, "pipelined": pipe})
                log(f"  B={batch:>4}: service p50 {svc['service_ms']['p50']:.3f} ms vs in-process consume + fill p50 "
                    f"{svc['inprocess_fill_plus_consume_ms']['p50']:.3f} ms "
                    f"(+{svc['p50_service_minus_fill_plus_consume_ms']:.3f} ms, "
                    f"x{svc['p50_service_over_fill_plus_consume']}); "
                    f"mask wait p50/p99/max {pipe['mask_wait_ms']['p50']:.3f}/"
                    f"{pipe['mask_wait_ms']['p99']:.3f}/{pipe['mask_wait_ms']['p100']:.3f} ms, waited "
                    f"{pipe['waited_share']:.0%} of steps; "
                    f"violations {svc['token_violations'] + pipe['token_violations']}")
    finally:
        srv.close()
    memory = None
    if mem_n > 0 and not args.target:
        memory = _memory(args, tok, pool, mem_n, log)

    violations = sum(r[p][k] for r in results for p in ("service", "pipelined")
                     for k in ("token_violations", "eos_violations", "failed"))
    mismatches = sum(r["service"]["rows_differing_from_in_process"] for r in results)
    report = {
        "mode": "serve",
        "args": common.args_dict(args, limit=limit, steps=steps, warmup=warmup, memory_sequences=mem_n),
        "machine": common.machine_info(),
        "data": str(args.data),
        "tokenizer": tok.spec,
        "vocab_size": tok.vocab_size,
        "words_per_row": info.words_per_row,
        "placement": placement.as_dict() if placement else None,
        "baseline_threads": baseline_threads,
        "server": {"kind": srv.kind, "address": srv.address, "threads": server_threads,
                   "backend": info.backend, "backend_version": info.backend_version},
        "materialize": materializer.kind,
        "schemas": len(schemas),
        "schemas_not_compiling": len(errors),
        "instances": len(pool),
        "forward_ms": args.forward_ms,
        "batches": results,
        "memory": memory,
        "violations": violations,
        "rows_differing_from_in_process": mismatches,
        # Rows that differ from llguidance in process are a server or wire bug; a valid token a
        # row rejects may be the engine's own false reject (maskd bench wire tells which).
        "failed": bool(mismatches),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    report["targets"] = _targets(report)
    _plots(out, report)
    out.write(report, _markdown(report))
    return report


def _targets(r: dict) -> dict:
    by_b = {x["batch"]: x for x in r["batches"]}
    t = {}
    if 64 in by_b:
        d = by_b[64]["service"]["p50_service_minus_fill_plus_consume_ms"]
        t["b64_p50_service_within_1ms_of_consume_plus_fill"] = {"difference_ms": d, "met": d <= 1.0,
                                                                "pinned": r.get("placement") is not None}
    if 256 in by_b:
        p = by_b[256]["pipelined"]
        t["b256_999_permille_of_steps_wait_0"] = {
            "forward_ms": p["forward_ms"], "waited_steps": p["waited_steps"], "steps": p["steps"],
            "max_wait_ms": p["mask_wait_ms"].get("p100"), "met": p["waited_steps"] <= 0.001 * p["steps"],
            "applies": abs(p["forward_ms"] - 20.0) < 1e-9}
    return t


def _plots(out: common.Output, r: dict) -> None:
    plt = common.pyplot()
    bs = [x["batch"] for x in r["batches"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    for key, label, style in (("service_ms", "maskd step service (sent -> tensor)", "o-"),
                              ("inprocess_fill_ms", "in-process fill (same batch, same threads)", "s--"),
                              ("inprocess_fill_plus_consume_ms", "in-process consume + fill", "^:")):
        p50 = [x["service"][key]["p50"] for x in r["batches"]]
        p99 = [x["service"][key]["p99"] for x in r["batches"]]
        line, = ax1.plot(bs, p50, style, label=f"{label}, p50")
        ax1.fill_between(bs, p50, p99, color=line.get_color(), alpha=0.12)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(bs, [str(b) for b in bs])
    ax1.set_xlabel("batch size (sequences per step)")
    ax1.set_ylabel("ms per step (line p50, band to p99)")
    ax1.set_title(f"Step service time, {r['server']['threads']} fill threads")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8, loc="upper left")
    x = np.arange(len(bs))
    w = 0.25
    for j, (q, lab) in enumerate((("p50", "p50"), ("p99", "p99"), ("p100", "max"))):
        vals = [b["pipelined"]["mask_wait_ms"].get(q, 0.0) for b in r["batches"]]
        ax2.bar(x + (j - 1) * w, vals, w, label=lab)
    ax2.set_xticks(x, [f"{b['batch']}\n(waited in {b['pipelined']['waited_share']:.0%} of steps)"
                       for b in r["batches"]], fontsize=8)
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("mask wait after the forward pass, ms")
    ax2.set_title(f"Mask wait with a {r['forward_ms']:g} ms forward pass")
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.path("serve.png"))
    plt.close(fig)


def _markdown(r: dict) -> str:
    m = r["machine"]
    lines = ["# maskd bench serve\n",
             f"{r['instances']} valid instances of {r['schemas'] - r['schemas_not_compiling']} MaskBench schemas "
             f"from `{r['data']}`, tokenizer `{r['tokenizer']}` ({r['vocab_size']:,} tokens, "
             f"{4 * r['words_per_row']:,} B per dense row); server {r['server']['kind']}, "
             f"{r['server']['threads']} fill threads, in-process baseline {r['baseline_threads']} threads; "
             + (f"pinned: server on CPUs {r['placement']['server_cpus']}, worker (client and baseline) on CPUs "
                f"{r['placement']['worker_cpus']}; " if r.get("placement") else "not pinned; ")
             + f"rows materialized with {r['materialize']}; "
             f"{r['args']['steps']} measured steps per batch size and phase.\n",
             f"Machine: {common.machine_line(m)}.\n",
             "\n## Step service time (request sent -> rows as a tensor) vs in-process fill, ms\n\n"]
    rows = []
    for b in r["batches"]:
        s = b["service"]
        rows.append([b["batch"], s["service_ms"]["p50"], s["service_ms"]["p99"], s["inprocess_fill_ms"]["p50"],
                     s["inprocess_fill_ms"]["p99"], s["p50_service_minus_fill_ms"], s["p50_service_over_fill"],
                     s["inprocess_fill_plus_consume_ms"]["p50"], s["p50_service_minus_fill_plus_consume_ms"],
                     s["server_seconds_ms"]["p50"], s["materialize_ms"]["p50"]])
    lines.append(common.md_table(["batch", "service p50", "service p99", "fill p50", "fill p99",
                                  "p50 diff", "p50 ratio", "consume+fill p50", "p50 diff vs consume+fill",
                                  "server_seconds p50", "materialize p50"], rows))
    lines.append(f"\n## Mask wait after a {r['forward_ms']:g} ms forward pass (pipelined step_async), ms\n\n")
    rows = []
    for b in r["batches"]:
        p = b["pipelined"]
        rows.append([b["batch"], p["steps"], p["mask_wait_ms"]["p50"], p["mask_wait_ms"]["p99"],
                     p["mask_wait_ms"]["p100"], f"{p['waited_share']:.1%}", p["round_trip_ms"]["p50"],
                     p["round_trip_ms"]["p99"], p["client_send_ms"]["p50"], p["step_period_ms"]["p50"]])
    lines.append(common.md_table(["batch", "steps", "wait p50", "wait p99", "wait max", "steps that waited",
                                  "round trip p50", "round trip p99", "step_async call p50",
                                  "decode step period p50"], rows))
    checks = sum(b[p]["masks_checked"] for b in r["batches"] for p in ("service", "pipelined"))
    lines.append(f"\nTokens checked against their rows: {checks:,}; violations (token, EOS, failed): "
                 f"{r['violations']}; rows differing from in-process: {r['rows_differing_from_in_process']}.\n")
    mem = r.get("memory")
    if mem:
        lines.append(f"\n## Server memory\n\n{mem['live_sequences']:,} live sequences (each advanced by "
                     f"{mem['mean_tokens_per_sequence']} tokens on average) in a `maskd serve` child: RSS "
                     f"{mem['rss_before_mib']} -> {mem['rss_after_mib']} MiB; "
                     f"**{mem['rss_per_1000_sequences_mib']} MiB per 1,000 live sequences** (slope over "
                     f"{len(mem['rss_readings_mib'])} readings; the plain difference gives "
                     f"{mem['rss_difference_per_1000_sequences_mib']}); {mem['grammars_registered']} grammars "
                     "registered before the first reading.\n")
    lines += common.targets_markdown(r.get("targets"))
    return "\n".join(lines)
