"""Complete JSON-schema mode through a real server: for each keyword llguidance cannot enforce, a
schema that strict mode refuses compiles relaxed; valid instances pass token by token and end with
EOS allowed; invalid ones never get EOS: the sequence fails with the validator's message (or EOS
stays cleared while more output could still make the document pass)."""
import json
import time

import pytest

from maskd.server import MaskServer, ServerConfig
from maskd.specs import GrammarSpec
from maskd_client import MaskClient, MaskClientError, SeqStatus, StepInput

READY, FINISHED, FAILED, WAITING = SeqStatus.READY, SeqStatus.FINISHED, SeqStatus.FAILED, SeqStatus.WAITING
DRAFT7 = "http://json-schema.org/draft-07/schema#"

# keyword -> (schema, valid instances, invalid instances); every schema is one llguidance refuses.
CASES = {
    "not": ({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 13}}}, "required": ["n"]},
            [{"n": 12}], [{"n": 13}]),
    "oneOf": ({"oneOf": [{"type": "integer", "multipleOf": 2}, {"type": "integer", "multipleOf": 3}]},
              [4, 9], [6, 7]),
    "unknown format": ({"type": "object", "properties": {"re": {"type": "string", "format": "regex"},
                                                          "v": {"type": "string", "format": "semver"}}},
                       [{"re": "^a+$", "v": "1.2.3"}], [{"re": "(unclosed", "v": "1.2.3"}]),
    "dependencies": ({"$schema": DRAFT7, "type": "object",
                      "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
                      "dependencies": {"card": ["billing"]}},
                     [{"card": "x", "billing": "y"}, {"billing": "y"}], [{"card": "x"}]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [[1, 2], []], [[1, 1]]),
    "if/then/else": ({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
                      "required": ["kind", "n"],
                      "if": {"properties": {"kind": {"const": "a"}}},
                      "then": {"properties": {"n": {"minimum": 10}}},
                      "else": {"properties": {"n": {"maximum": 5}}}},
                     [{"kind": "a", "n": 12}, {"kind": "b", "n": 3}], [{"kind": "a", "n": 3}, {"kind": "b", "n": 12}]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, [[1, 7]], [[1, 2]]),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                       "additionalProperties": {"type": "integer"}}, [{"ab": 1}], [{"aB": 1}]),
    "min/maxProperties": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                            "c": {"type": "integer"}},
                           "minProperties": 2, "maxProperties": 2},
                          [{"a": 1, "b": 2}], [{"a": 1}, {"a": 1, "b": 2, "c": 3}]),
}


def start(mode):
    return MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1, metrics_port=0,
                                   json_schema_mode=mode)).start()


@pytest.fixture(scope="module")
def complete():
    srv = start("complete")
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture(scope="module")
def strict():
    srv = start("strict")
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture
def mc(complete):
    with MaskClient(complete.address, want_forced_tokens=False) as client:
        yield client


def bit(result, sid, token):
    row = result.bitmask[result.seqs[sid].row]
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def one_token(tok, s):
    ids = tok.encode(s)
    assert len(ids) == 1, (s, ids)
    return ids[0]


def opened(mc, sid, spec, tokens=()):
    mc.open(sid, spec)
    r = mc.step({sid: list(tokens)})
    deadline = time.monotonic() + 120   # generous: CI runs on a loaded 2-core machine
    while r.seqs[sid].status is WAITING:
        if time.monotonic() > deadline:
            raise AssertionError("grammar never compiled")
        time.sleep(0.005)
        r = mc.step({sid: []})
    return r


def drive(mc, sid, spec, tokens):
    """Feeds tokens one per step, each checked against the row before it. Returns how many went
    in and the last result."""
    r = opened(mc, sid, spec)
    for i, t in enumerate(tokens):
        if r.seqs[sid].status is not READY or not bit(r, sid, t):
            return i, r
        r = mc.step({sid: [t]})
    return len(tokens), r


def text(value):
    return json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("keyword", list(CASES))
def test_strict_mode_refuses_what_complete_mode_relaxes(strict, keyword):
    schema = CASES[keyword][0]
    with MaskClient(strict.address) as mc:
        assert mc.info().json_schema_mode == "strict"
        with pytest.raises(MaskClientError) as err:
            mc.register({"json_schema": schema})
        assert "does not compile" in str(err.value)


