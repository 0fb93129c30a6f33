"""The relaxation of complete mode: every step widens the schema (what the original accepts, the
relaxed one accepts too), and each kind of llguidance refusal has a step that gets past it."""
import json

import jsonschema_rs
import pytest

from maskd.server.engines import GrammarCompileError, create_engine
from maskd.server.json_schema.relax import (
    RelaxError,
    any_key_order,
    drop_bad_regexes,
    drop_huge_bounds,
    drop_property_counts,
    drop_ref_siblings,
    first_of_all_of,
    inline_intersected_refs,
    map_schemas,
    merge_object_intersections,
    merge_pattern_properties,
    open_cycles,
    relax,
    unordered_constants,
    without_all_of,
)
from maskd.specs import GrammarSpec


@pytest.fixture(scope="module")
def engine(cl100k):
    return create_engine("llguidance", cl100k, threads=1, json_schema_mode="complete")


def valid(schema, value):
    return jsonschema_rs.validator_for(schema, offline=True).is_valid(value)


def no_regex_ok(pattern):
    return "(?=" not in pattern and "(?!" not in pattern


INSTANCES = [{}, {"a": 1}, {"a": "x"}, {"ab": 1, "b": 2}, {"x1": 5, "y": [1, 2]}, [1, 2], 5, 1e20, -1e20, "s",
             {"a": {"b": 1}}, {"k": "v", "kk": "vv"}]


@pytest.mark.parametrize("rewrite,schema", [
    (drop_bad_regexes, {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?!x).*$"}},
                        "patternProperties": {"^(?=k)": {"type": "string"}, "^y": {"type": "array"}},
                        "additionalProperties": False}),
    (merge_pattern_properties, {"type": "object", "patternProperties": {"a": {"type": "integer"},
                                                                        "b": {"type": "integer", "minimum": 2}},
                                "additionalProperties": False}),
    (drop_huge_bounds, {"type": "number", "minimum": -1e16, "maximum": 1e30}),
    (drop_ref_siblings, {"$defs": {"o": {"type": "object"}}, "$ref": "#/$defs/o", "required": ["a"]}),
    (first_of_all_of, {"allOf": [{"type": "object"}, {"required": ["a"]}, {"maxProperties": 1}]}),
    (without_all_of, {"allOf": [{"type": "object"}, {"required": ["a"]}]}),
    (drop_property_counts, {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 2}),
    (lambda schema, ok: merge_object_intersections(inline_intersected_refs(schema, ok), ok), {
        "$defs": {"base": {"properties": {"a": {"type": "integer"}}, "required": ["a"]}},
        "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "string"}}}], "not": {"const": 1}}),
    (any_key_order, {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "required": ["a", "b"],
                     "additionalProperties": False, "anyOf": [{"required": ["x1"]}, {"required": ["ab"]}]}),
])
def test_every_rewrite_widens(rewrite, schema):
    relaxed = rewrite(json.loads(json.dumps(schema)), no_regex_ok)
    assert relaxed != schema
    for value in INSTANCES:
        if valid(schema, value):
            assert valid(relaxed, value), (value, relaxed)


def test_rewrites_touch_schemas_only_never_data():
    schema = {"const": {"pattern": "(?=x)", "allOf": [1, 2]}, "enum": [{"minimum": 1e99}],
              "properties": {"pattern": {"type": "string", "pattern": "(?=y)"}}}
    out = map_schemas(schema, lambda node: {k: v for k, v in node.items() if k != "pattern"})
    assert out["const"] == schema["const"] and out["enum"] == schema["enum"]
    assert out["properties"] == {"pattern": {"type": "string"}}   # a property named "pattern" stays


def test_rewrites_reach_ref_targets_outside_schema_keywords():
    schema = {"misc": {"d": {"type": "string", "pattern": "(?=x)"}}, "properties": {"a": {"$ref": "#/misc/d"}}}
    assert drop_bad_regexes(schema, no_regex_ok)["misc"]["d"] == {"type": "string"}


@pytest.mark.parametrize("schema,step", [
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, None),
    ({"type": "object", "properties": {"d": {"type": "string", "pattern": "/^[0-9]{4}$/"}, "n": {"not": {}}}},
     "regexes the grammar cannot parse"),
    ({"type": "object", "patternProperties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "propertyNames": {"maxLength": 3}}, "overlapping patternProperties merged"),
    ({"type": "integer", "minimum": -9223372036854775808, "maximum": 9223372036854775807, "not": {"const": 0}},
     "number bounds"),
    # a branch beside the object's properties that cannot be written out (pattern properties): the
    # object keeps its order, and its property counts go to the validator
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"$ref": "#/$defs/b"}],
      "$defs": {"b": {"patternProperties": {"^b": {}}}}, "minProperties": 1, "not": {"const": {}}},
     "min/maxProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1, "not": {"const": {}}},
     "properties in any order"),
])
def test_relax_gets_past_each_kind_of_refusal(engine, schema, step):
    with pytest.raises(GrammarCompileError):
        create_engine("llguidance", engine.tokenizer, threads=1).compile(GrammarSpec.create("json_schema", schema))
    compiled = engine.compile(GrammarSpec.create("json_schema", schema))
    assert compiled.checker is not None
    if step:
        steps = relax(schema, _try(engine), engine._regex_ok).steps
        assert any(step in s for s in steps), steps


