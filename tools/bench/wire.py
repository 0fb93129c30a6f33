"""``maskd bench wire``: bytes per mask row as the server sent them, and what the alternatives take.

Valid MaskBench instances are replayed through a real server, B sequences per session stream
(each instance once, in a seeded random order; a finished sequence is closed and its slot
refilled in the same step message). The stream is driven with the bare gRPC stub, the way the
client does it: a sequence opens with a ``SeqStep`` and then steps in the columnar arrays by its
handle. Every ``StepResponse`` is seen as it came off the wire; its row block is decoded with
``RowBlockDecoder`` and every sampled token is checked against its row.

Per row, over the whole run (total bytes / total rows):

- ``sent``: the reply's ``row_block`` (compressed), what a row costs on the wire;
- ``message``: the whole serialized reply plus the 5-byte gRPC prefix (statuses, ids, results);
- the alternatives, each a shadow ``RowBlockEncoder`` fed the decoded rows in the stream's order
  (the encoders are deterministic: the one configured like the server reproduces ``sent`` to the
  byte): ``dense`` (the raw words), ``dense_zstd`` (raw words through the stream's zstd context),
  ``adaptive`` (smallest of dense / allowed ids / rejected ids, no dictionary, no zstd),
  ``adaptive_zstd``, ``block`` (adaptive + the row dictionary, no zstd: the block before
  compression) and a sweep of row dictionary sizes with zstd.
"""
from __future__ import annotations

import dataclasses
import queue
import time
import uuid

import numpy as np

from maskd_tools.bench import common
from maskd_tools.progress import bar

QUICK_LIMIT = 48
QUICK_MAX_ROWS = 3000
DICT_SIZES = (0, 64, 256, 1024)
TARGET_BYTES_PER_ROW = 100


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


class _Shadows:
    """Shadow encoders over the rows the client decoded, in stream order."""

    def __init__(self, words: int, width: int, server_dict: int, server_encodings) -> None:
        from maskd.rowcodec import ALLOWED_IDS, DENSE, REJECTED_IDS, RowBlockEncoder

        adaptive = (DENSE, ALLOWED_IDS, REJECTED_IDS)
        self.dense_bytes = 4 * words
        self.encoders = {
            "dense_zstd": RowBlockEncoder(words, width, dict_size=0, encodings=(DENSE,)),
            "adaptive": RowBlockEncoder(words, width, dict_size=0, encodings=adaptive, compress=False),
            "adaptive_zstd": RowBlockEncoder(words, width, dict_size=0, encodings=adaptive),
            "block": RowBlockEncoder(words, width, dict_size=server_dict, encodings=server_encodings,
                                     compress=False),
            "server": RowBlockEncoder(words, width, dict_size=server_dict, encodings=server_encodings),
        }
        for d in DICT_SIZES:
            self.encoders[f"dict_{d}_zstd"] = RowBlockEncoder(words, width, dict_size=d)
        self.bytes = {k: 0 for k in self.encoders}
        self.refs = {k: 0 for k in self.encoders}
        self.kinds = np.zeros(4, dtype=np.int64)
        self.kind_bytes = np.zeros(4, dtype=np.int64)
        self.mismatched_steps = 0

    def feed(self, rows: np.ndarray, sent: bytes) -> None:
        for name, enc in self.encoders.items():
            data = enc.encode(rows)
            self.bytes[name] += len(data)
            self.refs[name] += int((enc.last_kinds == 3).sum())
            if name == "block":
                self.kinds += np.bincount(enc.last_kinds, minlength=4)[:4]
                self.kind_bytes += np.bincount(enc.last_kinds, weights=enc.last_sizes, minlength=4)[:4].astype(np.int64)
            elif name == "server" and data != sent:
                self.mismatched_steps += 1


@dataclasses.dataclass
class _StreamSlot:
    """A batch position on the bare gRPC stream: its sequence, step counter and server handle."""
    sid: str
    inst: common.Instance
    applied: int = 0
    step: int = 0
    send: tuple = ()
    new: bool = True
    handle: int | None = None


