"""``maskd bench wire``: bytes per mask row, per encoding and as the server actually sent them.

Valid MaskBench instances are replayed through a real server, B sequences per session stream
(each instance once, in a seeded random order; a finished sequence is closed and its slot
refilled in the same step message). The stream is driven with the bare gRPC stub so every
``StepResponse`` is seen as it came off the wire; rows are decoded with ``RowDecoder`` (and
every sampled token checked against its row).

Per row:

- ``sent``: the bytes the row takes in the serialized ``StepResponse``: its ``MaskRow``
  message plus the field's tag and length prefix (a DICT_REF row is ~4 bytes);
- ``payload``: ``len(data)``, or for DICT_REF the bytes of the ``ref`` varint (what the
  server's ``maskd_row_bytes`` histogram counts);
- ``dense`` / ``allowed_ids`` / ``rejected_ids``: what that one encoding would take for the row
  (``maskd.rowcodec.encoded_sizes`` on the decoded row, i.e. the size of ``data``);
- ``smallest_of_three``: the per-row minimum of those three (adaptive, no row dictionary).

Per step: ``message`` = ``StepResponse.ByteSize()`` + the 5-byte gRPC message prefix; divided
by the rows, ``message_per_row`` is everything the reply carries per row (results, ids).
"""
from __future__ import annotations

import hashlib
import queue
import random
import time
import uuid

import numpy as np

from maskd.tools.bench import common
from maskd.tools.progress import bar

QUICK_LIMIT = 48
QUICK_MAX_ROWS = 3000
ENCODINGS = ("dense", "allowed_ids", "rejected_ids")


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


class _RawStream:
    """One Session stream, one request at a time, raw StepResponses back."""

    def __init__(self, address: str) -> None:
        import grpc

        from maskd.v1 import maskd_pb2 as pb
        from maskd.v1 import maskd_pb2_grpc as pb_grpc

        self.pb = pb
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1),
                                                               ("grpc.max_send_message_length", -1)])
        stub = pb_grpc.MaskServiceStub(self.channel)
        self.info = stub.Info(pb.InfoRequest(), timeout=60, wait_for_ready=True)
        self.stub = stub
        self._q: queue.Queue = queue.Queue()

        def requests():
            while True:
                item = self._q.get()
                if item is None:
                    return
                yield item

        self._call = stub.Session(requests(), metadata=(("maskd-session", f"bench-wire-{uuid.uuid4().hex}"),))
        self._it = iter(self._call)

    def register(self, spec_pb) -> str | None:
        import grpc
        try:
            self.stub.RegisterGrammar(self.pb.RegisterGrammarRequest(spec=spec_pb, wait=True), timeout=600)
            return None
        except grpc.RpcError as exc:
            return exc.details() or str(exc.code())

    def step(self, request):
        self._q.put(request)
        return next(self._it)

    def close(self) -> None:
        self._q.put(None)
        self._call.cancel()
        self.channel.close()


