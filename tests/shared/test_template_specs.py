"""Templates with named holes as specs (maskd.template_specs): the filled-in schema, the router's,
the id, the depth, the wire and plain forms, and every refusal naming its fault."""
import json

import pytest

from maskd.specs import GrammarSpec, SpecError, json_depth
from maskd.template_specs import TemplateParts, template_parts
from maskd.v1 import maskd_pb2 as pb

OBJ = {"type": "object", "properties": {"q": {"type": "string", "const": {"$hole": "data, not a hole"}}}}
DEEP = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array", "items": {
    "type": "object", "properties": {"c": {"type": "array", "items": {"type": "integer"}}}}}}}}}
TEMPLATE = {
    "title": "null",             # a "null" in the text: written by json's writer, not orjson's
    "type": "object",
    "properties": {
        "first": {"$hole": "x"},
        "list": {"type": "array", "items": {"$hole": "y"}, "minItems": 1},
        "nested": {"type": "object", "properties": {"again": {"$hole": "x"}, "n": {"type": "integer"}}},
        "note": {"enum": [{"$hole": "not a hole either"}]},
    },
    "required": ["first"],
}


def filled(node, path=()):
    """The template filled in the plain way: each hole replaced by its argument."""
    if isinstance(node, dict) and "$hole" in node and set(node) == {"$hole"}:
        return {"x": OBJ, "y": DEEP}[node["$hole"]]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if "properties" in out:
        out["properties"] = {k: filled(v) for k, v in out["properties"].items()}
    if "items" in out:
        out["items"] = filled(out["items"])
    return out


def test_the_filled_in_schema_the_router_and_the_depth():
    parts = template_parts(TEMPLATE, {"y": DEEP, "x": json.dumps(OBJ)})
    assert parts.names == ("x", "y")
    assert json.loads(parts.schema_text()) == filled(TEMPLATE)
    router = parts.router_schema()
    assert router["properties"]["first"] == router["properties"]["list"]["items"] == {"type": "object"}
    assert router["properties"]["nested"]["properties"]["again"] == {"type": "object"}
    assert router["properties"]["note"] == TEMPLATE["properties"]["note"]
    assert parts.nesting() == json_depth(filled(TEMPLATE))
    assert dict(parts.paths) == {("first",): "x", ("list", None): "y", ("nested", "again"): "x"}


def test_the_id_is_of_the_template_and_each_argument():
    spec = GrammarSpec.from_dict({"template": {"schema": TEMPLATE, "arguments": {"x": OBJ, "y": DEEP}}})
    gid = spec.grammar_id("t", "b", "v")
    as_texts = GrammarSpec.from_dict({"template": {"schema": json.dumps(TEMPLATE),
                                                   "arguments": {"y": json.dumps(DEEP), "x": OBJ}}})
    assert as_texts.grammar_id("t", "b", "v") == gid
    swapped = GrammarSpec.from_dict({"template": {"schema": {**TEMPLATE, "required": []},
                                                  "arguments": {"x": OBJ, "y": DEEP}}})
    assert swapped.grammar_id("t", "b", "v") != gid
    other = GrammarSpec.from_dict({"template": {"schema": TEMPLATE, "arguments": {"x": DEEP, "y": OBJ}}})
    assert other.grammar_id("t", "b", "v") != gid
    assert other.parts.router_key() == spec.parts.router_key()
    assert GrammarSpec.create("json_schema", json.loads(spec.text)).grammar_id("t", "b", "v") != gid


def test_the_wire_and_plain_forms_give_the_same_spec():
    spec = GrammarSpec.from_request({"template": {"schema": TEMPLATE, "arguments": {"x": OBJ, "y": DEEP}},
                                     "whitespace": "compact", "max_whitespace": 2})
    msg = spec.to_proto()
    assert msg.WhichOneof("kind") == "template" and set(msg.template.arguments) == {"x", "y"}
    again = GrammarSpec.from_proto(pb.GrammarSpec.FromString(msg.SerializeToString()))
    assert again == spec and again.parts == spec.parts and again.text == spec.text
    plain = GrammarSpec.from_plain(json.loads(json.dumps(spec.to_plain())))
    assert plain == spec and isinstance(plain.parts, TemplateParts) and plain.depth == spec.depth


