"""Tool-call arrays composed from per-tool pieces (issue 19).

A ``tool_choice: "required"`` array is served as a router (the array, the names, the end) and one
piece per tool (its parameters, compiled once). The composed rows must be the rows of the same
array compiled whole, at every position: checked on deepseek-v4 (129,280 tokens) over valid calls
written in three layouts (compact JSON: one) and three tokenizations, and over random walks that
favour the tokens at the boundaries (``{"``, ``"}},``, ...), in both JSON-schema modes and both
whitespace options (compact JSON forces bytes across the router and a piece); rollback, validate,
forced tokens and draft rows too. Through a real server: 200 tools registered, then a request with all of them
but one and one new tool, in another order, ready from 199 cached pieces; a valid call of the new
tool accepted token by token; a call naming a tool outside the set refused.
"""
import collections
import dataclasses
import json
import random
import time

import llguidance
import numpy as np
import pytest

from conftest import MASKBENCH, needs_maskbench
from maskd.server import MaskServer, ServerConfig
from maskd.server.engines import GrammarCompileError
from maskd.server.engines.llguidance_engine import LLGuidanceEngine
from maskd.server.json_schema import CallArrayChecker, document_checker
from maskd.specs import GrammarSpec
from maskd_client import MaskClient, SeqStatus

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["location"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string", "minLength": 2},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            "filters": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                                         "after": {"type": "string", "format": "date"}}}},
        "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},
    {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"},
                                         "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}}},
        "required": ["to"],
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                            "required": ["x", "y"]}}}}},
    {"type": "function", "function": {"name": "set_flags", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}, "note": {"type": ["string", "null"]},
                                         "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["on", "code"]}}},
]
# Valid outputs, with "}" and "{" inside strings, empty parameters, nested objects and arrays.
CALLS = [
    [{"name": "get_weather", "parameters": {"location": "Paris, \"FR\" {x}", "unit": "c"}}],
    [{"name": "search", "parameters": {"query": "maskd}}", "limit": 5,
                                       "filters": {"tags": ["a", "b}"], "after": "2024-01-02"}}},
     {"name": "ping", "parameters": {}}],
    [{"name": "move", "parameters": {"to": {"x": 1.5, "y": -2}, "path": [{"x": 0, "y": 0}, {"x": 1, "y": 1}]}}],
    [{"name": "set_flags", "parameters": {"on": True, "note": None, "code": "ABC"}},
     {"name": "get_weather", "parameters": {"location": "x"}}],
]


@pytest.fixture(scope="module", params=[("strict", "flexible"), ("complete", "flexible"), ("strict", "compact"),
                                        ("complete", "compact")], ids="-".join)
def grammars(request, deepseek):
    """(engine, the array compiled whole, the same array composed from its pieces, whitespace)."""
    mode, whitespace = request.param
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode=mode)
    spec = GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "required", "whitespace": whitespace})
    parts = engine.composed_parts(spec)
    assert parts is not None and parts.names == tuple(t["function"]["name"] for t in TOOLS)
    pieces = [engine.compile(engine.piece_spec(spec, text)) for text in parts.pieces]
    composed = engine.compose(spec, parts, pieces)
    assert composed is not None
    whole = engine.compile(dataclasses.replace(spec, parts=None))    # no parts: compiled whole
    return engine, whole, composed, whitespace


def layouts(grammars, calls) -> list[str]:
    """The texts of ``calls`` the grammar takes: compact JSON only, or three layouts (names as they
    are: a name's enum takes its characters, not their escapes)."""
    compact = json.dumps(calls, separators=(",", ":"), ensure_ascii=False)
    if grammars[3] == "compact":
        return [compact]
    return [json.dumps(calls, ensure_ascii=False), compact, json.dumps(calls, indent=1, ensure_ascii=False)]