def _try(engine):
    spec = GrammarSpec.create("json_schema", {})

    def try_compile(candidate, lenient):
        try:
            engine._json_grammar(spec, candidate, lenient)
            return None
        except GrammarCompileError as exc:
            return str(exc)
    return try_compile


def test_what_even_the_relaxation_cannot_build_stays_refused_with_the_reason(engine):
    with pytest.raises(GrammarCompileError, match="complete mode: even the relaxed schema does not compile"):
        engine.compile(GrammarSpec.create("json_schema", {"not": {}, "properties": {"a": {"$ref": "#/$defs/none"}}}))
    with pytest.raises(RelaxError):
        relax({"$ref": "#/nowhere"}, lambda s, lenient: "Unknown reference", lambda p: True)
    with pytest.raises(RelaxError):
        relax(True, lambda s, lenient: None, lambda p: True)


def test_a_loosening_asked_for_inside_the_schema_is_not_taken(cl100k):
    """x-guidance lenient in a user's schema would make strict mode drop keywords without a check."""
    strict = create_engine("llguidance", cl100k, threads=1)
    schema = {"x-guidance": {"lenient": True, "coerce_one_of": True}, "type": "integer", "not": {"const": 1}}
    with pytest.raises(GrammarCompileError, match="not"):
        strict.compile(GrammarSpec.create("json_schema", schema))


def test_any_key_order_turns_declared_properties_into_literal_patterns():
    schema = {"type": "object", "properties": {"a.b": {"type": "integer"}, "c d": {"type": "string"}},
              "required": ["a.b"], "additionalProperties": {"type": "boolean"},
              "$defs": {"inner": {"properties": {"x": {"properties": {"y": {}}, "required": ["y"]}}}}}
    out = any_key_order(schema, lambda p: True)
    assert out["patternProperties"] == {"^a\\.b$": {"type": "integer"}, "^c d$": {"type": "string"}}
    assert "properties" not in out and "required" not in out and out["additionalProperties"] == {"type": "boolean"}
    inner = out["$defs"]["inner"]["patternProperties"]["^x$"]   # nested and $defs too, deepest first
    assert inner == {"patternProperties": {"^y$": {}}}