def _run_batch(address, pool, batch: int, max_rows: int | None, eos: int, width: int, ll) -> dict:
    from maskd.rowcodec import DEFAULT_DICT_SIZE, ENCODING_NAMES, RowDecoder, encoded_sizes

    stream = _RawStream(address)
    pb = stream.pb
    info = stream.info
    decoder = RowDecoder(info.words_per_row, info.logits_width,
                         dict_size=getattr(info, "row_dictionary_size", 0) or DEFAULT_DICT_SIZE)
    sizes = {k: [] for k in ("sent", "payload") + ENCODINGS}
    chosen: list[str] = []
    message_bytes, request_bytes, server_s = [], [], []
    violations = failed = completed = 0
    bad: list[dict] = []
    digests: list[bytes] = []
    source = iter(pool)
    slots: list[list] = []        # [seq_id, instance, applied, step, send, new]
    counter = 0
    closes: list[tuple[str, int]] = []

    def fresh():
        nonlocal counter
        inst = next(source, None)
        if inst is None:
            return None
        counter += 1
        return [f"w{batch}-{counter}", inst, 0, 0, (), True]

    for _ in range(batch):
        s = fresh()
        if s is None:
            break
        slots.append(s)
    rows_bar = bar(total=max_rows, desc=f"B={batch} rows", unit="row")
    try:
        while slots and (max_rows is None or len(sizes["sent"]) < max_rows):
            rows_bar.update(len(sizes["sent"]) - rows_bar.n)
            req = pb.StepRequest()
            for sid, step in closes:
                req.seqs.add(seq_id=sid, step=step, close=True)
            closes.clear()
            for s in slots:
                e = req.seqs.add(seq_id=s[0], step=s[3], tokens=list(s[4]))
                if s[5]:
                    e.spec.CopyFrom(s[1].spec_pb)
                    s[5] = False
            request_bytes.append(req.ByteSize() + 5)
            reply = stream.step(req)
            rows = decoder.decode(reply)
            message_bytes.append(reply.ByteSize() + 5)
            server_s.append(reply.server_seconds)
            for mr in reply.rows:
                n = mr.ByteSize()
                sizes["sent"].append(1 + _varint_len(n) + n)
                sizes["payload"].append(_varint_len(mr.ref) if mr.encoding == pb.ROW_ENCODING_DICT_REF
                                        else len(mr.data))
                chosen.append(ENCODING_NAMES.get(mr.encoding, str(mr.encoding)))
            for row in rows:
                es = encoded_sizes(row, width)
                for k in ENCODINGS:
                    sizes[k].append(es[k])
                digests.append(hashlib.blake2b(row.tobytes(), digest_size=16).digest())
            by_id = {r.seq_id: r for r in reply.results}
            keep = []
            for s in slots:
                r = by_id[s[0]]
                if r.status == pb.SEQ_STATUS_WAITING:
                    s[4] = ()
                    keep.append(s)
                    continue
                if r.status not in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FINISHED):
                    failed += 1
                    closes.append((s[0], s[3]))
                    s = fresh()
                    if s is not None:
                        keep.append(s)
                    continue
                s[2] += len(s[4])
                tokens = s[1].tokens
                tok = tokens[s[2]] if s[2] < len(tokens) else eos
                ok = bool(common.allowed(rows, [r.first_row], [tok])[0])
                if s[2] >= len(tokens) or not ok:
                    if not ok:
                        violations += 1
                        bad.append({"file": s[1].schema.name, "position": s[2], "token": int(tok),
                                    "encoding": ENCODING_NAMES.get(reply.rows[r.first_row].encoding, "?"),
                                    "_inst": s[1]})
                    else:
                        completed += 1
                    closes.append((s[0], s[3]))
                    s = fresh()
                    if s is not None:
                        keep.append(s)
                    continue
                s[3] += 1
                s[4] = (tok,)
                keep.append(s)
            slots = keep
    finally:
        rows_bar.close()
        stream.close()
    return {"sizes": sizes, "chosen": chosen, "digests": digests, "message_bytes": message_bytes,
            "request_bytes": request_bytes,
            "server_seconds": server_s, "violations": violations, "failed": failed, "completed": completed,
            "dict_size": decoder.dict_size, "violation_examples": _judge(bad[:50], ll, width)}