def rows(engine, matchers, drafts=None):
    out = engine.allocate(len(matchers) * (1 + max((len(d) for d in drafts or [()]), default=0)))
    at = list(range(0, out.shape[0], out.shape[0] // len(matchers)))
    engine.fill_batch(matchers, at, drafts, out)
    return out, at


class Pair:
    """A sequence of the whole grammar and one of the composed grammar, stepped together."""

    def __init__(self, grammars):
        self.engine, whole, composed, _ = grammars
        self.whole, self.composed = self.engine.new_matcher(whole), self.engine.new_matcher(composed)

    def check(self, where) -> np.ndarray:
        out, at = rows(self.engine, [self.whole, self.composed])
        assert np.array_equal(out[at[0]], out[at[1]]), f"rows differ at {where}"
        assert self.whole.is_accepting() == self.composed.is_accepting(), where
        assert self.whole.is_stopped() == self.composed.is_stopped(), where
        return out[at[0]]

    def take(self, token: int, where) -> bool:
        a, b = self.whole.consume([token]), self.composed.consume([token])
        assert (a is None) == (b is None), (where, a, b)
        return a is None


def tokenizations(tok, text: str, rng: random.Random):
    data = text.encode()
    yield tok.ll.tokenize_bytes(data)                                                 # canonical
    yield [t for ch in text for t in tok.ll.tokenize_bytes(ch.encode())]              # a character a token
    cuts = sorted(rng.sample(range(1, len(data)), len(data) // 3))
    yield [t for a, b in zip([0, *cuts], [*cuts, len(data)]) for t in tok.ll.tokenize_bytes(data[a:b])]


def valid_calls(grammars, tok, rng: random.Random, forced: bool = False) -> int:
    """Steps both grammars over every valid call of CALLS (``valid_outputs``)."""
    return valid_outputs(grammars, tok, rng, CALLS, forced)


def valid_outputs(grammars, tok, rng: random.Random, outputs, forced: bool = False) -> int:
    """Steps both grammars over each of ``outputs`` (JSON values the grammar takes), in each layout
    and tokenization, comparing rows (and forced tokens where ``forced``) at every position and
    that each ends accepting; returns how many positions."""
    positions = 0
    for output in outputs:
        for text in layouts(grammars, output):
            for tokens in tokenizations(tok, text, rng):
                pair = Pair(grammars)
                for i, t in enumerate(tokens):
                    pair.check((text, i))
                    if forced:
                        assert pair.composed.forced_tokens() == pair.whole.forced_tokens(), (text, i)
                    assert pair.take(t, (text, i)), f"a valid output was refused: {text!r} at token {i}"
                    positions += 1
                pair.check((text, "end"))
                assert pair.composed.is_accepting()
    return positions


def test_composed_rows_equal_the_whole_grammars_on_valid_calls(grammars, deepseek):
    positions = valid_calls(grammars, deepseek, random.Random(0))
    assert positions > (700 if grammars[3] == "compact" else 2000), positions


def test_composed_rows_equal_the_whole_grammars_on_random_walks(grammars, deepseek):
    """Walks that take a structural token (one with {}[]",:) two times in three: they reach the
    boundaries of the parameters with every token the row allows there."""
    rng = random.Random(1)
    ll = deepseek.ll
    structural = np.array([any(c in (ll.decode_bytes([t]) if not ll.is_special_token(t) else b"") for c in b'{}[]",:')
                           for t in range(ll.vocab_size)])

    def choose(allowed):
        pick = allowed[structural[allowed]]
        return int(rng.choice(pick if len(pick) and rng.random() < 0.67 else allowed))
    random_walks(grammars, ll, walks=12, steps=70, choose=choose)


def random_walks(grammars, ll, walks: int, steps: int, choose, forced: bool = False) -> None:
    """Steps both grammars together on tokens ``choose`` picks from each row (compared at every
    step, and the forced tokens too where ``forced``), until the grammar stops."""
    for walk in range(walks):
        pair = Pair(grammars)
        for step in range(steps):
            row = pair.check(("walk", walk, step))
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:ll.vocab_size])
            if not len(allowed):
                break
            if forced:
                assert pair.composed.forced_tokens() == pair.whole.forced_tokens(), ("walk", walk, step)
            assert pair.take(choose(allowed), ("walk", walk, step))
            if pair.whole.is_stopped():
                break


def test_rollback_validate_forced_tokens_and_drafts_match_the_whole_grammar(grammars, deepseek):
    engine = grammars[0]
    text = layouts(grammars, CALLS[1])[0]
    tokens = deepseek.ll.tokenize_bytes(text.encode())
    pair = Pair(grammars)
    for i, t in enumerate(tokens):
        ahead = tokens[i:i + 6] + [deepseek.eos_token_ids[0]]
        assert pair.composed.validate(ahead) == pair.whole.validate(ahead), i
        forced = pair.composed.forced_tokens()
        assert pair.whole.validate(forced) == len(forced), (i, forced)
        draft = ahead[:4]
        out, at = rows(engine, [pair.whole, pair.composed], [draft, draft])
        n = 1 + len(draft)
        assert np.array_equal(out[at[0]:at[0] + n], out[at[1]:at[1] + n]), f"draft rows differ at {i}"
        pair.check(("after drafts", i))
        pair.take(t, i)
        if i % 7 == 6:      # back over the last tokens (across a boundary, at times) and forward again
            pair.whole.rollback(5)
            pair.composed.rollback(5)
            pair.check(("rolled back", i))
            for u in tokens[i - 4:i + 1]:
                pair.take(u, ("again", i))
    pair.check("end")
    assert pair.composed.is_accepting()


def test_compact_arrays_force_the_span_into_the_parameters_as_the_whole_grammar(grammars, deepseek):
    """In compact JSON, after ``"parameters`` the array forces ``":{"`` and the tool's first key,
    which neither the router (its ``":{`` may go on with any key) nor the piece forces alone:
    the composed row is the whole grammar's one token there, and so are the forced tokens."""
    if grammars[3] != "compact":
        pytest.skip("flexible JSON allows whitespace at every boundary: nothing is forced across one")
    ll = deepseek.ll
    for prefix in ('[{"name":"get_weather","parameters', '[{"name":"get_weather","parameters"',
                   '[{"name":"move","parameters":', '[{"name":"ping","parameters'):
        pair = Pair(grammars)
        for i, t in enumerate(t for ch in prefix for t in ll.tokenize_bytes(ch.encode())):
            assert pair.take(t, (prefix, i))
        row = pair.check(prefix)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:ll.vocab_size])
        forced = pair.composed.forced_tokens()
        assert forced == pair.whole.forced_tokens(), prefix
        if prefix == '[{"name":"get_weather","parameters':
            assert len(allowed) == 1 and forced[:1] == allowed.tolist(), (prefix, allowed)


