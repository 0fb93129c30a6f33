"""The floor under `maskd bench serve --pin 1+1`'s "service minus in-process consume + fill" (issue
21's batch-64 target), and maskd's own share above it: one step done three ways in one run.

    .venv/bin/python docs/benchmarks/scripts/remote_step_floor.py --batch 64 --steps 120

* **in process**: B llguidance matchers in this process, batched consume (`consume_token_par`) and
  fill (`unsafe_compute_mask_ptr`) into a preallocated int32 buffer: what an engine pays without
  a mask server.
* **the floor**: the same work remote with no maskd Python on its path. A child process pinned to
  CPU 0 serves a gRPC bidi stream of maskd's own StepRequest / StepResponse messages (a sync
  server as `maskd serve` runs; `--aio`: grpc.aio instead) whose handler does only what any
  remote mask server must: read the columnar tokens, the same batched consume and fill, maskd's
  row codec (`RowBlockEncoder`, its zstd stream), the packed statuses. No sessions, idempotency,
  document checks or metrics. This process drives it as maskd's client does (a queue-fed request
  iterator, a reader thread that decodes the rows straight into the worker's buffer and resolves
  a future).
* **maskd**: `maskd serve --threads 1 --json-schema-mode strict` pinned to CPU 0 (as `maskd bench
  serve` runs it), stepped by MaskClient with columnar steps, the rows decoded into the worker's
  buffer (``step(..., out=)``).
* **maskd's server, a bare client**: the same server, another session of the same sequences,
  stepped with the floor's client (prebuilt columnar requests, rows decoded into the buffer): what
  maskd's server costs above the floor, apart from MaskClient.

This process runs on CPU 1. The four go in turn each step, in an order drawn afresh each step
(what ran just before decides which caches are warm: a fixed rotation favours the arm that
follows the same server's other arm); the rows of all are compared bit for bit. Paired
differences are per step (the same tokens, the same moment). Needs ../shared/maskbench-dev
(MaskBench valid instances replayed token by token).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

SERVICE = "/floor.Floor/Step"


def load(batch: int, steps: int):
    import llguidance

    from maskd.server.tokenizers import load_tokenizer
    from maskd.tools.bench import common

    tok = load_tokenizer("deepseek-v4")
    schemas = [s for s in common.load_schemas("../shared/maskbench-dev", tok, 120) if s.instances]
    # schemas llguidance refuses (maskd refuses them too) are left out
    errors = {s.name: "" for s in schemas
              if llguidance.LLMatcher(tok.ll, common.llguidance_grammar(s.text), log_level=0).is_error()}
    pool = [i for i in common.instance_pool(schemas, errors, 0, "floor") if len(i.tokens) > steps + 1]
    return tok, [pool[i % len(pool)] for i in range(batch)]


class Matchers:
    """B llguidance matchers (one per slot) and their batched consume + fill."""

    def __init__(self, tok, insts) -> None:
        import llguidance

        from maskd.tools.bench import common

        templates: dict[str, object] = {}
        self.matchers = []
        for inst in insts:
            t = templates.get(inst.schema.name)
            if t is None:
                t = templates[inst.schema.name] = llguidance.LLMatcher(
                    tok.ll, common.llguidance_grammar(inst.schema.text), log_level=0)
            self.matchers.append(t.deep_copy())
        self.executor = llguidance.LLExecutor(num_threads=1)
        self.words = (tok.logits_width + 31) // 32
        self.rows = np.zeros((len(insts), self.words), dtype=np.int32)
        self.jobs = [(m, i) for i, m in enumerate(self.matchers)]

    def step(self, tokens) -> np.ndarray:
        if tokens is not None:
            # (a token llguidance refuses leaves that matcher in its error state on both sides alike)
            self.executor.consume_token_par(list(zip(self.matchers, tokens)))
        self.executor.unsafe_compute_mask_ptr(self.jobs, self.rows.ctypes.data, self.words * 4, len(self.jobs))
        return self.rows


def serve(batch: int, steps: int, port_file: str, aio: bool = False) -> None:
    import grpc

    from maskd.rowcodec import RowBlockEncoder
    from maskd.v1 import maskd_pb2 as pb

    tok, insts = load(batch, steps)
    m = Matchers(tok, insts)
    ready = bytes([1]) * batch   # READY, as maskd's packed statuses

    def answer(req, enc: RowBlockEncoder):
        """One step: the tokens consumed, the rows filled and encoded, the packed statuses."""
        t0 = time.perf_counter()
        tokens = np.frombuffer(req.tokens, dtype="<i4").tolist() if req.tokens else None
        rows = m.step(tokens)
        reply = pb.StepResponse(num_rows=len(rows), words_per_row=m.words, statuses=ready, row_block=enc.encode(rows))
        reply.server_seconds = time.perf_counter() - t0
        return reply

    def handler(requests, context):
        enc = RowBlockEncoder(m.words, tok.logits_width)
        for req in requests:
            yield answer(req, enc)

    def publish(port: int) -> None:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(port_file + ".tmp", port_file)

    if aio:   # grpc.aio: the handler runs on the event loop's thread, which polls the completion queue itself
        import asyncio

        async def main() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", {
                "Step": grpc.stream_stream_rpc_method_handler(
                    aio_step, request_deserializer=pb.StepRequest.FromString,
                    response_serializer=pb.StepResponse.SerializeToString)}),))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            publish(port)
            await server.wait_for_termination()

        async def aio_step(requests, context):
            enc = RowBlockEncoder(m.words, tok.logits_width)
            async for req in requests:
                yield answer(req, enc)

        asyncio.run(main())
        return
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", {
        "Step": grpc.stream_stream_rpc_method_handler(
            handler, request_deserializer=pb.StepRequest.FromString,
            response_serializer=pb.StepResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    publish(port)
    server.wait_for_termination()


class Bare:
    """A bare stream client (the floor's pattern) on a maskd Session stream: one request at a time,
    the reply's rows decoded by a reader thread into ``out``."""

    def __init__(self, call, q: queue.SimpleQueue, words: int, width: int) -> None:
        from maskd.rowcodec import RowBlockDecoder

        self.call, self.q = call, q
        self.decoder = RowBlockDecoder(words, width)
        self.out = np.empty((0, words), dtype=np.int32)
        self.words = words
        self.pending: list = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def ask(self, request):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.pending.append(fut)
        self.q.put(request)
        return fut.result(60)

    def _read(self) -> None:
        import grpc

        try:
            for reply in self.call:
                with self.lock:
                    fut = self.pending.pop(0)
                if len(self.out) < reply.num_rows:
                    self.out = np.empty((reply.num_rows, self.words), dtype=np.int32)
                self.decoder.decode(reply.row_block, reply.num_rows, self.out)   # every reply: the stream's dictionary
                fut.set_result(reply)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise

    def close(self) -> None:
        self.q.put(None)
        self.call.cancel()


def drive(args) -> None:
    import grpc

    from maskd.rowcodec import RowBlockDecoder, RowBlockEncoder
    from maskd.tools.bench import common
    from maskd.v1 import maskd_pb2 as pb
    from maskd.v1 import maskd_pb2_grpc as pb_grpc
    from maskd.v1.contract import SESSION_METADATA_KEY
    from maskd_client import MaskClient

    port_file = f"/tmp/remote_step_floor.{os.getpid()}.port"
    child = subprocess.Popen(["taskset", "-c", "0", sys.executable, __file__, "--serve", port_file,
                              "--batch", str(args.batch), "--steps", str(args.steps)] + (["--aio"] if args.aio else []))
    maskd_server = mc = None
    try:
        os.sched_setaffinity(0, {1})
        tok, insts = load(args.batch, args.steps)
        local = Matchers(tok, insts)
        deadline = time.monotonic() + 300
        while not os.path.exists(port_file):
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the floor server did not start")
            time.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())

        maskd_server = common.subprocess_server("deepseek-v4", 1, cpus=[0])
        mc = MaskClient(maskd_server.address, want_forced_tokens=False, timeout_s=600)
        ids = [f"s{i}" for i in range(args.batch)]
        refused = common.register_all(mc, list({inst.schema.name: inst.schema for inst in insts}.values()))
        if refused:
            raise SystemExit(f"maskd refused schemas llguidance compiles: {refused}")
        for sid, inst in zip(ids, insts):
            mc.open(sid, inst.spec_pb)
        maskd_out = np.empty((args.batch, local.words), dtype=np.int32)
        bare_q: queue.SimpleQueue = queue.SimpleQueue()

        # maskd's server again, through a bare stream client (another session: sequences b0..)
        bare_channel = grpc.insecure_channel(maskd_server.address)
        bare_stream = Bare(pb_grpc.MaskServiceStub(bare_channel).Session(
            iter(bare_q.get, None), metadata=((SESSION_METADATA_KEY, "bare-client"),)), bare_q, local.words,
            tok.logits_width)
        opened = bare_stream.ask(pb.StepRequest(seqs=[pb.SeqStep(seq_id=f"b{i}", step=0, spec=inst.spec_pb)
                                                      for i, inst in enumerate(insts)]))
        bare_handles = np.array([r.handle for r in opened.results], "<u4").tobytes()

        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        call_fn = channel.stream_stream(SERVICE, request_serializer=pb.StepRequest.SerializeToString,
                                        response_deserializer=pb.StepResponse.FromString)
        q: queue.SimpleQueue = queue.SimpleQueue()
        pending: list = []
        lock = threading.Lock()
        dec = RowBlockDecoder(local.words, tok.logits_width)
        out = np.empty((args.batch, local.words), dtype=np.int32)   # the worker's preallocated buffer
        call = call_fn(iter(q.get, None))

        def read():
            try:
                for reply in call:
                    with lock:
                        fut = pending.pop(0)
                    rows = dec.decode(reply.row_block, reply.num_rows, out)
                    fut.set_result((rows, reply.server_seconds))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    raise

        threading.Thread(target=read, daemon=True).start()
        handles = np.arange(args.batch, dtype="<u4").tobytes()
        local_encoder = RowBlockEncoder(local.words, tok.logits_width)   # the server's encode, timed here
        times: dict[str, list[float]] = {k: [] for k in ("floor", "inproc", "maskd", "floor_server", "maskd_server",
                                                          "encode", "bare", "bare_server")}
        rng = np.random.default_rng(0)
        differ = 0
        for k in range(args.steps):
            tokens = None if k == 0 else [inst.tokens[k - 1] for inst in insts]

            def floor(k: int, tokens: list | None):
                t0 = time.perf_counter()
                req = pb.StepRequest(handles=handles, steps=np.full(args.batch, k, "<u4").tobytes(),
                                     token_counts=np.ones(args.batch, "<u4").tobytes(),
                                     tokens=np.array(tokens or [], "<i4").tobytes())
                fut: concurrent.futures.Future = concurrent.futures.Future()
                with lock:
                    pending.append(fut)
                q.put(req)
                rows, server_s = fut.result(60)
                return time.perf_counter() - t0, rows, server_s

            def in_process(k: int, tokens: list | None):
                t0 = time.perf_counter()
                rows = local.step(tokens)
                return time.perf_counter() - t0, rows, 0.0

            def maskd(k: int, tokens: list | None):
                t0 = time.perf_counter()
                res = mc.step({sid: [] if tokens is None else [t] for sid, t in zip(ids, tokens or ids)},
                              out=maskd_out)   # decoded into the worker's buffer, as the floor decodes its rows
                if not np.shares_memory(res.bitmask, maskd_out):
                    maskd_out[:] = res.bitmask
                return time.perf_counter() - t0, maskd_out, res.server_seconds

            def bare(k: int, tokens: list | None):
                t0 = time.perf_counter()
                counts = np.full(args.batch, 0 if tokens is None else 1, "<u4")   # step 0 repeats the open's
                reply = bare_stream.ask(pb.StepRequest(
                    handles=bare_handles, steps=np.full(args.batch, k, "<u4").tobytes(), token_counts=counts.tobytes(),
                    tokens=np.array(tokens or [], "<i4").tobytes()))
                return time.perf_counter() - t0, bare_stream.out, reply.server_seconds

            arms = [floor, in_process, maskd, bare]
            done = {}
            for arm in rng.permutation(len(arms)).tolist():   # in turn, in an order drawn each step
                done[arms[arm]] = arms[arm](k, tokens)
            (f_s, f_rows, f_srv), (i_s, i_rows, _) = done[floor], done[in_process]
            (m_s, m_rows, m_srv), (b_s, b_rows, b_srv) = done[maskd], done[bare]
            differ += sum(int((rows != i_rows).any(axis=1).sum()) for rows in (f_rows, m_rows, b_rows))
            t0 = time.perf_counter()
            local_encoder.encode(i_rows)      # every step: the encoder's dictionary follows the server's
            encode_s = time.perf_counter() - t0
            if k >= 5:
                for key, value in (("floor", f_s), ("inproc", i_s), ("maskd", m_s), ("floor_server", f_srv),
                                   ("maskd_server", m_srv), ("encode", encode_s), ("bare", b_s),
                                   ("bare_server", b_srv)):
                    times[key].append(value)
        q.put(None)
        call.cancel()
        channel.close()
        bare_stream.close()
        bare_channel.close()
    finally:
        if mc is not None:
            mc.shutdown()
        if maskd_server is not None:
            maskd_server.close()
        child.terminate()
        child.wait(30)
        if os.path.exists(port_file):
            os.remove(port_file)

    def p50(key: str) -> float:
        return statistics.median(times[key]) * 1e3

    def paired(a: str, b: str) -> float:
        return statistics.median([x - y for x, y in zip(times[a], times[b])]) * 1e3

    print(f"batch {args.batch}, {len(times['floor'])} steps (servers on CPU 0, this process on CPU 1), p50 ms: "
          f"in process {p50('inproc'):.3f}; floor {p50('floor'):.3f} (server {p50('floor_server'):.3f}, of it "
          f"the encode ~{p50('encode'):.3f}); maskd {p50('maskd'):.3f} (server_seconds {p50('maskd_server'):.3f}). "
          f"Paired: floor - in process {paired('floor', 'inproc'):+.3f}, maskd - in process "
          f"{paired('maskd', 'inproc'):+.3f}, maskd - floor {paired('maskd', 'floor'):+.3f}; "
          f"rows differing {differ}")
    print(f"  maskd's server through a bare client: {p50('bare'):.3f} (server_seconds {p50('bare_server'):.3f}); "
          f"paired: bare - floor {paired('bare', 'floor'):+.3f}, maskd - bare {paired('maskd', 'bare'):+.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--aio", action="store_true", help="serve with grpc.aio (one event-loop thread) instead of "
                   "the sync server maskd runs")
    p.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.batch, args.steps, args.serve, args.aio)
    else:
        drive(args)


if __name__ == "__main__":
    main()