@pytest.mark.parametrize("schema, arguments, reason", [
    ({"properties": {"a": {"$hole": "a"}}, "anyOf": [{}]}, {"a": OBJ}, "anyOf"),
    ({"properties": {"a": {"$hole": "a"}}, "patternProperties": {"a": {}}}, {"a": OBJ}, "patternProperties"),
    ({"properties": {"a": {"type": "array", "items": {"$hole": "a"}, "uniqueItems": True}}}, {"a": OBJ}, "uniqueItems"),
    ({"additionalProperties": {"$hole": "a"}}, {"a": OBJ}, "under 'properties' or 'items' only"),
    ({"properties": {"a": {"$hole": "a", "type": "object"}}}, {"a": OBJ}, "nothing else"),
    ({"properties": {"a": {"$hole": 3}}}, {"a": OBJ}, "non-empty string"),
    ({"$hole": "a"}, {"a": OBJ}, "a hole itself"),
    ({"properties": {"a": {"type": "string"}}}, {}, "no hole"),
    ({"properties": {"a": {"$hole": "a"}}}, {}, "no argument for the holes ['a']"),
    ({"properties": {"a": {"$hole": "a"}}}, {"a": OBJ, "b": OBJ}, "names ['b']"),
    ({"properties": {"a": {"$hole": "a"}}}, {"a": {"properties": {}}}, "type None"),
    ({"properties": {"a": {"$hole": "a"}}}, {"a": {"type": ["object", "null"]}}, "type ['object', 'null']"),
    ({"properties": {"a": {"$hole": "a"}}}, {"a": {"type": "object", "properties": {"r": {"$ref": "#"}}}}, "$ref"),
    ({"properties": {"a": {"$hole": "a"}}}, {"a": "[1, 2]"}, "a JSON object"),
    ({"properties": {"a": {"$hole": "a"}}}, {"a": "{"}, "not valid JSON"),
    ({"properties": {"a": {"$hole": "a"}}}, {"a": 7}, "not int"),
    ({"properties": {"a": {"$hole": "a"}}}, [], "maps each hole"),
    ("{", {}, "not valid JSON"),
    ([], {}, "not list"),
    ({"properties": {"a": {"$hole": "a"}, "b": {"const": "\u0000maskd-hole\u0000"}}}, {"a": OBJ}, "marks its holes"),
])
def test_a_malformed_template_is_refused_naming_its_fault(schema, arguments, reason):
    with pytest.raises(SpecError) as err:
        GrammarSpec.from_dict({"template": {"schema": schema, "arguments": arguments}})
    assert reason in str(err.value)


def test_the_template_key_takes_its_shape_and_one_constraint_only():
    with pytest.raises(SpecError, match="template is"):
        GrammarSpec.from_request({"template": {"schema": TEMPLATE}})
    with pytest.raises(SpecError, match="exactly one"):
        GrammarSpec.from_request({"template": {"schema": TEMPLATE, "arguments": {}}, "regex": "a"})
    with pytest.raises(SpecError, match="disable_additional_properties"):
        GrammarSpec.from_request({"template": {"schema": TEMPLATE, "arguments": {"x": OBJ, "y": DEEP}},
                                  "disable_additional_properties": True})


@pytest.mark.parametrize("template", ["x", {"schema": TEMPLATE}, {"schema": TEMPLATE, "arguments": 3},
                                      {"schema": TEMPLATE, "arguments": {"x": OBJ}, "more": 1},
                                      {"schema": {"properties": {}}, "arguments": {}}])
def test_a_plain_spec_with_a_malformed_template_is_refused(template):
    plain = GrammarSpec.from_dict({"template": {"schema": TEMPLATE, "arguments": {"x": OBJ, "y": DEEP}}}).to_plain()
    with pytest.raises(SpecError):
        GrammarSpec.from_plain({**plain, "template": template})