def test_a_tool_whose_parameters_are_forced_whole_gives_the_whole_grammars_rows_in_compact_json(deepseek):
    """Compact JSON, a tool whose parameters admit one object (``{"k":1}``): after its name the
    array forces ``","parameters":{"k":1}`` and on, across the router, the piece and the router
    again; the rows and forced tokens are the whole grammar's there (the forced span chopped as
    llguidance chops it), and on random walks."""
    forced_whole = {"type": "function", "function": {"name": "fixed", "parameters": {
        "type": "object", "properties": {"k": {"const": 1}}, "required": ["k"], "additionalProperties": False}}}
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    for single in (True, False):
        spec = GrammarSpec.from_request({"tools": [forced_whole, TOOLS[0]], "tool_choice": "required",
                                         "parallel_tool_calls": not single, "whitespace": "compact"})
        parts = engine.composed_parts(spec)
        composed = engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces])
        grammars = (engine, engine.compile(dataclasses.replace(spec, parts=None)), composed, "compact")
        calls = [[{"name": "fixed", "parameters": {"k": 1}}],
                 [{"name": "get_weather", "parameters": {"location": "x"}}, {"name": "fixed", "parameters": {"k": 1}}]]
        assert valid_outputs(grammars, deepseek, random.Random(7), calls[:1] if single else calls, forced=True) > 40
        rng = random.Random(8)
        random_walks(grammars, deepseek.ll, walks=6, steps=40,
                     choose=lambda allowed, rng=rng: int(rng.choice(allowed)), forced=True)


def test_a_call_naming_a_tool_outside_the_set_is_refused(grammars, deepseek):
    engine, _, composed, _ = grammars
    m = engine.new_matcher(composed)
    tokens = deepseek.ll.tokenize_bytes(b'[{"name": "delete_everything"')
    assert m.validate(tokens) < len(tokens)
    assert m.consume(tokens) is not None


def test_the_same_tools_in_another_order_share_the_router_and_give_the_whole_grammars_rows(grammars, deepseek):
    """A reordered set is a new array (its text, its grammar id) with the router its set already
    has: built once per set of names, its rows are still the whole grammar's of either order."""
    engine, _, _, whitespace = grammars
    reordered = TOOLS[2:] + TOOLS[:2]
    first = GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "required", "whitespace": whitespace})
    spec = GrammarSpec.from_request({"tools": reordered, "tool_choice": "required", "whitespace": whitespace})
    parts = engine.composed_parts(spec)
    assert spec.text != first.text and parts.names != engine.composed_parts(first).names
    router = engine.router(spec, parts)
    assert router is engine.router(first, engine.composed_parts(first))
    composed = engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces], router)
    whole = engine.compile(dataclasses.replace(spec, parts=None))
    assert valid_calls((engine, whole, composed, whitespace), deepseek, random.Random(2), forced=True) > 700
    m = engine.new_matcher(composed)
    outside = deepseek.ll.tokenize_bytes(b'[{"name": "delete_everything"')
    assert m.validate(outside) < len(outside)


