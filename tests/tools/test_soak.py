"""`maskd soak` and `maskd chaos` (short runs here; the long ones are in docs/reliability.md)."""
import json

import pytest

from maskd import cli
from maskd_tools.conformance import SAMPLE_DIR


def run(mode, tmp_path, *extra):
    out = tmp_path / mode
    rc = cli.main([mode, "--tokenizer", "cl100k", "--data", str(SAMPLE_DIR), "--batch", "8", "--out", str(out),
                   *extra])
    return rc, json.loads((out / f"{mode}.json").read_text())


def test_soak_checks_every_row_and_samples_memory(tmp_path):
    rc, report = run("soak", tmp_path, "--minutes", "0.15", "--sample-every", "0.5")
    assert rc == 0 and report["passed"]
    assert report["rows_checked"] > 100 and report["rows_differing"] == 0 and report["failed_sequences"] == 0
    assert report["memory"]["readings"] >= 6 and report["memory"]["flat"]


def test_chaos_kills_the_server_and_no_sequence_fails(tmp_path):
    rc, report = run("chaos", tmp_path, "--minutes", "0.4", "--kill-every", "6")
    assert rc == 0 and report["passed"], report
    assert report["kills"] >= 1 and report["client_recoveries"] >= 1
    assert report["rows_differing"] == 0 and report["failed_sequences"] == 0 and report["completed_sequences"] > 0


@pytest.mark.parametrize("args,message", [(["--minutes", "x"], "invalid float value"),
                                          (["--mode", "moon"], "invalid choice")])
def test_chaos_refuses_garbage_flags(args, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["chaos", *args])
    assert message in capsys.readouterr().err
