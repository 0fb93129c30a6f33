"""No grammar can end the server: compiles run in worker processes (a crash or a runaway compile
costs only that grammar), timeouts are not cached, compiles are scheduled fairly across tenants,
the cache is bounded by bytes, and one entry's fault never ends its stream."""
import threading

import grpc
import pytest

from maskd.server import Limits, MaskServer, ServerConfig
from maskd.server.engines import GrammarCompileError
from maskd.server.grammar_cache import GrammarCache, QueueFull
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc

C = grpc.StatusCode


def ref_chain(n: int) -> dict:
    """An object schema whose $defs chain n levels deep: valid JSON Schema, hard on a compiler's stack."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"\n'


def register(stub, spec: dict, wait=True):
    return stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=GrammarSpec.from_dict(spec).to_proto(), wait=wait))


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=2,
                                  limits=Limits(max_grammar_bytes=4 << 20))).start()
    yield srv
    srv.stop(grace=0.5)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.MaskServiceStub(ch)


def test_a_grammar_that_crashes_the_compiler_costs_only_that_grammar(server, stub, cl100k):
    # a live stream of another client, before and after
    gid = register(stub, {"regex": "[0-9]+"}).grammar_id
    reqs = [pb.StepRequest(seqs=[pb.SeqStep(seq_id="bystander", step=0, grammar_id=gid)])]
    crashes = server._pool.crashes
    for spec in ({"lark": lark_chain(100_000)}, {"json_schema": ref_chain(12_000)}):
        with pytest.raises(grpc.RpcError) as err:
            register(stub, spec)
        assert err.value.code() == C.INVALID_ARGUMENT
        assert "crashed its compile worker" in err.value.details() and "SIGSEGV" in err.value.details()
    assert server._pool.crashes == crashes + 2
    # the same crash through a sequence open: that sequence FAILS, the stream and the server go on
    big = pb.SeqStep(seq_id="deep", step=0, spec=GrammarSpec.from_dict({"lark": lark_chain(100_000)}).to_proto())
    reqs.append(pb.StepRequest(seqs=[big, pb.SeqStep(seq_id="bystander", step=1, tokens=cl100k.encode("4"))]))
    replies = list(stub.Session(iter(reqs)))
    deep, bystander = replies[1].results
    assert deep.status == pb.SEQ_STATUS_FAILED and "crashed" in deep.reason
    assert bystander.status == pb.SEQ_STATUS_READY
    assert stub.Info(pb.InfoRequest()).tokenizer == "cl100k"
    # a deep chain that does compile (1,500 levels: it crashed the server before isolation)
    assert register(stub, {"json_schema": ref_chain(1500)}).state == pb.GRAMMAR_STATE_READY


def test_a_tool_whose_parameters_crash_the_compiler_costs_only_its_request(server, stub):
    """Tool pieces compile in batches in the workers: a batch that crashes its worker is compiled
    again one piece at a time, so only the piece at fault fails; its array then compiles whole
    (and fails the same way); the other tools' pieces stay cached for the next request."""
    def tool(name, params):
        return {"type": "function", "function": {"name": name, "parameters": params}}

    fine = [tool("fine_a", {"type": "object", "properties": {"a": {"type": "integer"}}}),
            tool("fine_b", {"type": "object", "properties": {"b": {"type": "string"}}})]
    crashes = server._pool.crashes
    request = GrammarSpec.from_request({"tools": [*fine, tool("deep", ref_chain(12_000))], "tool_choice": "required"})
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=request.to_proto(), wait=True))
    assert err.value.code() == C.INVALID_ARGUMENT and "crashed its compile worker" in err.value.details()
    # The batch, the piece alone (unless an earlier test cached its crash: the piece is ref_chain's
    # own text), the array whole.
    assert server._pool.crashes > crashes
    compiled = server.metrics.tool_pieces.labels("compiled")._value.get()
    ok = GrammarSpec.from_request({"tools": fine, "tool_choice": "required"})
    assert stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=ok.to_proto(), wait=True)).state \
        == pb.GRAMMAR_STATE_READY
    assert server.metrics.tool_pieces.labels("compiled")._value.get() == compiled   # both were cached


def test_a_schema_nested_past_the_limit_is_refused_before_any_engine_sees_it(stub):
    deep = {"type": "array", "items": {}}
    node = deep["items"]
    for _ in range(300):
        node["type"], node["items"] = "array", {}
        node = node["items"]
    with pytest.raises(grpc.RpcError) as err:
        register(stub, {"json_schema": deep})
    assert err.value.code() == C.RESOURCE_EXHAUSTED and "limit is 128" in err.value.details()
    text = "[" * 200_000 + "]" * 200_000      # deeper than Python's recursion limit
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=pb.GrammarSpec(json_schema=text)))
    assert err.value.code() == C.INVALID_ARGUMENT and "too deeply" in err.value.details()
    replies = list(stub.Session(iter([pb.StepRequest(seqs=[pb.SeqStep(seq_id="x", step=0,
                                                                      spec=pb.GrammarSpec(json_schema=text))])])))
    assert replies[0].results[0].status == pb.SEQ_STATUS_ERROR and "too deeply" in replies[0].results[0].reason


