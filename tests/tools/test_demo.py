"""``maskd demo`` end to end, reduced: embedded server, tiny random Llama, JSON rows all valid."""
import io
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from maskd import cli  # noqa: E402
from maskd.tools.demo import DEMO_SCHEMAS, run_demo  # noqa: E402


def test_run_demo_reduced(tmp_path):
    out_file = tmp_path / "demo.json"
    printed = io.StringIO()
    names = ["enums", "bounded_arrays", "order"]
    rows = run_demo(names, samples=2, max_new_tokens=96, seed=3, hidden_size=32, layers=1,
                    threads=2, json_out=out_file, out=printed)
    written = json.loads(out_file.read_text(encoding="utf-8"))
    assert written == rows
    assert [r["schema"] for r in written] == [n for n in names for _ in range(2)]
    for r in written:
        assert {"schema", "tokens", "valid", "finished", "wait_p50_ms", "wait_p99_ms"} <= set(r)
        assert r["valid"] and r["finished"], r
        assert r["tokens"] > 0
        assert isinstance(json.loads(r["output"]), dict)
    text = printed.getvalue()
    assert "wait p50 ms" in text and "6/6 outputs valid" in text


def test_greedy_decoding():
    rows = run_demo(["integer_ranges"], samples=2, greedy=True, max_new_tokens=64, hidden_size=32,
                    layers=1, out=None)
    assert all(r["valid"] for r in rows)


def test_cli_registers_demo():
    parser = cli.build_parser()
    args = parser.parse_args(["demo", "--schemas", "enums", "--samples", "1", "--json", "x.json"])
    assert args.func.__name__ == "cmd_demo"
    assert args.schemas == ["enums"] and args.json_out == "x.json"
    assert set(DEMO_SCHEMAS) >= {"enums", "booleans", "short_strings", "bounded_arrays", "integer_ranges"}


def test_unknown_schema_name():
    with pytest.raises(ValueError, match="unknown demo schemas"):
        run_demo(["nope"], out=None)


def test_opportunistic_masking_samples_first_and_resamples_only_refused_tokens():
    """--opportunistic: every token is sampled from unmasked logits and checked by the server; the
    random model's tokens are nearly all refused, so rows come back and every output is still valid."""
    printed = io.StringIO()
    rows = run_demo(["enums", "booleans"], samples=2, max_new_tokens=64, seed=1, hidden_size=32, layers=1,
                    opportunistic=True, out=printed)
    assert rows and all(r["valid"] and r["finished"] for r in rows), rows
    for r in rows:
        assert 0 < r["resampled"] <= r["tokens_checked"]
        assert r["tokens_checked"] >= r["tokens"]        # every token of the output was checked
    assert "of steps needed a row" in printed.getvalue()
    args = cli.build_parser().parse_args(["demo", "--opportunistic", "--model", "some/dir"])
    assert args.opportunistic and args.model == "some/dir"


def test_a_model_directory_that_is_not_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a transformers model directory"):
        run_demo(["enums"], model_dir=tmp_path, out=None)