def test_a_tool_whose_parameters_take_more_than_objects_makes_the_array_compile_whole(deepseek):
    """A parameters schema without ``"type": "object"`` takes other values too (vLLM's array, and
    so the whole grammar, takes ``"parameters": "x"``), where the router stands an object in for
    the parameters: such an array is not composed, and the whole grammar serves it."""
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    for params in ({"properties": {"a": {"type": "integer"}}}, {"type": ["object", "string"]}):
        spec = GrammarSpec.from_request({"tools": [TOOLS[0], {"type": "function", "function": {
            "name": "loose", "parameters": params}}], "tool_choice": "required"})
        parts = engine.composed_parts(spec)
        assert engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces]) is None
        whole = engine.new_matcher(engine.compile(dataclasses.replace(spec, parts=None)))
        assert whole.consume(deepseek.ll.tokenize_bytes(b'[{"name": "loose", "parameters": "x"}]')) is None


def test_the_final_check_validates_each_calls_parameters(deepseek):
    schema = {"type": "object", "properties": {"q": {"type": "string", "minLength": 3}}, "required": ["q"]}
    checker = CallArrayChecker({"f": document_checker(schema, deepseek).validator}, deepseek)
    assert checker.final(None, bytearray(b'[{"name": "f", "parameters": {"q": "abc"}}, {"name": "g", '
                                          b'"parameters": {}}]')) is None
    problem = checker.final(None, bytearray(b'[{"name": "f", "parameters": {"q": "ab"}}]'))
    assert problem is not None and "tool call 1 (f)" in problem
    assert "not a finished JSON array" in checker.final(None, bytearray(b'[{"name": "f"'))


# -- names that share their starts -----------------------------------------------------------------
# Names that share their starts (one a whole prefix of another), with "." ":" "-" and characters
# outside ASCII, and parameters that force their first key in compact JSON (so the forced bytes run
# from inside a name through ``","parameters":{`` into the piece) or force nothing: the router's
# names force bytes there, and the rows and forced tokens must still be the whole grammar's.
KEYED = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False}
OPEN = {"type": "object", "properties": {"n": {"type": "integer"}}}
PREFIXED = ["get", "get_weather", "get_weather_hourly", "get_time", "search", "search_web", "set_flags", "a",
            "fs.read", "fs.read_file", "db:query", "db-query"]
SPACED = ["naïve_lookup", "say hello", "say hello twice", "get_weather"]


def named_tools(names):
    return [{"type": "function", "function": {"name": n, "parameters": KEYED if i % 2 else OPEN}}
            for i, n in enumerate(names)]


def named_call(names, name) -> list:
    return [{"name": name, "parameters": {"q": "x}y"} if names.index(name) % 2 else {"n": 3}}]


@pytest.fixture(scope="module", params=[("prefixed", "flexible"), ("prefixed", "compact"), ("spaced", "compact")],
                ids="-".join)
def named(request, deepseek):
    which, whitespace = request.param
    names = PREFIXED if which == "prefixed" else SPACED
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    spec = GrammarSpec.from_request({"tools": named_tools(names), "tool_choice": "required", "whitespace": whitespace})
    parts = engine.composed_parts(spec)
    composed = engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces])
    assert composed is not None
    whole = engine.compile(dataclasses.replace(spec, parts=None))
    return (engine, whole, composed, whitespace), names


def test_names_that_share_their_starts_give_the_whole_grammars_rows_and_forced_tokens(named, deepseek):
    grammars, names = named
    positions = valid_outputs(grammars, deepseek, random.Random(5), [named_call(names, n) for n in names], forced=True)
    assert positions > 80 * len(names), positions


def test_names_that_share_their_starts_on_random_walks(named, deepseek):
    """Walks that take the row's tokens at random: inside names most rows are small, so the walks
    try the names' every split, and tokens that close a name or run on past it."""
    grammars, _ = named
    rng = random.Random(7)
    random_walks(grammars, deepseek.ll, walks=30, steps=24, choose=lambda allowed: int(rng.choice(allowed)),
                 forced=True)


