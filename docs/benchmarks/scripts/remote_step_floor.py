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
  serve` runs it), stepped by MaskClient with columnar steps, the rows copied into the worker's
  buffer.

This process runs on CPU 1. The three go in turn each step, the order rotating; the rows of all
three are compared bit for bit. Paired differences are per step (the same tokens, the same
moment). Needs ../shared/maskbench-dev (MaskBench valid instances replayed token by token).
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

    def handler(requests, context):
        enc = RowBlockEncoder(m.words, tok.logits_width)
        for req in requests:
            t0 = time.perf_counter()
            tokens = np.frombuffer(req.tokens, dtype="<i4").tolist() if req.tokens else None
            rows = m.step(tokens)
            reply = pb.StepResponse(num_rows=len(rows), words_per_row=m.words, statuses=ready,
                                    row_block=enc.encode(rows))
            reply.server_seconds = time.perf_counter() - t0
            yield reply

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
                t0 = time.perf_counter()
                tokens = np.frombuffer(req.tokens, dtype="<i4").tolist() if req.tokens else None
                rows = m.step(tokens)
                reply = pb.StepResponse(num_rows=len(rows), words_per_row=m.words, statuses=ready,
                                        row_block=enc.encode(rows))
                reply.server_seconds = time.perf_counter() - t0
                yield reply

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


def drive(args) -> None:
    import grpc

    from maskd.rowcodec import RowBlockDecoder, RowBlockEncoder
    from maskd.tools.bench import common
    from maskd.v1 import maskd_pb2 as pb
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
                                                          "encode")}
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
                res = mc.step({sid: [] if tokens is None else [t] for sid, t in zip(ids, tokens or ids)})
                maskd_out[:] = res.bitmask     # into the worker's buffer, where the floor decodes its rows
                return time.perf_counter() - t0, maskd_out, res.server_seconds

            arms = [floor, in_process, maskd]
            done = {arm: None for arm in arms}
            for j in range(3):   # in turn, the order rotating every step
                arm = arms[(k + j) % 3]
                done[arm] = arm(k, tokens)
            (f_s, f_rows, f_srv), (i_s, i_rows, _), (m_s, m_rows, m_srv) = done[floor], done[in_process], done[maskd]
            differ += int((f_rows != i_rows).any(axis=1).sum()) + int((m_rows != i_rows).any(axis=1).sum())
            t0 = time.perf_counter()
            local_encoder.encode(i_rows)      # every step: the encoder's dictionary follows the server's
            encode_s = time.perf_counter() - t0
            if k >= 5:
                for key, value in (("floor", f_s), ("inproc", i_s), ("maskd", m_s), ("floor_server", f_srv),
                                   ("maskd_server", m_srv), ("encode", encode_s)):
                    times[key].append(value)
        q.put(None)
        call.cancel()
        channel.close()
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
