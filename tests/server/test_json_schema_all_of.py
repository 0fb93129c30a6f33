"""Complete mode takes properties that come from several ``allOf`` members in any order (issue 50,
item 4), whatever shape joins the members: notes (``title``, ``description``) that differ,
``allOf`` nested in a member, chains of references (``Dog`` is ``Pet`` and more, ``Pet`` is
``Animal`` and more), ``unevaluatedProperties`` beside them (draft 2019-09 on). Through a real
server: valid documents go in token by token and may end (EOS allowed); a document missing a
required key or holding a key the schema forbids never ends, and a forbidden key is refused where
it is written where the grammar can say so. Keys in the schema's order stay the rule for objects
that take their properties from one place (tests/server/test_json_schema_numbers.py's last test)."""
import pytest
from test_complete_mode import complete  # noqa: F401 -- the server in complete mode
from test_json_schema_numbers import FAILED, READY, accepted, bit, drive

from maskd_client import MaskClient

A = {"properties": {"a": {"type": "string"}}, "required": ["a"]}
B = {"properties": {"b": {"type": "integer"}}, "required": ["b"]}
C = {"properties": {"c": {"type": "boolean"}}, "required": ["c"]}
# A key no member declares, refused by a row before the document's last token (not only at its end).
WRITTEN = "refused where written"

# class -> (schema, valid documents, invalid documents: text or (text, WRITTEN))
CASES = {
    "members' notes differ": (
        {"allOf": [{"title": "A", "description": "has a", "type": "object", **A},
                   {"title": "B", "description": "has b", "type": "object", **B}]},
        ['{"b": 1, "a": "x"}', '{"a": "x", "b": 1}'], ['{"b": 1}', '{"b": "1", "a": "x"}']),
    "allOf nested in a member": (
        {"allOf": [{"allOf": [A, B]}, C]},
        ['{"c": true, "b": 1, "a": "x"}', '{"b": 1, "a": "x", "c": false}', '{"a": "x", "b": 1, "c": true}'],
        ['{"b": 1, "c": true}', '{"c": true, "a": "x"}']),
    "reference chain": (
        {"$defs": {"animal": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                   "pet": {"allOf": [{"$ref": "#/$defs/animal"},
                                     {"properties": {"owner": {"type": "string"}}, "required": ["owner"]}]}},
         "allOf": [{"$ref": "#/$defs/pet"}, {"properties": {"breed": {"type": "string"}}, "required": ["breed"]}]},
        ['{"breed": "x", "owner": "o", "name": "n"}', '{"owner": "o", "name": "n", "breed": "x"}'],
        ['{"breed": "x", "owner": "o"}', '{"name": "n", "breed": "x"}']),
    "closed by the parent's additionalProperties": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "additionalProperties": False, "allOf": [A, B]},
        ['{"b": 1, "a": "x"}'], [('{"b": 1, "a": "x", "c": 1}', WRITTEN), '{"b": 1}']),
    "closed by unevaluatedProperties": (
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
         "unevaluatedProperties": False, "allOf": [A, B]},
        ['{"b": 1, "a": "x"}', '{"a": "x", "b": 1}'], [('{"b": 1, "a": "x", "c": 1}', WRITTEN), '{"b": 1}']),
    "unevaluatedProperties through a reference": (
        {"type": "object", "unevaluatedProperties": {"type": "integer"},
         "$defs": {"base": {"type": "object", **A}}, "allOf": [{"$ref": "#/$defs/base"}, B]},
        ['{"b": 1, "z": 3, "a": "x"}', '{"a": "x", "b": 1}'], [('{"b": 1, "a": "x", "c": "s"}', WRITTEN), '{"b": 1}']),
    # draft-07 does not know unevaluatedProperties: any other key may follow
    "unevaluatedProperties before 2019-09": (
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "unevaluatedProperties": False,
         "allOf": [A, B]},
        ['{"b": 1, "a": "x"}', '{"b": 1, "a": "x", "c": 1}'], ['{"b": 1}']),
    # a union member is written out: (A and B and O1) or (A and B and O2), each branch in any order
    "a member that is a oneOf": (
        {"allOf": [A, B, {"oneOf": [{"properties": {"k": {"const": "x"}}, "required": ["k"]},
                                    {"properties": {"k": {"const": "y"}, "m": {"type": "integer"}},
                                     "required": ["k", "m"]}]}]},
        ['{"k": "x", "b": 1, "a": "x"}', '{"m": 1, "a": "x", "k": "y", "b": 1}'],
        ['{"b": 1, "a": "x"}', '{"k": "y", "b": 1, "a": "x"}', '{"k": "z", "b": 1, "a": "x"}']),
    "a member that is an anyOf, closed, relaxed schema": (
        {"type": "object", "additionalProperties": False, "required": ["kind"],
         "properties": {"kind": {}, "a": {}, "r": {}, "w": {}, "z": {"not": {"const": 1}}},
         "allOf": [A, {"anyOf": [
             {"properties": {"kind": {"const": "c"}, "r": {"type": "number"}}, "required": ["r"]},
             {"properties": {"kind": {"const": "s"}, "w": {"type": "number"}}, "required": ["w"]}]}]},
        ['{"r": 1, "a": "x", "kind": "c"}', '{"w": 2, "z": 2, "kind": "s", "a": "x"}'],
        ['{"r": 1, "a": "x", "kind": "s"}', ('{"r": 1, "a": "x", "kind": "c", "q": 1}', WRITTEN),
         '{"w": 2, "kind": "s", "a": "x", "z": 1}']),
    "in items": (
        {"type": "array", "items": {"allOf": [A, B]}},
        ['[{"b": 1, "a": "x"}, {"a": "y", "b": 2}]'], ['[{"b": 1}]', '[{"b": 1, "a": "x"}, {"a": "y"}]']),
}