def test_a_name_outside_the_set_is_refused_where_it_leaves_the_names(named, deepseek):
    grammars, _ = named
    engine, _, composed, _ = grammars
    for wrong in ('[{"name": "get_w"', '[{"name": "getx', '[{"name": "fs.reads', '[{"name": "b'):
        tokens = [t for ch in wrong for t in deepseek.ll.tokenize_bytes(ch.encode())]
        m = engine.new_matcher(composed)
        refused = m.consume(tokens)
        assert refused is not None and "tool-call array" in refused, (wrong, refused)


# Many names with long shared starts, as real tool sets have (BFCL_java_25, BFCL_javascript_17,
# Glaive's search_news_<hash>): the router takes any string there and the composed matcher holds the
# name to the set, so its rows and forced tokens inside the names are the set's own, built from the
# names (not a router compiled per set).
FAMILIES = ["BFCL_java_", "BFCL_javascript_", "BFCL_parallel_", "BFCL_simple_", "Glaiveai2K---search_news_",
            "Glaiveai2K---search_product_", "get_", "get_weather"]


def many_names(count: int, rng: random.Random) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        family = rng.choice(FAMILIES)
        names.add(family + (rng.choice(["", str(rng.randrange(200)), f"{rng.randrange(1 << 16):04x}"])
                            or "x"))
    return sorted(names)


@pytest.fixture(scope="module", params=["flexible", "compact"])
def many_named(request, deepseek):
    names = many_names(60, random.Random(11))
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="complete")
    spec = GrammarSpec.from_request({"tools": named_tools(names), "tool_choice": "required",
                                     "whitespace": request.param})
    parts = engine.composed_parts(spec)
    composed = engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces])
    assert composed is not None and composed.handle.names is not None
    return (engine, engine.compile(dataclasses.replace(spec, parts=None)), composed, request.param), names


def test_sixty_names_with_long_shared_starts_give_the_whole_grammars_rows_and_forced_tokens(many_named, deepseek):
    grammars, names = many_named
    rng = random.Random(12)
    assert valid_outputs(grammars, deepseek, rng, [named_call(names, n) for n in rng.sample(names, 12)],
                         forced=True) > 400
    random_walks(grammars, deepseek.ll, walks=40, steps=14, choose=lambda allowed: int(rng.choice(allowed)),
                 forced=True)


def test_one_router_serves_every_set_of_names(deepseek):
    """The router depends on the bound and the whitespace, not on the names: a new set of tools is
    composed from the router the server has (a 200-name router was 0.8 ms of llguidance per set)."""
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    specs = [GrammarSpec.from_request({"tools": named_tools(names), "tool_choice": "required"})
             for names in (PREFIXED, SPACED, ["other"])]
    routers = {id(engine.router(spec, engine.composed_parts(spec))) for spec in specs}
    assert len(routers) == 1
    single = GrammarSpec.from_request({"tools": named_tools(SPACED), "tool_choice": "required",
                                       "parallel_tool_calls": False})
    assert id(engine.router(single, engine.composed_parts(single))) not in routers


def test_a_name_json_writes_with_an_escape_makes_the_array_compile_whole(deepseek):
    """The composed matcher matches a name's bytes as they are: a name with a '"', a backslash or a
    control character (which JSON writes escaped) is not composed, and the whole grammar serves it."""
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    for odd in ('say "hi"', "back\\slash", "tab\there"):
        spec = GrammarSpec.from_request({"tools": named_tools(["plain", odd]), "tool_choice": "required"})
        parts = engine.composed_parts(spec)
        assert engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces]) is None
        whole = engine.new_matcher(engine.compile(dataclasses.replace(spec, parts=None)))
        call = json.dumps([{"name": odd, "parameters": {"q": "x"}}])
        assert whole.consume(deepseek.ll.tokenize_bytes(call.encode())) is None, odd


