"""Complete mode's grammar never narrower than the schema where llguidance's own compile is (issue 50,
items 3 and 4): integer constants no double holds, and properties from several ``allOf`` members
in any order; numbers in exponent form under a bound and bounds whose digits llguidance's range
regex gets wrong stay open (xfail, with the reason). Valid documents go in token by token and may
end (EOS allowed); invalid ones never get EOS (the validator decides what the grammar leaves to
it). Strict mode keeps llguidance's grammar: where it differs, the test says what it does."""
import json
import time

import pytest
from test_complete_mode import complete, strict  # noqa: F401 -- the servers in both modes

from maskd_client import MaskClient, SeqStatus

READY, FINISHED, FAILED, WAITING = SeqStatus.READY, SeqStatus.FINISHED, SeqStatus.FAILED, SeqStatus.WAITING
BIG = 2 ** 53 + 1   # 9007199254740993: no double holds it

# class -> (schema, valid documents, invalid documents, what strict mode does with the first valid one)
CASES = {
    # json.dumps(0.000001) == "1e-06": llguidance's bounded number lexeme has no exponent
    "exponent under a bound": ({"type": "number", "minimum": 0},
                               [json.dumps(0.000001), json.dumps(1e16), "2.5E+3", "0.000001", "-0.0", "0"],
                               ["-1e-06", "-1", "-0.5"], "refused"),
    "exponent in an object": ({"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0,
                                                                      "maximum": 1}},
                               "required": ["p"]},
                              ['{"p": 1e-06}', '{"p": 0.5}', '{"p": 1}', '{"p": 1E-2}'],
                              ['{"p": 0}', '{"p": 2e0}', '{"p": -1e-06}', '{"p": 1.5}'], "refused"),
    # llguidance's range regex refuses a number whose digits are a prefix of the bound's
    "bound not exactly representable": ({"type": "number", "maximum": 0.9999999},
                                        ["0.999999", "0.9", "0.9999999", "0.99999990", "-3"],
                                        ["0.99999991", "1", "1e0"], "refused"),
    "big integer const": ({"const": BIG}, [str(BIG)], [str(BIG - 1), str(BIG + 1), "-" + str(BIG)],
                          "refused"),
    "big integer enum": ({"type": "object", "properties": {"id": {"enum": [BIG, -BIG, "x"]}}, "required": ["id"]},
                         [f'{{"id": {BIG}}}', f'{{"id": {-BIG}}}', '{"id": "x"}'],
                         [f'{{"id": {BIG + 1}}}', f'{{"id": {-BIG - 1}}}', '{"id": "y"}'], "refused"),
    # llguidance merges allOf members' properties into one list, in the members' order
    "allOf members in any order": (
        {"allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                   {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
        ['{"b": 1, "a": "x"}', '{"a": "x", "b": 1}', '{"b": 1, "c": null, "a": "x"}'],
        ['{"b": 1}', '{"a": "x"}', '{"b": "1", "a": "x"}'], "refused"),
    "allOf of references": (
        {"allOf": [{"$ref": "#/$defs/named"}, {"$ref": "#/$defs/sized"}],
         "$defs": {"named": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                   "sized": {"type": "object", "properties": {"size": {"type": "integer", "minimum": 1}}}}},
        ['{"size": 2, "name": "n"}', '{"name": "n", "size": 2}', '{"name": "n"}'],
        ['{"size": 2}', '{"size": 0, "name": "n"}'], "refused"),
    "allOf beside own properties": (
        {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
         "allOf": [{"properties": {"name": {"type": "string"}}, "required": ["name"]}]},
        ['{"name": "n", "id": 1}', '{"id": 1, "name": "n"}'], ['{"name": "n"}', '{"id": 1}'], "refused"),
}


def bit(result, sid, token):
    row = result.bitmask[result.seqs[sid].row]
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def drive(mc, sid, spec, tokens):
    """Feeds tokens one per step, each checked against the row before it: (how many went in, the
    last result)."""
    mc.open(sid, spec)
    r = mc.step({sid: []})
    deadline = time.monotonic() + 120
    while r.seqs[sid].status is WAITING:
        assert time.monotonic() < deadline, "grammar never compiled"
        time.sleep(0.005)
        r = mc.step({sid: []})
    for i, t in enumerate(tokens):
        if r.seqs[sid].status is not READY or not bit(r, sid, t):
            return i, r
        r = mc.step({sid: [t]})
    return len(tokens), r


