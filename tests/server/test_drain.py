"""SIGTERM drains within a bounded time, whatever the input was: health NOT_SERVING first (while
the port still answers, so a load balancer sees it), new streams refused, open ones served through
the grace period, then the process exits."""
import queue
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc

C = grpc.StatusCode
SPEC = GrammarSpec.from_dict({"regex": "[0-9]+"}).to_proto()


def test_sigterm_after_garbage_drains_in_order_and_exits(cl100k):
    proc = subprocess.Popen([sys.executable, "-m", "maskd.cli", "serve", "--port", "0", "--tokenizer", "cl100k",
                             "--threads", "1", "--max-message-bytes", "65536", "--drain-delay", "2",
                             "--drain-grace", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().split("serving on ")[1].split(",")[0].strip()
        ch = grpc.insecure_channel(address)
        stub, health = pb_grpc.MaskServiceStub(ch), health_pb2_grpc.HealthStub(ch)
        # garbage first: an oversized message, undecodable bytes, a stream left half open
        big = pb.StepRequest(seqs=[pb.SeqStep(seq_id=f"x{i}", step=0, tokens=[5] * 4000) for i in range(8)])
        try:
            list(stub.Session(iter([big])))
        except grpc.RpcError as exc:
            assert exc.code() == C.RESOURCE_EXHAUSTED
        raw = ch.stream_stream("/maskd.v1.MaskService/Session", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        try:
            list(raw(iter([b"\xff\xfe garbage"])))
        except grpc.RpcError:
            pass
        q = queue.SimpleQueue()
        open_stream = stub.Session(iter(q.get, None))
        q.put(pb.StepRequest(seqs=[pb.SeqStep(seq_id="live", step=0, spec=SPEC)]))
        next(open_stream)

        proc.send_signal(signal.SIGTERM)
        # draining (its --drain-delay counts from when the server takes the signal, which on a loaded
        # machine has come later than 0.5 s): NOT_SERVING on a port that still answers; new streams
        # refused; open ones served
        deadline = time.monotonic() + 20
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        while status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
            time.sleep(0.02)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert stub.Info(pb.InfoRequest(), timeout=5).tokenizer == "cl100k"
        try:
            list(stub.Session(iter([pb.StepRequest()])))
            raise AssertionError("a new stream was accepted while draining")
        except grpc.RpcError as exc:
            assert exc.code() == C.UNAVAILABLE and "draining" in exc.details()
        q.put(pb.StepRequest(seqs=[pb.SeqStep(seq_id="live", step=1)]))
        assert next(open_stream).results[0].status in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_WAITING)
        assert proc.wait(timeout=30) == 0      # it ends by itself, whatever came before
        q.put(None)
        ch.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
