"""Floor of a Python gRPC sync bidi-stream round trip with maskd's client pattern.

A generic (bytes in, bytes out) bidi handler on a loopback port answers each request with a
reply of the size maskd sends for that batch; the client sends through a queue-fed request
iterator and reads replies on a reader thread that resolves futures (as MaskClient does).
No grammar work at all: what is left is transport, thread hops and the GIL.
"""
import concurrent.futures, queue, statistics, sys, threading, time
import grpc

REQ_PER_SEQ, REPLY_PER_SEQ = 24, 190   # bytes: measured StepRequest entry, reply result + row (~141 B)

def handler(request_iterator, context):
    for req in request_iterator:
        n = int.from_bytes(req[:4], "little")
        yield b"x" * (n * REPLY_PER_SEQ)

def main():
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", {
        "S": grpc.stream_stream_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0"); server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = ch.stream_stream("/echo.Echo/S")
    q = queue.Queue(); pending = []; lock = threading.Lock()
    def reqs():
        while (item := q.get()) is not None:
            yield item
    call = stub(reqs())
    def reader():
        for reply in call:
            with lock:
                f = pending.pop(0)
            f.set_result(len(reply))
    threading.Thread(target=reader, daemon=True).start()
    for b in (1, 16, 64, 256):
        times = []
        for i in range(300):
            f = concurrent.futures.Future(); t0 = time.perf_counter()
            with lock:
                pending.append(f)
            q.put(b.to_bytes(4, "little") + b"t" * (b * REQ_PER_SEQ))
            f.result(); times.append(time.perf_counter() - t0)
        times = times[20:]
        print(f"batch {b:4d}: request {b*REQ_PER_SEQ:6d} B, reply {b*REPLY_PER_SEQ:6d} B: round trip p50 "
              f"{statistics.median(times)*1e3:.3f} ms, p90 {sorted(times)[int(len(times)*.9)]*1e3:.3f} ms")
    q.put(None); server.stop(0)

if __name__ == "__main__":
    main()
