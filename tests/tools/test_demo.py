"""``maskd demo`` end to end: an embedded server on SmolLM2-135M-Instruct's vocabulary, the real
model (``maskd real-model``, built at setup) answering with and without maskd's masks."""
import io
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from maskd import cli
from maskd_tools.demo import DEMO_TASKS, first_json, run_demo


def test_the_real_model_answers_under_masks_validly_and_right(tmp_path):
    out = tmp_path / "rows.json"
    printed = io.StringIO()
    rows = run_demo(["extraction", "tool call"], json_out=out, out=printed)
    assert [(r["task"], r["mode"]) for r in rows] == [("extraction", "free"), ("extraction", "maskd"),
                                                      ("tool call", "free"), ("tool call", "maskd")]
    for r in rows:
        assert r["tokens"] > 0 and r["output"], r
        if r["mode"] == "maskd":
            assert r["valid"], r
            assert r["right"], r        # greedy, float32: "Alice", 31; get_weather(Oslo, celsius)
            assert r["first_step_ms"] > 0 and r["wait_p99_ms"] is not None
    assert json.loads(out.read_text()) == rows
    text = printed.getvalue()
    assert "with maskd" in text and "2/2 valid" in text and "unconstrained" in text


def test_opportunistic_masking_samples_first_and_resamples_only_refused_tokens():
    """--opportunistic: every token is sampled from unmasked logits and checked by the server; rows
    come back only for refused tokens, and every output is still valid."""
    printed = io.StringIO()
    rows = run_demo(["enum"], opportunistic=True, out=printed)
    masked = [r for r in rows if r["mode"] == "maskd"]
    assert masked and all(r["valid"] for r in masked), rows
    for r in masked:
        assert 0 <= r["resampled"] < r["tokens_checked"]
        assert r["tokens_checked"] >= r["tokens"]        # every token of the output was checked
    assert "of steps needed a row" in printed.getvalue()


def test_cli_registers_demo():
    args = cli.build_parser().parse_args(["demo", "--tasks", "enum", "nested", "--json", "x.json", "--opportunistic",
                                          "--model", "some/dir"])
    assert args.func.__name__ == "cmd_demo"
    assert args.tasks == ["enum", "nested"] and args.json_out == "x.json"
    assert args.opportunistic and args.model == "some/dir"
    assert set(DEMO_TASKS) == {"extraction", "nested", "enum", "bounded list", "tool call"}


def test_first_json_reads_an_answer_wrapped_in_prose_or_a_fence():
    assert first_json('Sure! ```json\n{"a": {"b": 1}}\n``` done') == {"a": {"b": 1}}
    assert first_json("{not json} then {\"x\": 2}") == {"x": 2}
    assert first_json("no json here") is None


def test_unknown_task_name():
    with pytest.raises(ValueError, match="unknown demo tasks"):
        run_demo(["nope"], out=None)


def test_a_model_directory_that_is_not_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a transformers model directory"):
        run_demo(["enum"], model_dir=tmp_path, out=None)