def accepted(mc, tok, sid, schema, text):
    tokens = tok.encode(text)
    n, r = drive(mc, sid, {"json_schema": schema}, tokens)
    res = r.seqs[sid]
    ok = n == len(tokens) and res.status in (READY, FINISHED) and res.accepting and bit(r, sid, tok.eos_token_ids[0])
    mc.close(sid)
    return ok, (n, len(tokens), res.status, res.reason)


# Number bounds stay llguidance's (maskd/server/json_schema/numbers.py says why): these classes are open.
BOUNDS_OPEN = pytest.mark.xfail(strict=True, reason="number bounds stay llguidance's range regex (no exponent, "
                                "prefixes of the bound's digits refused): leaving them to the validator lets a "
                                "model start a value no continuation can end; exact needs maskd's own number grammar "
                                "(docs/decisions/0025)")
NUMBER_BOUNDS = ("exponent under a bound", "exponent in an object", "bound not exactly representable")


@pytest.mark.parametrize("case", [pytest.param(c, marks=BOUNDS_OPEN) if c in NUMBER_BOUNDS else c for c in CASES])
def test_valid_documents_pass_and_invalid_ones_never_end(complete, cl100k, case):  # noqa: F811 (a fixture)
    schema, valid, invalid, _ = CASES[case]
    eos = cl100k.eos_token_ids[0]
    with MaskClient(complete.address, want_forced_tokens=False) as mc:
        for k, text in enumerate(valid):
            ok, why = accepted(mc, cl100k, f"ok-{k}", schema, text)
            assert ok, (text, why)
        for k, text in enumerate(invalid):
            sid = f"bad-{k}"
            tokens = cl100k.encode(text)
            n, r = drive(mc, sid, {"json_schema": schema}, tokens)
            res = r.seqs[sid]
            if res.status is FAILED:   # a closed sub-document the validator refused
                assert "JSON schema" in res.reason, (text, res.reason)
            elif n < len(tokens):      # a row refused one of its tokens
                assert res.status is READY and not bit(r, sid, tokens[n]), (text, n, res)
            else:                      # every token went in: the document may still grow, never end
                assert res.status is READY and not res.accepting and not bit(r, sid, eos), (text, res)
            mc.close(sid)


@pytest.mark.parametrize("case", list(CASES))
def test_strict_mode_keeps_llguidances_grammar(strict, cl100k, case):  # noqa: F811 (a fixture)
    """Strict mode compiles each of these schemas with llguidance's own grammar, which refuses the
    first valid document (what complete mode fixes); documents it takes still end only when valid."""
    schema, valid, _, verdict = CASES[case]
    with MaskClient(strict.address, want_forced_tokens=False) as mc:
        ok, why = accepted(mc, cl100k, "strict", schema, valid[0])
        assert verdict == "refused" and not ok, (valid[0], why)


def test_the_rewrites_leave_other_schemas_alone():
    from maskd.server.engines.llguidance_engine import LLGuidanceEngine
    from maskd.server.json_schema import whole_schema
    ok = LLGuidanceEngine._regex_ok
    for schema in ({"type": "integer", "minimum": 0, "maximum": 10},          # integer ranges are exact
                   {"type": "object", "properties": {"a": {}, "b": {}}},      # keys in schema order
                   {"allOf": [{"type": "object"}, {"properties": {"a": {}}}]},   # one member declares keys
                   {"const": 2 ** 53}, {"enum": [1, 2.5, "x"]}):
        assert whole_schema(schema, ok) == (schema, frozenset()), schema
    for schema in ({"type": "number", "minimum": 0}, {"maximum": 0.9999999}):   # bounds stay (numbers.py)
        assert whole_schema(schema, ok) == (schema, frozenset()), schema
    grammar, words = whole_schema({"type": ["number", "null"], "minimum": 0, "const": BIG}, ok)
    assert grammar == {"type": ["number", "null"], "minimum": 0,
                       "anyOf": [{"type": "integer", "minimum": BIG - 1, "maximum": BIG + 1}]}
    assert words == {"const"}
    grammar, _ = whole_schema({"const": 10 ** 30}, ok)   # past llguidance's integer ranges: any integer
    assert grammar == {"anyOf": [{"type": "integer"}]}