# -- through a real server ------------------------------------------------------------------------
SHAPES = [
    lambda i: {"type": "object", "properties": {f"city_{i}": {"type": "string"}, "days": {"type": "integer"}},
               "required": [f"city_{i}"]},
    lambda i: {"type": "object", "properties": {f"query_{i}": {"type": "string", "maxLength": 40},
                                                "exact": {"type": "boolean"}},
               "required": [f"query_{i}", "exact"], "additionalProperties": False},
    lambda i: {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}},
                                                f"mode_{i}": {"enum": ["fast", "slow"]}}},
    lambda i: {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}, f"label_{i}": {"type": "string"}},
               "required": ["point"]},
]
INSTANCES = [
    lambda i: {f"city_{i}": "Lyon {centre}", "days": 3},
    lambda i: {f"query_{i}": "the \"best\" tools}", "exact": True},
    lambda i: {"ids": [1, 2, 3], f"mode_{i}": "slow"},
    lambda i: {"point": {"x": 0.5, "y": -1}, f"label_{i}": "home"},
]


def tool(i: int, tag: str) -> dict:
    return {"type": "function", "function": {"name": f"tool_{tag}_{i}", "description": f"tool {i} of set {tag}",
                                             "parameters": SHAPES[i % len(SHAPES)](i)}}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(host="127.0.0.1", port=0, tokenizer="deepseek-v4", threads=2, compile_threads=2,
                                  metrics_port=0)).start()
    yield srv
    srv.stop(grace=1.0)


def pieces(server, outcome: str) -> float:
    return server.metrics.tool_pieces.labels(outcome)._value.get()


def first_row(mc, sid: str, spec) -> tuple[object, np.ndarray]:
    mc.open(sid, spec)
    r = mc.step({sid: []})
    deadline = time.monotonic() + 120     # generous: CI runs on a loaded 2-core machine
    while r.seqs[sid].status is SeqStatus.WAITING:
        assert time.monotonic() < deadline, "the tool set never compiled"
        r = mc.step({sid: []})
    return r, r.bitmask[r.seqs[sid].row].copy()


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def test_a_request_with_one_new_tool_among_200_known_is_composed_from_cached_pieces(server, deepseek):
    known = [tool(i, "a") for i in range(200)]
    with MaskClient(server.address) as mc:
        # All 200 tools new: composed too, from 200 pieces compiled at once in the compile workers
        # (sooner than one whole compile), which the next requests find.
        compiled, composed = pieces(server, "compiled"), pieces(server, "composed")
        first = mc.register({"tools": known, "tool_choice": "required"})
        assert pieces(server, "composed") == composed + 1
        assert pieces(server, "compiled") == compiled + 200   # counted when they are put to compile
        compiled, cached, composed = (pieces(server, k) for k in ("compiled", "cached", "composed"))
        new = tool(1000, "b")          # parameters never seen
        later = known[1:] + [new]
        random.Random(3).shuffle(later)
        request = {"tools": later, "tool_choice": "required"}
        gid = mc.register(request)
        assert gid != first
        assert pieces(server, "compiled") - compiled == 1       # only the new tool's parameters
        assert pieces(server, "cached") - cached == 199
        assert pieces(server, "composed") - composed == 1
        # The same array sent as its json_schema text (as vLLM builds it) is the same grammar.
        text = GrammarSpec.from_request(request).text
        assert mc.register({"json_schema": json.loads(text)}) == gid
        # Pieces are the parameters' content: a renamed tool with known parameters compiles nothing.
        compiled = pieces(server, "compiled")
        mc.register({"tools": [tool(i, "renamed") for i in range(10)], "tool_choice": "required"})
        assert pieces(server, "compiled") == compiled

        # A valid call of the new tool, token by token: every token in its row, then EOS.
        call = json.dumps([{"name": new["function"]["name"], "parameters": INSTANCES[1000 % 4](1000)}])
        r, row = first_row(mc, "good", request)
        tokens = deepseek.ll.tokenize_bytes(call.encode())
        for i, t in enumerate(tokens):
            assert allowed(row, t), f"token {deepseek.ll.decode_bytes([t])!r} of a valid call refused"
            r = mc.step({"good": [t]})
            expected = SeqStatus.FINISHED if i == len(tokens) - 1 else SeqStatus.READY   # "]": only EOS may follow
            assert r.seqs["good"].status is expected, r.seqs["good"]
            row = r.bitmask[r.seqs["good"].row].copy()
        assert allowed(row, deepseek.eos_token_ids[0]) and r.seqs["good"].accepting
        mc.close("good")

        # A call of the tool that left the set: refused where its name stops being a name of the set.
        gone = known[0]["function"]["name"]
        r, row = first_row(mc, "bad", request)
        status = SeqStatus.READY
        for t in deepseek.ll.tokenize_bytes(json.dumps([{"name": gone}]).encode()):
            if not allowed(row, t):
                break
            r = mc.step({"bad": [t]})
            row = r.bitmask[r.seqs["bad"].row].copy()
        else:
            pytest.fail(f"a call of {gone!r}, not in the set, was allowed whole")
        r = mc.step({"bad": [t]})
        status = r.seqs["bad"].status
        assert status is SeqStatus.FAILED and "tool-call array" in r.seqs["bad"].reason, r.seqs["bad"]
        mc.close("bad")


