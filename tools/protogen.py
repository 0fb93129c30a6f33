"""Regenerates maskd/v1 from proto/maskd/v1: protoc's modules plus ``contract.py``.

    python -m maskd_tools.protogen            # write into the source tree (make proto)
    python -m maskd_tools.protogen --out DIR  # write into DIR (the staleness test compares)

``contract.py`` is the contract as typed Python, generated from the descriptors (with the
proto comments as documentation): the constants of the file option ``(maskd.v1.contract)``,
one ``IntEnum`` per proto enum (prefixes stripped), google.rpc's ``Code``, and ``ServerInfo``, a
frozen dataclass with the fields of ``InfoResponse``. Nothing in it is written by hand, so it
cannot drift from the proto.
"""
from __future__ import annotations

import argparse
import json
import keyword
import pathlib
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = PROTO_ROOT / "maskd" / "v1" / "maskd.proto"
# Every proto of the package, each generated on its own (the output of one never depends on another).
PROTO_FILES = (PROTO_FILE, PROTO_ROOT / "maskd" / "v1" / "directory.proto")
CONTRACT_MODULE = "contract.py"

# FieldDescriptorProto types -> Python annotations (proto3 scalars, enums, strings, bytes).
_SCALARS = {1: "float", 2: "float", 3: "int", 4: "int", 5: "int", 6: "int", 7: "int", 8: "bool", 9: "str",
            12: "bytes", 13: "int", 15: "int", 16: "int", 17: "int", 18: "int"}
_TYPE_ENUM, _LABEL_REPEATED = 14, 3


def _generated_names(proto: pathlib.Path) -> tuple[str, ...]:
    stem = proto.stem
    return (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py")


def _protoc(args: list[str]) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", *args])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {args}")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[pathlib.Path] = []
    for proto in PROTO_FILES:
        _protoc([f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(proto)])
        written += [out_dir / "maskd" / "v1" / name for name in _generated_names(proto)]
    target = out_dir / "maskd" / "v1" / CONTRACT_MODULE
    target.write_text(contract_source())
    written.append(target)
    return written


# -- contract.py ------------------------------------------------------------------------------
def _file_descriptor():
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "maskd.pb"
        _protoc([f"--descriptor_set_out={out}", "--include_source_info", "--include_imports", str(PROTO_FILE)])
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    by_name = {f.name: f for f in fds.file}
    return by_name["maskd/v1/maskd.proto"], fds


def _comments(fd) -> dict[tuple[int, ...], str]:
    out = {}
    for loc in fd.source_code_info.location:
        text = (loc.leading_comments or loc.trailing_comments).strip()
        if text:
            out[tuple(loc.path)] = "\n".join(line.strip() for line in text.splitlines())
    return out


def _note(text: str | None, indent: str = "") -> list[str]:
    """A proto comment as `#:` lines (its own line breaks kept)."""
    return [f"{indent}#: {line}".rstrip() for line in text.splitlines()] if text else []


def _doc(text: str, indent: str = "    ") -> list[str]:
    lines = text.splitlines()
    if len(lines) == 1:
        return [f'{indent}"""{lines[0]}"""']
    return [f'{indent}"""{lines[0]}', *[f"{indent}{ln}".rstrip() for ln in lines[1:]], f'{indent}"""']


def _contract_options(fd, fds) -> dict:
    """The (maskd.v1.contract) file option, decoded through a pool built from the descriptor set."""
    from google.protobuf import descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    message_factory.GetMessageClassesForFiles([f.name for f in fds.file], pool)  # registers extensions
    options_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("google.protobuf.FileOptions"))
    options = options_cls.FromString(fd.options.SerializeToString())
    value = options.Extensions[pool.FindExtensionByName("maskd.v1.contract")]
    return {f.name: getattr(value, f.name) for f in value.DESCRIPTOR.fields}


def _enum_source(name: str, values, prefix: str, doc: str, comments: dict, path: tuple[int, ...]) -> list[str]:
    lines = [f"class {name}(enum.IntEnum):", *_doc(doc), ""]
    for j, v in enumerate(values):
        member = v.name[len(prefix):] if v.name.startswith(prefix) else v.name
        if keyword.iskeyword(member) or not member.isidentifier():
            raise ValueError(f"enum value {v.name} does not make a Python name")
        lines += _note(comments.get(path + (2, j)), "    ")
        lines.append(f"    {member} = {v.number}")
    return lines + ["", ""]


def contract_source() -> str:
    from google.rpc import code_pb2

    fd, fds = _file_descriptor()
    comments = _comments(fd)
    constants = _contract_options(fd, fds)
    lines = [
        '"""The maskd v1 contract as Python: constants, enums and ServerInfo.',
        "",
        "Generated by `make proto` (maskd_tools.protogen) from proto/maskd/v1/maskd.proto and",
        "google/rpc/code.proto; do not edit. The comments are the proto's.",
        '"""',
        "from __future__ import annotations",
        "",
        "import dataclasses",
        "import enum",
        "from typing import Any",
        "",
    ]
    contract_index = [m.name for m in fd.message_type].index("Contract")
    contract_fields = [f.name for f in fd.message_type[contract_index].field]
    for key, value in constants.items():
        note = comments.get((4, contract_index, 2, contract_fields.index(key)))
        lines += _note(note)
        name = "CONTRACT_REVISION" if key == "revision" else key.upper()
        lines.append(f"{name} = {json.dumps(value)}")
    lines += ["", ""]
    code_enum = code_pb2.DESCRIPTOR.enum_types_by_name["Code"]
    lines += _enum_source("Code", code_enum.values, "", "google.rpc.Code: the status codes of per-entry errors.",
                          {}, ())
    for i, enum_type in enumerate(fd.enum_type):
        prefix = "".join("_" + c if c.isupper() and k else c for k, c in enumerate(enum_type.name)).upper() + "_"
        doc = comments.get((5, i)) or f"maskd.v1.{enum_type.name}."
        lines += _enum_source(enum_type.name, enum_type.value, prefix, doc, comments, (5, i))
    info_index = [m.name for m in fd.message_type].index("InfoResponse")
    info = fd.message_type[info_index]
    lines += ["@dataclasses.dataclass(frozen=True)", "class ServerInfo:",
              '    """What a server says about itself (InfoResponse, field for field; repeated fields as tuples)."""',
              ""]
    conversions = []
    for j, f in enumerate(info.field):
        if f.type == _TYPE_ENUM:
            base = "int"
        elif f.type in _SCALARS:
            base = _SCALARS[f.type]
        else:
            raise ValueError(f"InfoResponse.{f.name}: no Python type for field type {f.type}")
        repeated = f.label == _LABEL_REPEATED
        lines += _note(comments.get((4, info_index, 2, j)), "    ")
        default = "()" if repeated else {"int": "0", "float": "0.0", "bool": "False", "str": '""', "bytes": 'b""'}[base]
        lines.append(f"    {f.name}: {'tuple[' + base + ', ...]' if repeated else base} = {default}")
        conversions.append(f"            {f.name}={'tuple(msg.' + f.name + ')' if repeated else 'msg.' + f.name},")
    lines += ["", "    @classmethod", "    def from_proto(cls, msg: Any) -> ServerInfo:",
              '        """From a maskd.v1.InfoResponse."""', "        return cls(", *conversions, "        )", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT,
                        help="folder to write maskd/v1 into (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