@pytest.mark.parametrize("schema,path", [
    # llguidance merges declared properties by name where schemas intersect, pattern properties it does not
    ({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}, ("allOf", 0)),
    ({"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]}, ()),
    ({"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]}, ("anyOf", 0)),
    ({"$defs": {"t": {"properties": {"a": {}}}}, "$ref": "#/$defs/t", "required": ["a"]}, ("$defs", "t")),
    # its own pattern may match a declared name: both would apply to that key
    ({"properties": {"ab": {}}, "patternProperties": {"^a": {"type": "integer"}}}, ()),
])
def test_any_key_order_leaves_intersected_objects_in_order(schema, path):
    out = any_key_order(schema, lambda p: True)
    node = out
    for part in path:
        node = node[int(part)] if isinstance(node, list) else node[part]
    assert "properties" in node


def test_any_key_order_follows_a_ref_whose_siblings_constrain_nothing():
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "$ref": "#/definitions/t", "comments": ["x"],
              "definitions": {"t": {"properties": {"a": {}}, "required": ["a"]}}}
    assert any_key_order(schema, lambda p: True)["definitions"]["t"] == {"patternProperties": {"^a$": {}}}


def test_relaxed_grammar_takes_keys_in_any_order_and_keeps_the_order_where_it_must(engine):
    from maskd.specs import GrammarSpec
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a"], "additionalProperties": {"type": "boolean"}, "not": {"const": {}}}
    compiled = engine.compile(GrammarSpec.create("json_schema", schema))
    m = engine.new_matcher(compiled)
    for text, ok in (('{"z": true, "b": "x", "a": 1}', True), ('{"b": 1}', False), ('{"z": 1}', False)):
        tokens = engine.tokenizer.encode(text)
        assert (m.validate(tokens) == len(tokens)) is ok, text


def test_a_cycle_llguidance_cannot_build_is_opened_one_level_down(engine):
    """llguidance refuses a recursive reference reached through intersecting siblings (a declared
    property that a patternProperties entry also matches): the references back to the target inside
    it become {}, so the grammar recurses once and the validator checks what lies deeper."""
    node = {"anyOf": [{"$ref": "#/definitions/item"}, {"type": "string"}]}   # lenient reads oneOf so too
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "$ref": "#/definitions/item",
              "definitions": {"item": {"type": "object", "properties": {"basic": node, "n": {"type": "integer"}},
                                       "patternProperties": {".*": node}, "dependencies": {"n": ["basic"]}}}}
    opened = open_cycles(schema, "#/definitions/item")
    assert opened["$ref"] == "#/definitions/item"   # the way in stays
    assert opened["definitions"]["item"]["properties"]["basic"]["anyOf"][0] == {}
    for value in INSTANCES + [{"basic": {"basic": {"x": 1}}}, {"basic": "s", "n": 1}]:
        if valid(schema, value):
            assert valid(opened, value), value
    from maskd.specs import GrammarSpec
    compiled = engine.compile(GrammarSpec.create("json_schema", schema))
    assert compiled.checker is not None
    steps = relax(schema, _try(engine), engine._regex_ok).steps
    assert any("references back to #/definitions/item" in s for s in steps), steps


def test_a_pattern_written_for_ecma_262_is_read_as_ecma_262():
    """jsonschema-rs's regex engine reads "[[a-z]" as a nested class and refuses a lone "]" in a
    draft-04 schema; ECMA-262 (JSON Schema's dialect) reads both as literals."""
    from maskd.server.json_schema.validation import SchemaValidator, ecma_regex
    assert ecma_regex("^[[a-z]*[-]?[a-z]*]*$") == "^[\\[a-z]*[-]?[a-z]*\\]*$"
    assert ecma_regex("[^\\]a&&b]x\\[") == "[^\\]a\\&&b]x\\["
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "string", "pattern": "^[[a-z]*]*$"}
    v = SchemaValidator(schema, frozenset())
    assert v.check("[ab]]") is None and v.check("AB") is not None


SHAPES = {"type": "object", "propertyNames": {"maxLength": 6},   # llguidance refuses propertyNames whole
          "properties": {"shape": {"enum": ["circle", "square"]}, "r": {"type": "number"},
                         "side": {"type": "number"}},
          "oneOf": [{"properties": {"shape": {"const": "circle"}}, "required": ["shape", "r"]},
                    {"properties": {"shape": {"const": "square"}, "side": {}, "colour": {"type": "string"}},
                     "required": ["side"], "additionalProperties": False}]}


def test_object_intersections_are_written_out_exactly():
    """P and (B1 or B2) as (P and B1) or (P and B2): the same documents, each branch an object that
    stands alone (so its keys may come in any order)."""
    merged = merge_object_intersections(SHAPES, lambda p: True)
    assert "properties" not in merged and len(merged["oneOf"]) == 2
    square = merged["oneOf"][1]
    assert square["properties"]["shape"] == {"allOf": [{"enum": ["circle", "square"]}, {"const": "square"}]}
    assert square["properties"]["r"] is False   # declared by P only: the branch's additionalProperties
    assert square["properties"]["side"] == {"type": "number"}
    assert square["properties"]["colour"] == {"type": "string"} and square["required"] == ["side"]
    cases = [{"shape": "circle", "r": 1}, {"r": 1, "shape": "circle"}, {"shape": "square", "side": 2},
             {"side": 2, "colour": "red"}, {"shape": "square", "side": 2, "r": 1}, {"shape": "circle"},
             {"side": "2"},
             {"shape": "circle", "r": 1, "colour": 5}, {"colour": 1, "side": 2}, *INSTANCES]
    for value in cases:
        assert valid(merged, value) == valid(SHAPES, value), value
    folded = merge_object_intersections({"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                                   {"properties": {"a": {"minimum": 2}, "b": {}}}]}, lambda p: True)
    assert folded == {"properties": {"a": {"allOf": [{"type": "integer"}, {"minimum": 2}]}, "b": {}}, "required": ["a"]}


def test_shapes_take_their_keys_in_any_order_once_relaxed(engine):
    from maskd.specs import GrammarSpec
    compiled = engine.compile(GrammarSpec.create("json_schema", SHAPES))   # oneOf: llguidance refuses it whole
    for text in ('{"r": 2, "shape": "circle"}', '{"colour": "red", "side": 1, "shape": "square"}'):
        tokens = engine.tokenizer.encode(text)
        assert engine.new_matcher(compiled).validate(tokens) == len(tokens), text


def test_constant_objects_take_their_keys_in_any_order(engine):
    """llguidance matches a const / enum object as one serialization's text; once relaxed, the same
    object in another key order is accepted (which keys must be there: the validator)."""
    from maskd.specs import GrammarSpec
    schema = {"enum": [{"b": 2, "a": {"y": [1, {"z": 0}], "x": None}}, "s"], "not": {"const": 5}}
    loose = unordered_constants(schema, lambda p: True)
    for value in [{"a": {"x": None, "y": [1, {"z": 0}]}, "b": 2}, "s", {"b": 2}, {"b": 3}, 5, *INSTANCES]:
        if valid(schema, value):
            assert valid(loose, value), value
    compiled = engine.compile(GrammarSpec.create("json_schema", schema))
    for text, ok in (('{"a": {"x": null, "y": [1, {"z": 0}]}, "b": 2}', True), ('"s"', True),
                     ('{"b": 3}', False), ('{"a": {"x": 1}}', False)):
        tokens = engine.tokenizer.encode(text)
        assert (engine.new_matcher(compiled).validate(tokens) == len(tokens)) is ok, text


# The usual way to extend a schema: an allOf of a reference and the object's own properties.
EXTENDED = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {
    "base": {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}, "n": {"type": "integer"}}},
    "item": {"allOf": [{"$ref": "#/definitions/base"},
                       {"properties": {"kind": {"enum": ["a", "b"]}, "n": {"minimum": 2}}, "required": ["kind"]}]},
    "tagged": {"type": ["object", "null"], "properties": {"t": {"type": "string"}}, "additionalProperties": False,
               "oneOf": [{"$ref": "#/definitions/one"}, {"$ref": "#/definitions/two"}]},
    "one": {"properties": {"t": {"const": "one"}}}, "two": {"properties": {"t": {"const": "two"}}}},
    "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/definitions/item"}},
                                     "base": {"$ref": "#/definitions/base"},
                                     "tagged": {"$ref": "#/definitions/tagged"}},
    "propertyNames": {"maxLength": 8}}