@pytest.mark.parametrize("case", list(CASES))
def test_all_of_members_in_any_order(complete, cl100k, case):  # noqa: F811 (a fixture)
    schema, valid, invalid = CASES[case]
    eos = cl100k.eos_token_ids[0]
    with MaskClient(complete.address, want_forced_tokens=False) as mc:
        for k, text in enumerate(valid):
            ok, why = accepted(mc, cl100k, f"ok-{k}", schema, text)
            assert ok, (text, why)
        for k, item in enumerate(invalid):
            text, where = item if isinstance(item, tuple) else (item, None)
            sid = f"bad-{k}"
            tokens = cl100k.encode(text)
            n, r = drive(mc, sid, {"json_schema": schema}, tokens)
            res = r.seqs[sid]
            if where == WRITTEN:
                assert n < len(tokens) - 1 and res.status is READY and not bit(r, sid, tokens[n]), (text, n, res)
            elif res.status is FAILED:   # a closed sub-document the validator refused
                assert "JSON schema" in res.reason, (text, res.reason)
            elif n < len(tokens):        # a row refused one of its tokens
                assert res.status is READY and not bit(r, sid, tokens[n]), (text, n, res)
            else:                        # every token went in: the document may still grow, never end
                assert res.status is READY and not res.accepting and not bit(r, sid, eos), (text, res)
            mc.close(sid)


def test_the_fold_is_exact_and_leaves_schema_order_alone():
    """What the grammar takes: members folded into one object with literal pattern properties;
    unevaluatedProperties becomes additionalProperties only where nothing else evaluates keys and
    the dialect knows it; one object's own properties keep the schema's order."""
    from maskd.server.engines.llguidance_engine import LLGuidanceEngine
    from maskd.server.json_schema import whole_schema
    from maskd.server.json_schema.relax import free_all_of_order, merge_object_intersections
    ok = LLGuidanceEngine._regex_ok
    grammar, words = whole_schema({"allOf": [{"allOf": [{"title": "x", **A}, B]}, {"title": "y", **C}]}, ok)
    assert grammar == {"title": "x", "patternProperties": {"^a$": {"type": "string"}, "^b$": {"type": "integer"},
                                                           "^c$": {"type": "boolean"}}}
    assert "required" in words
    closed = {"type": "object", "unevaluatedProperties": False, "allOf": [A, B]}
    assert free_all_of_order(closed, ok)["additionalProperties"] is False
    assert merge_object_intersections(closed, ok)["additionalProperties"] is False
    for kept in ({**closed, "$schema": "http://json-schema.org/draft-07/schema#"},      # unknown there
                 {**closed, "anyOf": [{"properties": {"k": {}}}, {"properties": {"m": {}}}]},   # evaluates keys
                 {**closed, "allOf": [A, {"$ref": "#/$defs/b"}], "$defs": {"b": B}}):   # not folded here
        assert "unevaluatedProperties" in merge_object_intersections(kept, ok), kept
    # a member with properties and a union of its own beside a union member: left as it was
    two = {"allOf": [{**A, "oneOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
                     {"oneOf": [{"properties": {"u": {}}}, {"properties": {"v": {}}}]}]}
    assert whole_schema(two, ok) == (two, frozenset())
    plain = {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"]}
    assert whole_schema(plain, ok) == (plain, frozenset())


def test_a_writer_that_follows_its_rows_never_reaches_a_dead_end(complete, cl100k):  # noqa: F811 (a fixture)
    """The writers of test_no_dead_ends.py (both styles, 3 seeds, each job 4 times) on each class's
    schema, guided by its first valid document: none ends where its rows let it in but no valid
    document can follow."""
    from generation_writer import TokenTable, write
    table = TokenTable(cl100k)
    jobs = [(name, schema, valid[0]) for name, (schema, valid, _) in CASES.items()] * 4
    outcomes = []
    for style in ("guide", "invent"):
        for seed in range(3):
            outcomes += write(complete.address, cl100k, table, jobs, seed=seed, follow=0.8, max_tokens=80,
                              style=style)
    dead = [f"{o.name}: {o.text[-80:]!r}: {o.reason[:160]}" for o in outcomes if o.status == "dead end"]
    assert not dead, dead
    assert sum(o.status == "finished" for o in outcomes) >= len(outcomes) // 4