@pytest.mark.parametrize("keyword", list(CASES))
def test_valid_instances_pass_token_by_token_and_may_end(mc, cl100k, keyword):
    schema, valid, _ = CASES[keyword]
    eos = cl100k.eos_token_ids[0]
    for k, value in enumerate(valid):
        sid = f"valid-{keyword}-{k}"
        tokens = cl100k.encode(text(value))
        n, r = drive(mc, sid, {"json_schema": schema}, tokens)
        res = r.seqs[sid]
        assert n == len(tokens), (value, n, res.status, res.reason)
        assert res.status in (READY, FINISHED) and res.accepting and bit(r, sid, eos), (value, res)
        mc.close(sid)


@pytest.mark.parametrize("keyword", list(CASES))
def test_invalid_instances_never_get_eos(mc, cl100k, keyword):
    schema, _, invalid = CASES[keyword]
    eos = cl100k.eos_token_ids[0]
    for k, value in enumerate(invalid):
        sid = f"invalid-{keyword}-{k}"
        tokens = cl100k.encode(text(value))
        n, r = drive(mc, sid, {"json_schema": schema}, tokens)
        res = r.seqs[sid]
        if res.status is FAILED:
            assert "JSON schema" in res.reason and res.code is not None, res.reason
        elif n < len(tokens):   # a row refused one of its tokens (a closer kept off): it never gets there
            assert res.status is READY and not bit(r, sid, tokens[n]), (value, n, res)
        else:   # every token went in and the document may still grow into a valid one (a number)
            assert n == len(tokens) and res.status is READY, (value, n, res)
            assert not res.accepting and not bit(r, sid, eos)
            r = mc.step({sid: [eos]})   # a client that sends EOS anyway: the sequence fails
            reason = r.seqs[sid].reason   # the validator's (6: both branches), or the grammar's (7: none)
            assert r.seqs[sid].status is FAILED and ("EOS on a document that does not pass" in reason
                                                     or "doesn't satisfy the grammar" in reason), reason
        mc.close(sid)


def test_info_reports_the_mode_and_grammar_ids_differ_per_mode(complete, strict):
    schema = {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    with MaskClient(complete.address) as c, MaskClient(strict.address) as s:
        assert c.info().json_schema_mode == "complete"
        gid_c, gid_s = c.register(schema), s.register(schema)
        assert gid_c != gid_s   # the mode is part of the id
        info = c.info()
        spec = GrammarSpec.from_dict(schema)
        assert gid_c == spec.grammar_id(info.tokenizer_fingerprint, info.backend, info.backend_version,
                                        json_schema_mode="complete")


def test_a_sub_document_that_would_not_pass_is_kept_open(mc, cl100k):
    """uniqueItems on a member: the row takes away the token that would close the array on a
    duplicate (no dead end), and once the duplicate is gone from the way, the array may close."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True},
                                               "note": {"type": "string"}}, "required": ["tags", "note"]}
    tokens = cl100k.encode(text({"tags": ["a", "a"], "note": "n"}))
    n, r = drive(mc, "open", {"json_schema": schema}, tokens)
    assert r.seqs["open"].status is READY and cl100k.decode(tokens[:n]).endswith('"a", "a')
    assert not bit(r, "open", tokens[n])     # '"]' (or '"],') would close ["a", "a"]
    assert bit(r, "open", one_token(cl100k, '",'))   # another item may follow
    n, r = drive(mc, "open2", {"json_schema": schema}, cl100k.encode('{"tags": ["a", "b"], "note": "n"}'))
    assert r.seqs["open2"].accepting


def test_a_closed_sub_document_fails_early(mc, cl100k, complete):
    """A client that sends the closing token anyway (the row did not allow it): the sequence fails at
    that token, long before the document ends, and the metrics count it."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True},
                                               "note": {"type": "string"}}, "required": ["tags", "note"]}
    doc = text({"tags": ["a", "a"], "note": "a long note that would follow the array"})
    tokens = cl100k.encode(doc)
    before = complete.metrics.registry.get_sample_value("maskd_validation_failures_total", {"kind": "early"}) or 0
    n, r = drive(mc, "early", {"json_schema": schema}, tokens)
    assert r.seqs["early"].status is READY and not bit(r, "early", tokens[n])
    r = mc.step({"early": [tokens[n]]})
    res = r.seqs["early"]
    assert res.status is FAILED and "cannot match the JSON schema: at /tags: " in res.reason, res
    # it failed in the step of the token that closed the array
    assert '"a", "a"]' in cl100k.decode(tokens[:n + 1]) and "]" not in cl100k.decode(tokens[:n])
    assert n < len(tokens) - 5
    after = complete.metrics.registry.get_sample_value("maskd_validation_failures_total", {"kind": "early"})
    assert after == before + 1
    assert complete.metrics.registry.get_sample_value("maskd_validation_seconds_count") > 0