def _judge(bad: list[dict], ll, width: int) -> list[dict]:
    """Replays each violation in process: does llguidance itself reject the token there (an
    engine false reject on a valid instance), or did the row change on the way (a codec bug)?"""
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask

    out = []
    for v in bad:
        inst = v.pop("_inst")
        m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(inst.schema.text), log_level=0)
        consumed = m.consume_tokens(inst.tokens[:v["position"]]) if v["position"] else True
        bm = np.zeros((1, (width + 31) // 32), dtype=np.int32)
        fill_next_token_bitmask(m, bm, 0)
        v["in_process_allows"] = bool(consumed) and bool(common.allowed(bm, [0], [v["token"]])[0])
        v["cause"] = "wire" if v["in_process_allows"] else "engine"
        out.append(v)
    return out


def _maskrow_wire_bytes(encoding: int, data_len: int, ref: int) -> int:
    """Bytes of one MaskRow in a serialized StepResponse (field tag + length + message, proto3)."""
    msg = (2 if encoding else 0) + ((1 + _varint_len(data_len) + data_len) if data_len else 0) \
        + ((1 + _varint_len(ref)) if ref else 0)
    return 1 + _varint_len(msg) + msg


DICT_SIZES = (0, 16, 64, 256, 1024, 4096)


def simulate_dictionary(digests: list[bytes], best_enc: np.ndarray, best_len: np.ndarray,
                        dict_size: int, row_bytes: int) -> dict:
    """Mean wire bytes per row if the stream had a row dictionary of ``dict_size`` rows (the
    rowcodec rule: a non-REF row is inserted at slot counter % D; a row present is sent as a
    reference), the other rows in the smallest of the three encodings."""
    slots: list[bytes | None] = [None] * dict_size
    index: dict[bytes, int] = {}
    counter = total = refs = 0
    for dig, enc, n in zip(digests, best_enc.tolist(), best_len.tolist()):
        if dict_size:
            slot = index.get(dig)
            if slot is not None:
                total += _maskrow_wire_bytes(3, 0, slot)
                refs += 1
                continue
        total += _maskrow_wire_bytes(enc, n, 0)
        if dict_size:
            k = counter % dict_size
            if slots[k] is not None:
                del index[slots[k]]
            slots[k] = dig
            index[dig] = k
            counter += 1
    rows = max(1, len(digests))
    return {"dict_size": dict_size, "bytes_per_row_mean": round(total / rows, 1),
            "dict_ref_share": round(refs / rows, 4),
            "dictionary_mib_per_stream_end": round(dict_size * row_bytes / 2**20, 2)}


def _summary(batch: int, raw: dict) -> dict:
    sz = {k: np.asarray(v, dtype=np.float64) for k, v in raw["sizes"].items()}
    rows = len(sz["sent"])
    smallest = np.minimum.reduce([sz[k] for k in ENCODINGS]) if rows else np.zeros(0)
    msgs = np.asarray(raw["message_bytes"], dtype=np.float64)
    out = {"batch": batch, "rows": rows, "steps": len(msgs), "dict_size": raw["dict_size"]}
    mean = lambda a: round(float(a.mean()), 1) if a.size else None
    out["bytes_per_row_sent_mean"] = mean(sz["sent"])
    out["bytes_per_row_payload_mean"] = mean(sz["payload"])
    for k in ENCODINGS:
        out[f"bytes_per_row_{k}_mean"] = mean(sz[k])
    out["bytes_per_row_smallest_of_three_mean"] = mean(smallest)
    chosen = np.asarray(raw["chosen"])
    ref = sz["sent"][chosen == "dict_ref"] if rows else np.zeros(0)
    out["bytes_per_row_dict_ref_mean"] = mean(ref)
    out["bytes_per_row_message_mean"] = round(float(msgs.sum() / max(1, rows)), 1)
    out["bytes_per_step_message_mean"] = mean(msgs)
    out["bytes_per_step_request_mean"] = mean(np.asarray(raw["request_bytes"], dtype=np.float64))
    out["sent_bytes_per_row"] = common.summarize(sz["sent"], scale=1.0, digits=1)
    names = ("dense", "allowed_ids", "rejected_ids", "dict_ref")
    out["sent_share"] = {n: round(float((chosen == n).mean()), 4) if rows else 0.0 for n in names}
    sent_total = max(1.0, float(sz["sent"].sum()))
    out["sent_bytes_by_encoding"] = {n: round(float(sz["sent"][chosen == n].sum()) / sent_total, 4)
                                     for n in names}
    out["server_seconds_ms"] = common.summarize(raw["server_seconds"])
    if rows:
        stacked = np.stack([sz[k] for k in ENCODINGS])            # ties go to the lower enum value
        best_enc = np.argmin(stacked, axis=0)
        best_len = stacked[best_enc, np.arange(rows)].astype(np.int64)
        out["dictionary_size_simulation"] = [simulate_dictionary(raw["digests"], best_enc, best_len, d,
                                                                 int(sz["dense"][0]))
                                             for d in sorted(set(DICT_SIZES) | {raw["dict_size"]})]
    out["token_violations"] = raw["violations"]
    ex = raw["violation_examples"]
    out["violations_engine"] = sum(1 for v in ex if v["cause"] == "engine")
    out["violations_wire"] = sum(1 for v in ex if v["cause"] == "wire")
    out["violation_examples"] = ex
    out["failed"] = raw["failed"]
    out["instances_completed"] = raw["completed"]
    return out


def run(args, log=print) -> dict:
    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tools.bench.serve import _Instance

    limit = args.limit if args.limit is not None else (QUICK_LIMIT if args.quick else None)
    max_rows = args.max_rows if args.max_rows is not None else (QUICK_MAX_ROWS if args.quick else None)
    batches = [int(x) for x in str(args.batch_sizes).split(",") if x.strip()]
    out = common.Output(args.out, "wire", args.json_out)
    t_start = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    schemas = [s for s in common.load_schemas(args.data, tok, limit) if s.instances]
    srv = common.open_server(args.server, args.tokenizer, args.threads, args.target,
                             log_path=common.pathlib.Path(args.out) / "server.log")
    results = []
    try:
        reg = _RawStream(srv.address)
        info = reg.info
        errors = {}
        specs = {}
        for s in schemas:
            specs[s.name] = GrammarSpec.from_dict(s.spec).to_proto()
            err = reg.register(specs[s.name])
            if err:
                errors[s.name] = err
        reg.close()
        pool = [_Instance(s, specs[s.name], t) for s in schemas if s.name not in errors for t in s.instances if t]
        random.Random(args.seed).shuffle(pool)
        log(f"wire: {len(pool)} instances of {len(schemas) - len(errors)} schemas, server {srv.kind} at "
            f"{srv.address}, dense row {4 * info.words_per_row:,} B")
        for batch in batches:
            raw = _run_batch(srv.address, pool, batch, max_rows, tok.eos_token_ids[0], info.logits_width, tok.ll)
            res = _summary(batch, raw)
            results.append(res)
            log(f"  B={batch}: {res['rows']:,} rows, sent {res['bytes_per_row_sent_mean']} B/row (payload "
                f"{res['bytes_per_row_payload_mean']}), smallest of three "
                f"{res['bytes_per_row_smallest_of_three_mean']}, "
                f"allowed ids {res['bytes_per_row_allowed_ids_mean']}, dict refs {res['sent_share']['dict_ref']:.0%}")
    finally:
        srv.close()
    primary = next((r for r in results if r["batch"] == 64), results[0] if results else {})
    report = {
        "mode": "wire",
        "args": common.args_dict(args, limit=limit, max_rows=max_rows),
        "machine": common.machine_info(),
        "data": str(args.data),
        "tokenizer": tok.spec,
        "vocab_size": tok.vocab_size,
        "logits_width": info.logits_width,
        "dense_row_bytes": 4 * info.words_per_row,
        "server": {"kind": srv.kind, "address": srv.address, "row_encodings": list(info.row_encodings),
                   "row_dictionary_size": getattr(info, "row_dictionary_size", 0)},
        "schemas": len(schemas),
        "schemas_not_compiling": len(errors),
        "instances": len(pool),
        "primary_batch": primary.get("batch"),
        # The headline figures are those of the primary batch size (64 when measured).
        **{k: v for k, v in primary.items() if k.startswith("bytes_per_row_")},
        "batches": results,
        "token_violations": sum(r["token_violations"] for r in results),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    # A valid token the engine itself rejects is the engine's (reported); one the engine allows
    # but the decoded row rejects is a wire bug and fails the run.
    report["violations_wire"] = sum(r["violations_wire"] for r in results)
    report["violations_engine"] = sum(r["violations_engine"] for r in results)
    report["failed"] = bool(report["violations_wire"])
    report["targets"] = {"bytes_per_row_sent_mean_at_most_200": {
        "value": report.get("bytes_per_row_sent_mean"), "batch": primary.get("batch"),
        "met": (report.get("bytes_per_row_sent_mean") or 1e9) <= 200}}
    _plots(out, report)
    out.write(report, _markdown(report))
    return report


def _plots(out: common.Output, r: dict) -> None:
    plt = common.pyplot()
    labels = ["dense", "allowed_ids", "rejected_ids", "smallest_of_three", "sent", "message"]
    keys = ["bytes_per_row_dense_mean", "bytes_per_row_allowed_ids_mean", "bytes_per_row_rejected_ids_mean",
            "bytes_per_row_smallest_of_three_mean", "bytes_per_row_sent_mean", "bytes_per_row_message_mean"]
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    n = len(r["batches"])
    w = 0.8 / max(1, n)
    x = np.arange(len(labels))
    for j, b in enumerate(r["batches"]):
        vals = [b.get(k) or 0 for k in keys]
        bars = ax.bar(x + (j - (n - 1) / 2) * w, vals, w, label=f"batch {b['batch']} ({b['rows']:,} rows)")
        for rect, v in zip(bars, vals):
            ax.annotate(f"{v:,.0f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.axhline(200, color="gray", linestyle="--", linewidth=1, label="target: 200 B/row")
    ax.set_yscale("log")
    ax.set_xticks(x, ["dense", "allowed ids", "rejected ids", "smallest of\nthe three", "sent\n(adaptive + dict)",
                      "whole reply\nper row"])
    ax.set_ylabel("mean bytes per row (log scale)")
    ax.set_title(f"Mask row bytes, tokenizer {r['tokenizer']} ({r['vocab_size']:,} tokens)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.path("wire.png"))
    plt.close(fig)


def _markdown(r: dict) -> str:
    lines = ["# maskd bench wire\n",
             f"{r['instances']} valid instances of {r['schemas'] - r['schemas_not_compiling']} MaskBench schemas from "
             f"`{r['data']}`, tokenizer `{r['tokenizer']}` ({r['vocab_size']:,} tokens, dense row "
             f"{r['dense_row_bytes']:,} B); server {r['server']['kind']}.\n",
             f"Machine: {common.machine_line(r['machine'])}.\n",
             "## Mean bytes per row\n"]
    rows = []
    for b in r["batches"]:
        rows.append([b["batch"], b["rows"], b["bytes_per_row_sent_mean"], b["bytes_per_row_payload_mean"],
                     b["bytes_per_row_dense_mean"], b["bytes_per_row_allowed_ids_mean"],
                     b["bytes_per_row_rejected_ids_mean"], b["bytes_per_row_smallest_of_three_mean"],
                     b["bytes_per_row_message_mean"], f"{b['sent_share']['dict_ref']:.1%}"])
    lines.append(common.md_table(["batch", "rows", "sent", "payload", "dense", "allowed ids", "rejected ids",
                                  "smallest of three", "whole reply per row", "rows sent as dict refs"], rows))
    lines.append("## Encodings chosen (share of rows / share of sent bytes)\n")
    rows = [[b["batch"]] + [f"{b['sent_share'][n]:.1%} / {b['sent_bytes_by_encoding'][n]:.1%}"
                            for n in ("dense", "allowed_ids", "rejected_ids", "dict_ref")] for b in r["batches"]]
    lines.append(common.md_table(["batch", "dense", "allowed ids", "rejected ids", "dict ref"], rows))
    sims = [b for b in r["batches"] if b.get("dictionary_size_simulation")]
    if sims:
        sizes = [x["dict_size"] for x in sims[0]["dictionary_size_simulation"]]
        lines.append("## Row dictionary size (simulated on the same rows, mean bytes per row on the wire / share "
                     "of rows sent as references)\n")
        lines.append("The same rows in the same order, the rowcodec rule with D rows per stream; D = "
                     f"{r['server']['row_dictionary_size'] or 64} is what the server ran (it must match the measured "
                     "`sent`). Each end keeps D dense rows per stream "
                     f"({r['dense_row_bytes']:,} B each).\n")
        rows = [[b["batch"]] + [f"{x['bytes_per_row_mean']:,.1f} / {x['dict_ref_share']:.0%}"
                                for x in b["dictionary_size_simulation"]] for b in sims]
        lines.append(common.md_table(["batch"] + [f"D={d}" for d in sizes], rows))
    t = r["targets"]["bytes_per_row_sent_mean_at_most_200"]
    lines.append(f"Target (at most 200 B per row on the wire, batch {t['batch']}): "
                 f"{'met' if t['met'] else 'NOT met'} ({t['value']} B).\n")
    lines.append(f"Valid-instance tokens their row rejected: {r['token_violations']} ({r['violations_engine']} "
                 f"rejected by llguidance in process too, {r['violations_wire']} changed on the wire).\n")
    return "\n".join(lines)