def test_a_runaway_compile_is_stopped_and_not_cached():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + 40}}}$"}
                                               for i in range(30)}}
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", backend="xgrammar", threads=1,
                                 limits=Limits(compile_timeout_s=0.3))) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.MaskServiceStub(ch)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                register(stub, {"json_schema": schema})
            assert err.value.code() == C.RESOURCE_EXHAUSTED and "exceeded the 0.3 s limit" in err.value.details()
        assert srv._pool.timeouts == 2 and srv.cache.compiles == 2   # the second attempt compiled again
        assert register(stub, {"regex": "[ab]"}).state == pb.GRAMMAR_STATE_READY   # the workers were replaced


def test_compile_workers_whose_pipes_are_past_descriptor_1024_compile():
    # a server holding many connections: select() cannot watch a descriptor past 1024 (ValueError
    # that lost the worker, and every compile after it waited for one forever)
    import os
    import resource

    from maskd.server.compile_pool import CompilePool

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files per process")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        pool = CompilePool("llguidance", "cl100k", None, 1)
        try:
            assert pool.wait_warm(120.0)
            assert pool._idle[0].proc.stdout.fileno() > 1024
            for _ in range(2):
                assert pool.compile(GrammarSpec.create("regex", "[0-9]{2}-fd"), 30.0)
            assert pool.crashes == 0 and pool.timeouts == 0
        finally:
            pool.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_fallback_engines_load_in_a_worker_does_not_count_against_the_grammars_limit():
    # the first spec llguidance cannot express loads xgrammar in the worker (its import, its
    # tokenizer info: seconds, and far more on a machine busy with an engine): that is not the
    # grammar's compile, which alone has the limit (before: stopped at the limit, every time, as
    # each replaced worker loaded again)
    import time

    from maskd.server.compile_pool import CompilePool

    def tool_tag(parameters: dict) -> GrammarSpec:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
        return GrammarSpec.from_request({"tools": tools, "tool_choice": "required", "tool_call_format": "qwen_3_coder"})

    spec = tool_tag({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    pool = CompilePool("llguidance", "deepseek-v4", None, 1)
    try:
        assert pool.wait_warm(120.0)
        t0 = time.monotonic()
        first = pool.compile(spec, 1.0)
        assert time.monotonic() - t0 > 1.0, "premise: loading xgrammar in the worker takes longer than the limit"
        assert pool.timeouts == 0 and first.startswith(b"MASKD-XGR")
        assert pool.compile(spec, 1.0) == first            # loaded once: the grammar alone, well inside
        runaway = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + 40}}}$"}
                                                    for i in range(30)}}
        with pytest.raises(GrammarCompileError, match="exceeded the 1 s limit"):
            pool.compile(tool_tag(runaway), 1.0)          # the grammar's own limit still holds
        assert pool.timeouts == 1
    finally:
        pool.close()


def test_compiles_take_only_what_the_step_path_leaves_and_their_limit_is_cpu_time():
    # the workers and the server's compile threads run at --compile-nice (19 by default: a compile
    # burst on the server's core leaves the step path's wait flat, maskd bench burst); a worker that gets no core for
    # longer than the limit (here: stopped) has not used its limit, and its compile is not stopped
    import os
    import signal
    import sys
    import time

    from maskd.server.compile_pool import CompilePool, cpu_seconds

    if not sys.platform.startswith("linux"):
        pytest.skip("thread priorities and CPU clocks are read from Linux's /proc")
    pool = CompilePool("llguidance", "cl100k", None, 1, nice=19)
    try:
        assert pool.wait_warm(120.0)
        worker = pool._idle[0]
        assert os.getpriority(os.PRIO_PROCESS, worker.proc.pid) == 19
        # in this process's session (its scheduling group, where the kernel groups by session: the
        # nice value counts inside it), in a process group of its own (^C does not reach it)
        assert os.getsid(worker.proc.pid) == os.getsid(0) and os.getpgid(worker.proc.pid) == worker.proc.pid
        assert cpu_seconds(worker.proc.pid) > 0       # it loaded an engine
        spec = GrammarSpec.create("regex", "[0-9]{3}-cpu")
        os.kill(worker.proc.pid, signal.SIGSTOP)     # no core for 1.5 s, 3x the limit
        answers: list = []
        t = threading.Thread(target=lambda: answers.append(pool.compile(spec, 0.5)))
        t0 = time.monotonic()
        t.start()
        try:
            t.join(1.5)
            assert t.is_alive() and not answers      # still waiting: no CPU time used
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        t.join(60)
        assert answers and answers[0] and time.monotonic() - t0 >= 1.5
        assert pool.timeouts == 0 and pool.crashes == 0
    finally:
        pool.close()
    from maskd.server.engines import create_engine
    from maskd.server.tokenizers import load_tokenizer
    cache = GrammarCache(create_engine("llguidance", load_tokenizer("cl100k"), threads=1), compile_threads=2,
                         nice=19)
    try:
        deadline = time.monotonic() + 30   # each thread lowers its own priority as it starts
        while any(os.getpriority(os.PRIO_PROCESS, t.native_id) != 19 for t in cache._threads):
            assert time.monotonic() < deadline, "the compile threads kept their priority"
            time.sleep(0.01)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0   # the caller's is its own
    finally:
        cache.close()