def test_a_restored_history_is_checked_like_a_live_one(mc, cl100k):
    schema = CASES["uniqueItems"][0]
    r = opened(mc, "restore-bad", {"json_schema": schema}, cl100k.encode("[1, 1]"))
    assert r.seqs["restore-bad"].status is FAILED and "non-unique" in r.seqs["restore-bad"].reason
    r = opened(mc, "restore-good", {"json_schema": schema}, cl100k.encode("[1, 2]"))
    assert r.seqs["restore-good"].status is FINISHED and r.seqs["restore-good"].accepting


def test_rollback_takes_the_verdict_back(mc, cl100k):
    schema = CASES["oneOf"][0]
    eos = cl100k.eos_token_ids[0]
    r = opened(mc, "rb", {"json_schema": schema})
    r = mc.step({"rb": cl100k.encode("6")})
    assert not bit(r, "rb", eos)
    r = mc.step({"rb": StepInput(tokens=cl100k.encode("4"), rollback=1)})
    assert r.seqs["rb"].status is READY and bit(r, "rb", eos) and r.seqs["rb"].accepting


def test_draft_positions_allow_eos_only_on_documents_that_pass(mc, cl100k):
    schema = CASES["oneOf"][0]
    eos = cl100k.eos_token_ids[0]
    one, zero, two = (cl100k.encode(d)[0] for d in "102")

    def eos_bits(r, sid):
        res = r.seqs[sid]
        return [bool((int(row[eos >> 5]) >> (eos & 31)) & 1) for row in r.bitmask[res.row: res.row + res.num_rows]]

    opened(mc, "d", {"json_schema": schema})
    r = mc.step({"d": StepInput(tokens=[one], drafts=[zero, eos])})   # "1" passes no branch, "10" one
    assert eos_bits(r, "d")[:2] == [False, True] and r.seqs["d"].drafts_valid == 2
    opened(mc, "d2", {"json_schema": schema})
    r = mc.step({"d2": StepInput(tokens=[one], drafts=[two, eos])})   # "12" passes both: invalid
    assert eos_bits(r, "d2")[:2] == [False, False] and r.seqs["d2"].drafts_valid == 1


# -- garbage on the validator path --------------------------------------------------------------------
@pytest.mark.parametrize("schema,message", [
    ({"type": "object", "not": {"required": ["b"]}, "properties": {"a": {"type": "string", "pattern": "(unclosed"}}},
     "the JSON Schema validator cannot use this schema"),
    ({"not": {"const": 1}, "properties": {"a": {"$ref": "https://example.com/remote.json"}}}, "remote.json"),
    (False, "does not compile"),
])
def test_schemas_the_validator_cannot_use_are_refused_with_the_reason(mc, schema, message):
    with pytest.raises(MaskClientError) as err:
        mc.register({"json_schema": schema})
    assert message in str(err.value)
    assert mc.info().json_schema_mode == "complete"   # the server is still up


def test_a_document_too_deep_to_check_fails_with_a_message(mc, cl100k):
    schema = {"type": "array", "not": {"maxItems": 0}}   # any non-empty array, relaxed for `not`
    tokens = cl100k.encode("[" * 1500 + "]" * 1500)
    assert len(tokens) < 4096
    r = opened(mc, "deep", {"json_schema": schema}, tokens)
    res = r.seqs["deep"]
    assert res.status is FAILED and "nests too deeply" in res.reason, res
    assert drive(mc, "after-deep", {"json_schema": schema}, cl100k.encode("[1]"))[1].seqs["after-deep"].accepting


def test_eos_token_on_an_unfinished_invalid_document_fails_the_sequence(mc, cl100k):
    eos = cl100k.eos_token_ids[0]
    opened(mc, "eos", {"json_schema": CASES["oneOf"][0]})
    r = mc.step({"eos": cl100k.encode("6") + [eos]})   # 6: grammatical (anyOf), but passes both branches
    res = r.seqs["eos"]
    assert res.status is FAILED and "EOS on a document that does not pass" in res.reason
    assert "oneOf" in res.reason or "is not valid under any" in res.reason