BAD_PATTERN = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}


UNIQUE_TAGS = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}}


def test_a_tool_whose_parameters_compile_only_relaxed_makes_the_array_compile_whole(server, deepseek):
    """Complete mode relaxes a schema the grammar engine refuses and checks its documents; those
    checks work on whole documents, so such an array is compiled whole (and still served whole:
    a call with duplicate tags is refused where it would close)."""
    composed = pieces(server, "composed")
    request = {"tools": [tool(1, "c"), UNIQUE_TAGS], "tool_choice": "required"}
    with MaskClient(server.address) as mc:
        mc.register(request)
        assert pieces(server, "composed") == composed
        r, row = first_row(mc, "dup", request)
        for t in deepseek.ll.tokenize_bytes(b'[{"name": "tag", "parameters": {"tags": [1, 1'):
            assert allowed(row, t)
            r = mc.step({"dup": [t]})
            row = r.bitmask[r.seqs["dup"].row].copy()
        assert not allowed(row, deepseek.ll.tokenize_bytes(b"]")[0])
        mc.close("dup")


def test_a_tool_whose_parameters_do_not_compile_fails_the_request_as_compiled_whole(deepseek):
    from maskd.server.grammar_cache import GrammarCache

    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    cache = GrammarCache(engine, compile_threads=1)
    try:
        spec = GrammarSpec.from_request({"tools": [tool(1, "c"), BAD_PATTERN], "tool_choice": "required"})
        entry = cache.wait(cache.lookup(spec))
        assert entry.compiled is None
        with pytest.raises(Exception) as whole:
            engine.compile(GrammarSpec(spec.kind, spec.text))
        assert entry.error == str(whole.value)
    finally:
        cache.close()


# -- a piece's check ------------------------------------------------------------------------------
def piece_outcomes(engine, spec: GrammarSpec) -> tuple[bool, bool]:
    """(the piece's check passes, the piece's own grammar builds a matcher) for one tool's spec."""
    try:
        compiled = engine.compile(engine.piece_spec(spec, spec.text))
    except GrammarCompileError:
        return False, not llguidance.LLMatcher(
            engine.ll, llguidance.LLMatcher.grammar_from_lark(
                f"start: %json {engine._json_text(spec, json.loads(spec.text), lenient=False)} /(?s:.*)/\n"),
            log_level=0).is_error()
    matcher = llguidance.LLMatcher(engine.ll, compiled.handle, log_level=0)
    return True, not matcher.is_error()


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}},      # a bad pattern
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},               # a dangling $ref
    {"type": "object", "properties": {"x": {"type": "string", "minLength": 5, "maxLength": 2}}},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 1, "maximum": 3}}},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}},
])
def test_a_pieces_check_has_the_outcome_of_the_grammar_it_builds(deepseek, schema):
    """A piece is checked as a JSON-schema grammar (half the time of its Lark form) and built later
    from the Lark form: the check passes exactly where the built grammar compiles."""
    for mode in ("strict", "complete"):
        engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode=mode)
        for whitespace in ("flexible", "compact"):
            spec = GrammarSpec.from_dict({"json_schema": schema, "whitespace": whitespace})
            checked, builds = piece_outcomes(engine, spec)
            assert checked == builds, (mode, whitespace, schema)


@needs_maskbench
def test_a_pieces_check_has_the_outcome_of_the_grammar_it_builds_on_maskbench(deepseek):
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    outcomes = collections.Counter()
    for path in sorted(MASKBENCH.glob("*.json")):
        spec = GrammarSpec.from_dict({"json_schema": json.loads(path.read_text(encoding="utf-8"))["schema"]})
        checked, builds = piece_outcomes(engine, spec)
        assert checked == builds, path.name
        outcomes[checked] += 1
    assert outcomes[True] > 900 and outcomes[False] > 100, outcomes    # 949 and 171 (strict, 1,120 files)