def _run_batch(address, pool, batch: int, max_rows: int | None, eos: int, width: int, ll) -> dict:
    from maskd.rowcodec import RowBlockDecoder

    stream = _RawStream(address)
    pb = stream.pb
    info = stream.info
    dict_size = info.row_dictionary_size
    decoder = RowBlockDecoder(info.words_per_row, info.logits_width, dict_size=dict_size,
                              compression=info.row_compression)
    shadows = _Shadows(info.words_per_row, info.logits_width, dict_size, tuple(info.row_encodings))
    sent_per_step, message_bytes, request_bytes, server_s = [], [], [], []
    rows_total = violations = failed = completed = 0
    bad: list[dict] = []
    source = iter(pool)
    counter = 0
    closes: list[tuple[str, int]] = []

    def fresh():
        nonlocal counter
        inst = next(source, None)
        if inst is None:
            return None
        counter += 1
        return _StreamSlot(f"w{batch}-{counter}", inst)

    slots = [s for s in (fresh() for _ in range(batch)) if s is not None]
    rows_bar = bar(total=max_rows, desc=f"B={batch} rows", unit="row")
    try:
        while slots and (max_rows is None or rows_total < max_rows):
            rows_bar.update(rows_total - rows_bar.n)
            req = pb.StepRequest()
            for sid, step in closes:
                req.seqs.add(seq_id=sid, step=step, close=True)
            closes.clear()
            rich = [s for s in slots if s.handle is None]
            plain = [s for s in slots if s.handle is not None]
            for s in rich:
                e = req.seqs.add(seq_id=s.sid, step=s.step, tokens=list(s.send))
                if s.new:
                    e.spec.CopyFrom(s.inst.spec_pb)
                    s.new = False
            if plain:
                req.handles = np.fromiter((s.handle for s in plain), "<u4", len(plain)).tobytes()
                req.steps = np.fromiter((s.step for s in plain), "<u4", len(plain)).tobytes()
                req.token_counts = np.fromiter((len(s.send) for s in plain), "<u4", len(plain)).tobytes()
                req.tokens = np.asarray([t for s in plain for t in s.send], "<i4").tobytes()
            request_bytes.append(req.ByteSize() + 5)
            reply = stream.step(req)
            rows = decoder.decode(reply.row_block, reply.num_rows)
            shadows.feed(rows, reply.row_block)
            rows_total += reply.num_rows
            message_bytes.append(reply.ByteSize() + 5)
            sent_per_step.append(len(reply.row_block) / max(1, reply.num_rows))
            server_s.append(reply.server_seconds)
            # (slot, status, row) for every slot: rich results first, then the columnar entries.
            by_id = {r.seq_id: r for r in reply.results}
            outcome = []
            for s in rich:
                r = by_id[s.sid]
                if r.handle:
                    s.handle = r.handle
                outcome.append((s, r.status, r.first_row))
            next_row = sum(r.num_rows for r in reply.results)
            statuses = np.frombuffer(reply.statuses, dtype=np.uint8) & 0x0F
            for s, st in zip(plain, statuses.tolist()):
                outcome.append((s, st, next_row))
                if st in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FINISHED):
                    next_row += 1
            keep = []
            for s, status, row in outcome:
                if status == pb.SEQ_STATUS_WAITING:
                    s.send = ()
                    keep.append(s)
                    continue
                done = status not in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FINISHED)
                if done:
                    failed += 1
                else:
                    s.applied += len(s.send)
                    tokens = s.inst.tokens
                    tok = tokens[s.applied] if s.applied < len(tokens) else eos
                    ok = bool(common.allowed(rows, [row], [tok])[0])
                    if not ok:
                        violations += 1
                        bad.append({"file": s.inst.schema.name, "position": s.applied, "token": int(tok),
                                    "_inst": s.inst})
                    elif s.applied >= len(tokens):
                        completed += 1
                    else:
                        s.step += 1
                        s.send = (tok,)
                        keep.append(s)
                        continue
                closes.append((s.sid, s.step))
                s = fresh()
                if s is not None:
                    keep.append(s)
            slots = keep
    finally:
        rows_bar.close()
        stream.close()
    return {"rows": rows_total, "sent_per_step": sent_per_step, "message_bytes": message_bytes,
            "request_bytes": request_bytes, "shadows": shadows, "dense_row_bytes": 4 * info.words_per_row,
            "server_seconds": server_s, "violations": violations, "failed": failed, "completed": completed,
            "dict_size": dict_size, "compression": info.row_compression,
            "violation_examples": _judge(bad[:50], ll, width)}