def test_grammars_compiled_whole_get_the_final_check_only(complete, mc, cl100k):
    """A schema llguidance enforces whole gets no early checks (nothing is scanned while it decodes),
    only the validator's check of the finished document."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    before = complete.metrics.registry.get_sample_value("maskd_validation_seconds_count") or 0
    _, r = drive(mc, "plain", {"json_schema": schema}, cl100k.encode('{"a": 1}'))
    assert r.seqs["plain"].status is FINISHED
    checker = complete.cache.get(mc.register({"json_schema": schema})).compiled.checker
    assert checker is not None and not checker.scans
    assert (complete.metrics.registry.get_sample_value("maskd_validation_seconds_count") or 0) == before + 1


# (format, a value llguidance's own format regex takes but the validator refuses, a valid one)
WIDER_FORMATS = {
    # strict mode keeps llguidance's date regex: 02-29 in any year
    "strict": ("date", "2023-02-29", "2024-02-29"),
    # complete mode's grammar has exact dates (below); llguidance's hostname has no length limit
    "complete": ("hostname", ".".join(["a" * 60] * 5), "example.com"),
}


@pytest.mark.parametrize("mode", ["strict", "complete"])
def test_every_finished_document_is_validated_whichever_mode_compiled_it(mode, request, cl100k):
    """A format the grammar enforces as a regex wider than the format: the schema compiles whole in
    both modes, and in both the validator keeps the document from finishing."""
    server = request.getfixturevalue(mode)
    fmt, wrong, right = WIDER_FORMATS[mode]
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": fmt}}, "required": ["d"]}
    eos = cl100k.eos_token_ids[0]
    with MaskClient(server.address, want_forced_tokens=False) as client:
        tokens = cl100k.encode(text({"d": wrong}))
        n, r = drive(client, "wrong", {"json_schema": schema}, tokens)
        assert n == len(tokens) and r.seqs["wrong"].status is FAILED and wrong[:20] in r.seqs["wrong"].reason
        n, r = drive(client, "ok", {"json_schema": schema}, cl100k.encode(text({"d": right})))
        assert r.seqs["ok"].status in (READY, FINISHED) and bit(r, "ok", eos)


@pytest.mark.parametrize(("fmt", "good", "bad"), [
    ("date", ["2024-02-29", "2000-02-29", "1900-02-28", "0000-02-29"], ["2023-02-29", "1900-02-29", "2023-04-31"]),
    ("date-time", ["2016-12-31T23:59:60Z", "2016-12-31t15:59:60.5-08:00", "2016-12-31T00:59:60+01:00",
                   "2023-02-28T06:52:59-12:29"],
     ["2092-12-31t05:19:60+02:06", "2016-12-31T23:59:60+01:00", "2023-02-29T00:00:00Z"]),
    ("time", ["23:59:60Z", "12:00:00.25+05:30", "22:59:60-01:00"], ["12:00:60Z", "12:00:00"]),
])
def test_complete_mode_grammar_takes_dates_and_times_as_the_validator_does(complete, cl100k, fmt, good, bad):
    """llguidance's date regex takes 02-29 in any year and its time a leap second at any time of day:
    a writer that chose one could never finish (a dead end). Complete mode's grammar takes the
    validator's rules: a refused value does not get past its rows."""
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": fmt}}, "required": ["d"]}
    eos = cl100k.eos_token_ids[0]
    with MaskClient(complete.address, want_forced_tokens=False) as client:
        for i, value in enumerate(good + bad):
            tokens = cl100k.encode(text({"d": value}))
            n, r = drive(client, f"{fmt}-{i}", {"json_schema": schema}, tokens)
            if value in good:
                assert n == len(tokens) and bit(r, f"{fmt}-{i}", eos), value
            else:
                assert n < len(tokens) and r.seqs[f"{fmt}-{i}"].status is READY, value