def test_compiles_are_taken_round_robin_across_tenants(cl100k):
    """Tenant A queues five grammars, then tenant B one: B's compiles second, not sixth."""
    from maskd.server.engines import create_engine
    engine = create_engine("llguidance", cl100k, threads=1)
    cache = GrammarCache(engine, compile_threads=1, max_queued_per_tenant=6)
    order, gate = [], threading.Event()
    compile_now = cache._compile

    def recording(entry):
        gate.wait()
        order.append(entry.tenant)
        compile_now(entry)

    cache._compile = recording
    try:
        entries = [cache.lookup(GrammarSpec.from_dict({"regex": f"a{i}[0-9]"}), "A") for i in range(6)]
        while len(cache._queues.get("A", ())) < 6:   # fill A's queue to its cap (one may be running)
            entries.append(cache.lookup(GrammarSpec.from_dict({"regex": f"a{len(entries)}[0-9]"}), "A"))
        with pytest.raises(QueueFull, match="limit is 6"):
            cache.lookup(GrammarSpec.from_dict({"regex": "a9[0-9]"}), "A")
        entries.append(cache.lookup(GrammarSpec.from_dict({"regex": "b[0-9]"}), "B"))
        gate.set()
        for e in entries:
            assert cache.wait(e, 10).done.is_set()
    finally:
        gate.set()
        cache.close()
    assert order[:3] == ["A", "B", "A"] and order.count("A") == len(entries) - 1


def test_the_cache_is_bounded_by_bytes(cl100k):
    from maskd.server.engines import create_engine
    engine = create_engine("llguidance", cl100k, threads=1)
    cache = GrammarCache(engine, compile_threads=1, max_bytes=20_000)
    try:
        for i in range(40):
            cache.wait(cache.lookup(GrammarSpec.from_dict({"regex": f"x{i}[0-9]{{1,4}}"})), 10)
        assert cache.bytes <= 20_000 and 0 < len(cache) < 40
    finally:
        cache.close()


class Stream:
    """One Session stream driven message by message (each send waits for its reply)."""

    def __init__(self, stub):
        import queue
        self._q = queue.SimpleQueue()
        self.call = stub.Session(iter(self._q.get, None))

    def send(self, *seqs, forced=False):
        self._q.put(pb.StepRequest(seqs=list(seqs), want_forced_tokens=forced))
        return next(self.call)

    def close(self):
        self._q.put(None)


def test_mixed_drafts_in_one_batch_work(stub, cl100k):
    gid = register(stub, {"regex": "[0-9]+"}).grammar_id
    one = cl100k.encode("1")[0]
    s = Stream(stub)
    s.send(*[pb.SeqStep(seq_id=x, step=0, grammar_id=gid) for x in ("d", "p")])
    r = s.send(pb.SeqStep(seq_id="d", step=1, tokens=[one], draft_tokens=[one, one]),
               pb.SeqStep(seq_id="p", step=1, tokens=[one]))
    d, p = r.results
    assert d.status == p.status == pb.SEQ_STATUS_READY, (d.reason, p.reason)
    assert (d.num_rows, d.drafts_valid, p.num_rows, r.num_rows) == (3, 2, 1, 4)
    s.close()


def test_an_engine_fault_costs_that_entry_only(server, stub, cl100k, monkeypatch):
    """A matcher that raises (an engine bug) fails its sequence with INTERNAL; the batch, the
    stream and the later steps carry on."""
    gid = register(stub, {"regex": "[0-9]+"}).grammar_id
    one = cl100k.encode("1")[0]
    s = Stream(stub)
    s.send(*[pb.SeqStep(seq_id=x, step=0, grammar_id=gid) for x in ("f", "p")])
    session = next(x for x in server.service.sessions.sessions() if "f" in x.seqs)
    victim = session.seqs["f"].matcher
    matcher_type = type(victim)
    real = matcher_type.forced_tokens

    def faulty(self):
        if self is victim:
            raise RuntimeError("engine fault")
        return real(self)

    monkeypatch.setattr(matcher_type, "forced_tokens", faulty)
    r = s.send(pb.SeqStep(seq_id="f", step=1, tokens=[one]), pb.SeqStep(seq_id="p", step=1, tokens=[one]),
               forced=True)
    f, p = r.results
    assert f.status == pb.SEQ_STATUS_FAILED and f.code == C.INTERNAL.value[0] and "engine fault" in f.reason
    assert p.status == pb.SEQ_STATUS_READY
    r = s.send(pb.SeqStep(seq_id="p", step=2, tokens=[one]), pb.SeqStep(seq_id="f", step=2, tokens=[one]))
    assert r.results[0].status == pb.SEQ_STATUS_READY and r.results[1].status == pb.SEQ_STATUS_FAILED
    assert server.metrics.registry.get_sample_value("maskd_errors_total", {"kind": "internal"}) >= 1
    s.close()
