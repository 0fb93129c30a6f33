"""Regenerates the protobuf/gRPC modules in maskd/v1 from the files in proto/maskd/v1.

    python -m maskd.protogen            # write into the source tree
    python -m maskd.protogen --out DIR  # write into DIR (the staleness test compares)
"""
from __future__ import annotations

import argparse
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = PROTO_ROOT / "maskd" / "v1" / "maskd.proto"
# Every proto of the package, each generated on its own (the output of one never depends on another).
PROTO_FILES = (PROTO_FILE, PROTO_ROOT / "maskd" / "v1" / "directory.proto")
GENERATED = ("maskd_pb2.py", "maskd_pb2.pyi", "maskd_pb2_grpc.py")


def _generated_names(proto: pathlib.Path) -> tuple[str, ...]:
    stem = proto.stem
    return (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[pathlib.Path] = []
    for proto in PROTO_FILES:
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto.name} with exit code {rc}")
        written += [out_dir / "maskd" / "v1" / name for name in _generated_names(proto)]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
