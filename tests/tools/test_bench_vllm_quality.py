"""maskd bench vllm --quality without an engine: the fixed set, the scoring of an output, the
classification of two outputs of one request, the summary and its table."""
from __future__ import annotations

import json

import pytest

from maskd_tools.bench import vllm_quality
from maskd_tools.bench.extraction_prompts import QUALITY_SET, strict_schema

CASE = next(c for c in QUALITY_SET if c.name == "contact-1")   # a nested object


def test_the_set_has_fifty_cases_whose_answers_are_valid_and_right():
    assert len(QUALITY_SET) >= 50 and len({c.name for c in QUALITY_SET}) == len(QUALITY_SET)
    assert len({c.prompt.model for c in QUALITY_SET}) >= 12
    for case in QUALITY_SET:
        assert vllm_quality.score(case, "maskd-compact", json.dumps(case.answer)) == {"valid": True, "right": True}


def test_scoring_reads_json_out_of_prose_only_unconstrained():
    answer = json.dumps(CASE.answer, indent=2)
    chatty = f"Sure! Here it is:\n```json\n{answer}\n```\nAnything else? {{not json}}"
    assert vllm_quality.score(CASE, "unconstrained", chatty) == {"valid": True, "right": True}
    assert vllm_quality.score(CASE, "maskd-flexible", chatty) == {"valid": False, "right": False}
    wrong = {**CASE.answer, "address": {"street": "4 Oak Road", "city": "Paris"}}
    assert vllm_quality.score(CASE, "guidance", json.dumps(wrong)) == {"valid": True, "right": False}
    extra = {**CASE.answer, "phone": "555"}   # strict: no other key
    assert vllm_quality.score(CASE, "guidance", json.dumps(extra)) == {"valid": False, "right": False}
    assert vllm_quality.score(CASE, "guidance", answer[:-3]) == {"valid": False, "right": False}   # cut at max_tokens
    assert vllm_quality.score(CASE, "unconstrained", "I cannot help.") == {"valid": False, "right": False}


@pytest.mark.parametrize("a, b, a_pieces, b_pieces, kind", [
    ('{"a":1}', '{"a":1}', ['{"', 'a', '":', '1', '}'], ['{"', 'a', '":', '1', '}'], "identical"),
    ('{"a":1}', '{"a":1}', ['{"', 'a', '":', '1', '}'], ['{', '"a', '":', '1', '}'], "token boundary"),
    ('{"name":"Al ice"}', '{"name":"Alfred"}', ['{"', 'name', '":"', 'Al', ' ice', '"}'],
     ['{"', 'name', '":"', 'Alf', 'red', '"}'], "token boundary"),
    ('{"a": 1, "b": "x y"}', '{"a":1,"b":"x y"}', [], [], "whitespace"),
    ('{"a":1,\n"b":2', '{"a":1,"b":3}', [], [], "whitespace"),   # parted where one writes whitespace
    ('{"b":2,"a":1}', '{"a":1,"b":2}', [], [], "key order"),
    ('{"a":1.0}', '{"a":1}', [], [], "same value, other spelling"),
    ('{"name":"Bob"}', '{"name":"Rob"}', ['{"', 'name', '":"', 'Bob', '"}'], ['{"', 'name', '":"', 'Rob', '"}'],
     "different value"),
    ('{"a":"x y"}', '{"a":"xy"}', [], [], "whitespace"),   # parted at a space inside a string
])
def test_classify_names_the_first_difference(a, b, a_pieces, b_pieces, kind):
    assert vllm_quality.classify(a, b, a_pieces, b_pieces) == kind
    assert kind in ("identical", *vllm_quality.DIFFERENCES)


def test_whitespace_inside_strings_is_kept_when_squeezed():
    assert vllm_quality.squeeze('{ "a" : "x \\" y" ,\n "b":[1, 2] }') == '{"a":"x \\" y","b":[1,2]}'


def test_requests_carry_each_mode_and_whitespace():
    greedy = vllm_quality.body(CASE, "maskd-unbounded", None, 50)
    assert greedy["temperature"] == 0 and greedy["logprobs"] and greedy["max_tokens"] == 50
    assert json.loads(greedy["vllm_xargs"]["maskd"]) == {"json": strict_schema(CASE.prompt.model), "max_whitespace": 0}
    compact = json.loads(vllm_quality.body(CASE, "maskd-compact", 2, 50)["vllm_xargs"]["maskd"])
    assert compact["disable_any_whitespace"] is True
    sampled = vllm_quality.body(CASE, "guidance-flexible", 2, 50)
    assert (sampled["temperature"], sampled["seed"]) == (vllm_quality.TEMPERATURE, 2)
    # the schema's own x-guidance options override the engine's disable_any_whitespace
    assert sampled["structured_outputs"] == {"json": {**strict_schema(CASE.prompt.model),
                                                      "x-guidance": {"whitespace_flexible": True}}}
    compact = vllm_quality.body(CASE, "guidance-compact", None, 50)["structured_outputs"]["json"]
    assert compact["x-guidance"] == {"whitespace_flexible": False}
    plain = vllm_quality.body(CASE, "unconstrained", None, 50)
    assert "structured_outputs" not in plain and "vllm_xargs" not in plain
    with pytest.raises(ValueError, match="unknown quality mode 'xgrammar'"):
        vllm_quality.body(CASE, "xgrammar", None, 50)
    assert {m for pair in vllm_quality.PAIRS for m in pair} == set(vllm_quality.MODES) - {"unconstrained"}


def test_summary_counts_per_mode_and_decoding_and_compares_the_same_requests():
    def result(mode, case, seed, text, pieces=(), tokens=10):
        return {"mode": mode, "case": case, "seed": seed, "text": text, "pieces": list(pieces), "tokens": tokens,
                "finish": "stop", "error": None, "valid": text.startswith("{"), "right": text == '{"a":1}'}

    results = [result("guidance", "x-0", None, '{"a":1}'), result("guidance", "x-1", None, '{"a":2}'),
               result("guidance", "x-0", 0, '{"a":1}', tokens=20),
               result("maskd-compact", "x-0", None, '{"a":1}'), result("maskd-compact", "x-1", None, '{"a":3}'),
               result("maskd-compact", "x-0", 0, '{"a": 1}', tokens=30),
               result("unconstrained", "x-0", None, "no")]
    summary = vllm_quality.summarize(results, [("guidance", "maskd-compact")])
    rows = {(r["mode"], r["decoding"]): r for r in summary["rows"]}
    assert rows["guidance", "greedy"] == {"mode": "guidance", "decoding": "greedy", "requests": 2, "valid": 2,
                                          "right": 1, "mean_tokens": 10, "finish": {"stop": 2}, "errors": 0}
    assert rows["maskd-compact", "sampled"]["mean_tokens"] == 30 and rows["unconstrained", "greedy"]["valid"] == 0
    greedy, sampled = summary["compared"]
    assert (greedy["decoding"], greedy["compared"], greedy["identical"]) == ("greedy", 2, 1)
    assert greedy["differences"] == {"different value": 1}
    assert greedy["examples"]["different value"][0] == {"case": "x-1", "seed": None, "guidance": '{"a":2}',
                                                         "maskd-compact": '{"a":3}'}
    assert sampled["differences"] == {"whitespace": 1} and sampled["identical"] == 0
    text = "\n".join(vllm_quality.markdown({"cases": 2, "samples": 1, "max_tokens": 50, "summary": summary}))
    assert "| guidance | greedy | 2/2 | 1/2 | 10.0 | stop 2 | 0 |" in text
    assert "guidance against maskd-compact, greedy: 1/2 identical" in text and "different value 1" in text
