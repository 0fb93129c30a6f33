"""No dead ends in complete mode: a writer that only takes tokens its rows allow never ends in a
sequence the server has to fail (issue 20). Built-in schemas in the core suite, MaskBench-dev's
relaxed schemas when that folder is there."""
import json
import os

import pytest

from conftest import MASKBENCH, needs_maskbench
from generation_writer import TokenTable, write
from maskd.server import MaskServer, ServerConfig

# Keywords complete mode leaves to the validator, each with a valid guide document.
SCHEMAS = {
    "required in any order": ({"type": "object", "required": ["a", "b"], "propertyNames": {"maxLength": 3},
                               "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                              "c": {"type": "boolean"}}}, {"b": "x", "a": 1}),
    "nested required": ({"type": "object", "required": ["o"], "not": {"const": {}},
                         "properties": {"o": {"type": "object", "required": ["x"],
                                              "properties": {"x": {"type": "integer"}, "y": {}}}}},
                        {"o": {"y": 1, "x": 2}}),
    "uniqueItems": ({"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}}},
        {"tags": ["a", "b"]}),
    "oneOf": ({"type": "object", "properties": {"n": {"oneOf": [{"type": "integer", "multipleOf": 2},
                                                                {"type": "integer", "multipleOf": 3}]}},
               "required": ["n"]}, {"n": 4}),
    "dependencies": ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                      "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
                      "dependencies": {"card": ["billing"]}}, {"card": "x", "billing": "y"}),
    "minProperties": ({"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "minProperties": 2,
                       "not": {"required": ["c"]}}, {"a": 1, "b": 2}),
    "if/then": ({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
                 "required": ["kind", "n"], "if": {"properties": {"kind": {"const": "a"}}},
                 "then": {"properties": {"n": {"minimum": 10}}}}, {"kind": "a", "n": 12}),
    # relaxed for a "not" one level down: the root's own anyOf goes with its keys' order
    "anyOf of required keys": ({"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
                                "properties": {"a": {"type": "integer"},
                                               "b": {"type": "integer", "not": {"const": 3}}}}, {"b": 1}),
    "shapes": ({"type": "object", "propertyNames": {"maxLength": 6},
                "properties": {"shape": {"enum": ["circle", "square"]}, "r": {"type": "number"}},
                "oneOf": [{"properties": {"shape": {"const": "circle"}}, "required": ["shape", "r"]},
                          {"properties": {"shape": {"const": "square"}, "side": {"type": "number"}},
                           "required": ["shape", "side"]}]}, {"shape": "square", "side": 2}),
    # a discriminated union (null matches both branches, so llguidance cannot take the oneOf whole):
    # once "type" is written, its branch's required keys keep "properties" open
    "tagged union": ({"type": ["object", "null"], "required": ["type", "properties"], "additionalProperties": False,
                      "properties": {"type": {"type": "string"}, "properties": {"type": "object"}},
                      "oneOf": [{"$ref": "#/definitions/named"}, {"$ref": "#/definitions/linked"}],
                      "definitions": {
                          "named": {"properties": {"type": {"enum": ["name"]}, "properties": {
                              "required": ["name"], "additionalProperties": False,
                              "properties": {"name": {"type": "string"}}}}},
                          "linked": {"properties": {"type": {"enum": ["link"]},
                                                    "properties": {"$ref": "#/definitions/href"}}},
                          "href": {"type": "object", "required": ["href"],
                                   "properties": {"href": {"type": "string"}, "kind": {"type": "string"}}}}},
                     {"type": "link", "properties": {"kind": "proj4", "href": "x"}}),
    # a union whose branch has dependencies between members (OpenAPI 1.2's data types): a value that
    # leaves no branch or breaks a dependency (written before the member that pins the branch, too)
    # would be a dead end
    "union with dependencies": ({"type": "object", "oneOf": [
        {"required": ["$ref"], "properties": {"$ref": {"type": "string"}}, "additionalProperties": False},
        {"required": ["type"], "additionalProperties": False,
         "properties": {"type": {"enum": ["integer", "string"]}, "format": {"type": "string"},
                        "minimum": {"type": "string"}},
         "dependencies": {"format": {"oneOf": [
             {"properties": {"type": {"enum": ["integer"]}, "format": {"enum": ["int32"]}}},
             {"properties": {"type": {"enum": ["string"]}, "format": {"enum": ["date"]}}}]},
             "minimum": {"properties": {"type": {"enum": ["integer"]}}}}}]},
        {"format": "date", "type": "string"}),
}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1)).start()
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture(scope="module")
def table(cl100k):
    return TokenTable(cl100k)


def report(outcomes):
    dead = [o for o in outcomes if o.status == "dead end"]
    counts = {k: sum(o.status == k for o in outcomes) for k in ("finished", "capped", "dead end")}
    counts["finished away from the guide"] = sum(o.status == "finished" and o.strayed for o in outcomes)
    return dead, f"{counts}; dead ends: " + "; ".join(f"{o.name}: {o.text[-80:]!r}: {o.reason[:160]}" for o in dead[:8])


def test_a_writer_that_follows_its_rows_never_reaches_a_dead_end(server, cl100k, table):
    jobs = [(name, schema, json.dumps(doc)) for name, (schema, doc) in SCHEMAS.items()] * 6
    outcomes = []
    for seed in range(3):
        outcomes += write(server.address, cl100k, table, jobs, seed=seed, follow=0.6, max_tokens=80)
    dead, summary = report(outcomes)
    assert not dead, summary
    # not vacuous: documents the writer finished on its own, away from its guide, in several schemas
    # (most others stray into what a random writer cannot finish: a required key it would have to
    # spell out; their rows keep them open, so they reach the cap instead of a dead end)
    strayed = [o for o in outcomes if o.status == "finished" and o.strayed]
    assert len(strayed) >= 20 and len({o.name for o in strayed}) >= 4, summary


@needs_maskbench
def test_no_dead_ends_on_maskbench_dev_relaxed_schemas(cl100k):
    from maskd.server.engines import GrammarCompileError, create_engine
    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    tok = load_tokenizer("deepseek-v4")
    strict = create_engine("llguidance", tok, threads=1, json_schema_mode="strict")
    jobs = []
    for path in sorted(MASKBENCH.glob("*.json")):
        doc = json.loads(path.read_text())
        try:
            strict.compile(GrammarSpec.create("json_schema", doc["schema"]))
            continue   # compiled whole: nothing relaxed
        except GrammarCompileError:
            pass
        valid = [t["data"] for t in doc["tests"] if t["valid"]][:2]
        jobs += [(path.name, doc["schema"], json.dumps(v, ensure_ascii=False)) for v in valid]
    seeds = int(os.environ.get("MASKD_DEAD_END_SEEDS", "1"))   # more writers per guide with a flag
    outcomes = []
    with MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=2)) as srv:
        table = TokenTable(tok)
        for seed in range(1, seeds + 1):
            outcomes += write(srv.address, tok, table, jobs, seed=seed, follow=0.9, max_tokens=200)
    dead, summary = report(outcomes)
    assert len(outcomes) == seeds * len(jobs) and len(jobs) > 100   # the relaxed schemas' valid instances as guides
    # None left (issue 20): 0 of 2,400 writers with MASKD_DEAD_END_SEEDS=20 (5 of 360 at the stop
    # before: a branch-dependent constraint, a date-time leap second; see docs/decisions/0022-complete-mode-row-vetoes.md).
    assert not dead, summary
    assert sum(o.status == "finished" and o.strayed for o in outcomes) >= len(outcomes) // 3, summary