def _judge(bad: list[dict], ll, width: int) -> list[dict]:
    """Replays each violation in process: does llguidance itself reject the token there (an
    engine false reject on a valid instance), or did the row change on the way (a codec bug)?"""
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask

    out = []
    for v in bad:
        inst = v.pop("_inst")
        m = llguidance.LLMatcher(ll, common.llguidance_grammar(inst.schema.text), log_level=0)
        consumed = m.consume_tokens(inst.tokens[:v["position"]]) if v["position"] else True
        bm = np.zeros((1, (width + 31) // 32), dtype=np.int32)
        fill_next_token_bitmask(m, bm, 0)
        v["in_process_allows"] = bool(consumed) and bool(common.allowed(bm, [0], [v["token"]])[0])
        v["cause"] = "wire" if v["in_process_allows"] else "engine"
        out.append(v)
    return out


KIND_NAMES = ("dense", "allowed_ids", "rejected_ids", "dict_ref")


def _summary(batch: int, raw: dict) -> dict:
    rows = max(1, raw["rows"])
    sh: _Shadows = raw["shadows"]
    msgs = np.asarray(raw["message_bytes"], dtype=np.float64)
    per_row = lambda total: round(total / rows, 1)
    out = {"batch": batch, "rows": raw["rows"], "steps": len(msgs), "dict_size": raw["dict_size"],
           "compression": raw["compression"]}
    out["bytes_per_row_sent_mean"] = per_row(sh.bytes["server"])
    out["bytes_per_row_message_mean"] = per_row(float(msgs.sum()))
    out["bytes_per_row_dense_mean"] = float(raw["dense_row_bytes"])
    for name in ("dense_zstd", "adaptive", "adaptive_zstd", "block"):
        out[f"bytes_per_row_{name}_mean"] = per_row(sh.bytes[name])
    out["bytes_per_step_message_mean"] = round(float(msgs.mean()), 1) if msgs.size else None
    requests = np.asarray(raw["request_bytes"], dtype=np.float64)
    out["bytes_per_step_request_mean"] = round(float(requests.mean()), 1) if requests.size else None
    out["bytes_per_row_request_mean"] = per_row(float(np.sum(raw["request_bytes"])))
    out["sent_bytes_per_row_by_step"] = common.summarize(raw["sent_per_step"], scale=1.0, digits=1)
    out["block_share"] = {n: round(float(sh.kinds[i] / rows), 4) for i, n in enumerate(KIND_NAMES)}
    total_block = max(1, int(sh.kind_bytes.sum()))
    out["block_bytes_by_encoding"] = {n: round(float(sh.kind_bytes[i] / total_block), 4)
                                      for i, n in enumerate(KIND_NAMES)}
    out["dictionary_sizes"] = [{"dict_size": d, "bytes_per_row_mean": per_row(sh.bytes[f"dict_{d}_zstd"]),
                                "dict_ref_share": round(sh.refs[f"dict_{d}_zstd"] / rows, 4),
                                "dictionary_mib_per_stream_end": round(d * raw["dense_row_bytes"] / 2**20, 2)}
                               for d in DICT_SIZES]
    # The shadow configured like the server must reproduce the server's bytes exactly.
    out["shadow_mismatched_steps"] = sh.mismatched_steps
    out["server_seconds_ms"] = common.summarize(raw["server_seconds"])
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

    limit = args.limit if args.limit is not None else (QUICK_LIMIT if args.quick else None)
    max_rows = args.max_rows if args.max_rows is not None else (QUICK_MAX_ROWS if args.quick else None)
    batches = common.positive_list(args.batch_sizes, int, "--batch-sizes", "maskd bench wire")
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
        pool = common.instance_pool(schemas, errors, args.seed, "wire", specs)
        log(f"wire: {len(pool)} instances of {len(schemas) - len(errors)} schemas, server {srv.kind} at "
            f"{srv.address}, dense row {4 * info.words_per_row:,} B")
        for batch in batches:
            raw = _run_batch(srv.address, pool, batch, max_rows, tok.eos_token_ids[0], info.logits_width, tok.ll)
            res = _summary(batch, raw)
            results.append(res)
            log(f"  B={batch}: {res['rows']:,} rows, sent {res['bytes_per_row_sent_mean']} B/row (block before "
                f"zstd {res['bytes_per_row_block_mean']}, dense+zstd {res['bytes_per_row_dense_zstd_mean']}), whole "
                f"reply {res['bytes_per_row_message_mean']} B/row, dict refs {res['block_share']['dict_ref']:.0%}")
    finally:
        srv.close()
    primary = next((r for r in results if r["batch"] == 64), results[0] if results else {})
    worst = max(results, key=lambda r: r["bytes_per_row_sent_mean"]) if results else {}
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
                   "row_dictionary_size": info.row_dictionary_size, "row_compression": info.row_compression},
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
    # The shadow encoder configured like the server reproduces its bytes, or the codec is not deterministic.
    report["shadow_mismatched_steps"] = sum(r["shadow_mismatched_steps"] for r in results)
    report["failed"] = bool(report["violations_wire"] or report["shadow_mismatched_steps"])
    report["targets"] = {f"bytes_per_row_sent_mean_at_most_{TARGET_BYTES_PER_ROW}": {
        "value": worst.get("bytes_per_row_sent_mean"), "batch": worst.get("batch"),
        "met": bool(results) and all(r["bytes_per_row_sent_mean"] <= TARGET_BYTES_PER_ROW for r in results)}}
    _plots(out, report)
    out.write(report, _markdown(report))
    return report


ALTERNATIVES = (("dense", "dense\n(raw words)"), ("dense_zstd", "dense\n+ zstd"),
                ("adaptive", "smallest of\ndense / ids"), ("adaptive_zstd", "smallest\n+ zstd"),
                ("block", "block\n(+ row dict)"), ("sent", "sent\n(block + zstd)"),
                ("message", "whole reply\nper row"))


def _plots(out: common.Output, r: dict) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    n = len(r["batches"])
    w = 0.8 / max(1, n)
    x = np.arange(len(ALTERNATIVES))
    for j, b in enumerate(r["batches"]):
        vals = [b.get(f"bytes_per_row_{k}_mean") or 0 for k, _ in ALTERNATIVES]
        bars = ax.bar(x + (j - (n - 1) / 2) * w, vals, w, label=f"batch {b['batch']} ({b['rows']:,} rows)")
        for rect, v in zip(bars, vals):
            ax.annotate(f"{v:,.0f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.axhline(TARGET_BYTES_PER_ROW, color="gray", linestyle="--", linewidth=1,
               label=f"target: {TARGET_BYTES_PER_ROW} B/row")
    ax.set_yscale("log")
    ax.set_xticks(x, [label for _, label in ALTERNATIVES], fontsize=8)
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
             f"{r['dense_row_bytes']:,} B); server {r['server']['kind']}, row dictionary "
             f"{r['server']['row_dictionary_size']} rows, compression {r['server']['row_compression'] or 'none'}.\n",
             f"Machine: {common.machine_line(r['machine'])}.\n",
             "## Mean bytes per row\n",
             "`sent` is the reply's row block as it came off the wire; the other columns are shadow encoders fed "
             "the same rows in the same order (see `tools/bench/wire.py`).\n"]
    rows = [[b["batch"], b["rows"]] + [b.get(f"bytes_per_row_{k}_mean") for k, _ in ALTERNATIVES]
            + [b["bytes_per_row_request_mean"]] for b in r["batches"]]
    lines.append(common.md_table(["batch", "rows", "dense", "dense + zstd", "smallest of dense / ids",
                                  "smallest + zstd", "block (+ row dict)", "sent (block + zstd)",
                                  "whole reply per row", "whole request per row"], rows))
    lines.append("## Row kinds in the block (share of rows / share of block bytes before zstd)\n")
    rows = [[b["batch"]] + [f"{b['block_share'][n]:.1%} / {b['block_bytes_by_encoding'][n]:.1%}"
                            for n in KIND_NAMES] for b in r["batches"]]
    lines.append(common.md_table(["batch", "dense", "allowed ids", "rejected ids", "dict ref"], rows))
    lines.append("## Row dictionary size (block + zstd, mean bytes per row / share of rows sent as references)\n")
    lines.append(f"Each end keeps D dense rows per stream ({r['dense_row_bytes']:,} B each).\n")
    rows = [[b["batch"]] + [f"{x['bytes_per_row_mean']:,.1f} / {x['dict_ref_share']:.0%}"
                            for x in b["dictionary_sizes"]] for b in r["batches"]]
    lines.append(common.md_table(["batch"] + [f"D={d}" for d in DICT_SIZES], rows))
    t = r["targets"][f"bytes_per_row_sent_mean_at_most_{TARGET_BYTES_PER_ROW}"]
    lines.append(f"Target (at most {TARGET_BYTES_PER_ROW} B per row sent, every batch size): "
                 f"{'met' if t['met'] else 'NOT met'} (largest: {t['value']} B at batch {t['batch']}).\n")
    lines.append(f"Valid-instance tokens their row rejected: {r['token_violations']} ({r['violations_engine']} "
                 f"rejected by llguidance in process too, {r['violations_wire']} changed on the wire); steps "
                 f"where the shadow encoder did not reproduce the server's bytes: {r['shadow_mismatched_steps']}.\n")
    return "\n".join(lines)