def test_a_reference_intersected_in_an_allof_is_copied_and_written_out():
    """An allOf member that is only a reference (and an anyOf / oneOf branch beside an object's own
    properties) becomes a copy of its target, so the intersection is written out and the target is
    intersected by reference nowhere: every object here takes its keys in any order. Exact: the same
    documents before and after."""
    ok = lambda p: True
    inlined = inline_intersected_refs(EXTENDED, ok)
    item = inlined["definitions"]["item"]["allOf"][0]
    assert item["properties"]["id"] == {"type": "string"} and "$ref" not in item
    assert inlined["definitions"]["tagged"]["oneOf"][0] == {"properties": {"t": {"const": "one"}}}
    merged = merge_object_intersections(inlined, ok)
    assert "allOf" not in merged["definitions"]["item"]
    ordered = any_key_order(merged, ok)
    for name in ("item", "base"):
        assert "properties" not in ordered["definitions"][name], name   # literal patterns: any order
    cases = [{"items": [{"id": "x", "kind": "a", "n": 3}]}, {"items": [{"kind": "a", "id": "x"}]},
             {"items": [{"id": "x", "kind": "a", "n": 1}]}, {"items": [{"id": "x"}]}, {"base": {"n": 1, "id": "y"}},
             {"tagged": {"t": "two"}}, {"tagged": {"t": "three"}}, {"tagged": None}, {"tagged": {"u": 1}}, *INSTANCES]
    for value in cases:
        assert valid(merged, value) == valid(EXTENDED, value), value
    # what stays a reference: a target with an identifier of its own (its references would change
    # meaning), and every reference of a schema with dynamic references
    with_id = {"allOf": [{"$ref": "#/$defs/b"}], "$defs": {"b": {"$id": "https://x.example/b", "properties": {}}}}
    assert inline_intersected_refs(with_id, ok) == with_id
    dynamic = {"allOf": [{"$ref": "#/$defs/b"}], "$defs": {"b": {"properties": {"x": {"$dynamicRef": "#n"}}}}}
    assert inline_intersected_refs(dynamic, ok) == dynamic


def test_extended_objects_take_their_keys_in_any_order_through_the_engine(engine):
    from maskd.specs import GrammarSpec
    compiled = engine.compile(GrammarSpec.create("json_schema", EXTENDED))
    for text in ('{"items": [{"n": 2, "kind": "b", "id": "x"}], "tagged": {"t": "one"}}',
                 '{"base": {"n": 1, "id": "y"}, "items": []}'):
        tokens = engine.tokenizer.encode(text)
        assert engine.new_matcher(compiled).validate(tokens) == len(tokens), text
