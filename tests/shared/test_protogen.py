"""The generated protobuf/gRPC code in maskd/v1 is reproducible from proto/ and not stale."""

from maskd_tools import protogen


def test_generated_code_is_fresh(tmp_path):
    written = protogen.generate(tmp_path)
    assert written
    repo_v1 = protogen.REPO_ROOT / "maskd" / "v1"
    for path in (tmp_path / "maskd" / "v1").glob("*.py*"):
        committed = repo_v1 / path.name
        assert committed.exists(), f"{path.name} is generated but not in maskd/v1: run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"maskd/v1/{path.name} is stale: run `make proto`"


def test_client_side_import_needs_no_engine():
    import subprocess
    import sys
    code = ("import sys; import maskd_client, maskd.rowcodec, maskd.specs; "
            "bad=[m for m in ('llguidance','xgrammar','ray','torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