def test_xgrammar_backend_checks_what_it_loosens(cl100k):
    """xgrammar ignores uniqueItems (it accepts "[1, 1]" with EOS); in complete mode the validator
    keeps EOS off it: the array has ended, so the sequence fails."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    eos = cl100k.eos_token_ids[0]
    config = ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1, backend="xgrammar")
    with MaskServer(config) as srv, MaskClient(srv.address) as mc:
        _, r = drive(mc, "dup", {"json_schema": schema}, cl100k.encode("[1, 1]"))
        assert r.seqs["dup"].status is FAILED and "non-unique" in r.seqs["dup"].reason
        _, r = drive(mc, "ok", {"json_schema": schema}, cl100k.encode("[1, 2]"))
        assert r.seqs["ok"].status in (READY, FINISHED) and bit(r, "ok", eos)


def test_rolling_back_an_eos_takes_back_only_the_eos(mc, cl100k):
    eos = cl100k.eos_token_ids[0]
    opened(mc, "rb-eos", {"json_schema": CASES["oneOf"][0]})
    r = mc.step({"rb-eos": cl100k.encode("4") + [eos]})
    assert r.seqs["rb-eos"].status is FINISHED
    r = mc.step({"rb-eos": StepInput(tokens=cl100k.encode("2"), rollback=1)})   # "42": both branches
    assert r.seqs["rb-eos"].status is READY and not bit(r, "rb-eos", eos) and not r.seqs["rb-eos"].accepting


# A schema llguidance refuses (uniqueItems), so complete mode relaxes it: keys in any order, and
# "required" left to the validator and to the rows (closers kept off while a key is missing).
ANY_ORDER = {"type": "object", "required": ["id", "o"], "additionalProperties": {"type": "string"},
             "properties": {"id": {"type": "integer"},
                            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                            "o": {"type": "object", "required": ["x"],
                                  "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}


@pytest.mark.parametrize("value", [{"$schema": "s", "o": {"y": 1, "x": 2}, "id": 1},
                                   {"tags": ["a"], "id": 2, "note": "n", "o": {"x": 1}}])
def test_keys_in_any_order_are_accepted(mc, cl100k, value):
    """MaskBench's most common refusal: a key the schema does not declare ("$schema") or a declared
    one written before an earlier-declared one."""
    eos = cl100k.eos_token_ids[0]
    tokens = cl100k.encode(text(value))
    n, r = drive(mc, "order", {"json_schema": ANY_ORDER}, tokens)
    res = r.seqs["order"]
    assert n == len(tokens) and res.accepting and bit(r, "order", eos), (value, n, res)
    mc.close("order")


def test_an_object_missing_a_required_key_cannot_close(mc, cl100k):
    eos = cl100k.eos_token_ids[0]
    closers = {s: one_token(cl100k, s) for s in ("}", "}}", "},", " }")}

    def feed(s):
        nonlocal r
        for t in cl100k.encode(s):
            assert bit(r, "veto", t), (s, t)
            r = mc.step({"veto": [t]})
        assert r.seqs["veto"].status in (READY, FINISHED)

    r = opened(mc, "veto", {"json_schema": ANY_ORDER})
    feed('{"o": {"y": 1')                      # o misses x, the root misses id
    assert not any(bit(r, "veto", t) for t in closers.values())
    assert bit(r, "veto", one_token(cl100k, ","))
    feed(', "x": 2')                           # o may close; the root may not
    assert bit(r, "veto", closers["}"]) and bit(r, "veto", closers["},"])
    assert not bit(r, "veto", closers["}}"])
    feed('}, "s": "abc')                       # inside a string: '"}' would close it and the root
    assert not bit(r, "veto", one_token(cl100k, '"}')) and bit(r, "veto", one_token(cl100k, '",'))
    feed('", "id": 3')
    assert bit(r, "veto", closers["}"])
    feed("}")
    assert r.seqs["veto"].accepting and bit(r, "veto", eos)
    mc.close("veto")


def test_a_string_that_would_not_pass_cannot_end(mc, cl100k):
    """Relaxed (the "not" makes llguidance refuse it whole): the grammar leaves json-pointer to the
    validator, so the string is free there; the row takes away every token that would end it
    while it is no JSON pointer ('"', '"}', '",'), and keeps them once it is one."""
    schema = {"type": "object", "properties": {"p": {"type": "string", "format": "json-pointer"}},
              "required": ["p"], "not": {"const": {}}}
    enders = [one_token(cl100k, s) for s in ('"', '"}', '",')]
    for sid, text, ok in (("no-pointer", '{"p": "a/b', False), ("pointer", '{"p": "/a/b', True)):
        tokens = cl100k.encode(text)
        n, r = drive(mc, sid, {"json_schema": schema}, tokens)
        assert r.seqs[sid].status is READY and n == len(tokens), (sid, r.seqs[sid])
        assert [bit(r, sid, t) for t in enders] == [ok] * 3, sid
        mc.close(sid)
