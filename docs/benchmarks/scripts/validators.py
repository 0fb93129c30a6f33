"""JSON Schema validators on MaskBench: which one complete mode's exact check uses.

    .venv/bin/python docs/benchmarks/scripts/validators.py ../shared/maskbench-dev [--json OUT]

For every MaskBench file each library builds a validator for the schema (format assertion on, no
network), then checks every test instance; its verdict is compared with MaskBench's label. A
false accept (an invalid instance passing) is what complete mode must never have. Times are of
this process on one thread: build (schema -> validator) and check (one instance).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np


def jsonschema_rs_lib(schema):
    import jsonschema_rs
    v = jsonschema_rs.validator_for(schema, validate_formats=True, offline=True)
    return v.is_valid


def fastjsonschema_lib(schema):
    import fastjsonschema
    fn = fastjsonschema.compile(schema)   # asserts formats by default

    def ok(value):
        try:
            fn(value)
            return True
        except fastjsonschema.JsonSchemaValueException:
            return False
    return ok


def jsonschema_lib(schema):
    import jsonschema
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid


LIBRARIES = {"jsonschema-rs": jsonschema_rs_lib, "fastjsonschema": fastjsonschema_lib, "jsonschema": jsonschema_lib}


def pct(values, p):
    return round(float(np.percentile(np.asarray(values) * 1e3, p)), 4) if values else None


def measure(files, build):
    built, builds, checks = 0, [], []
    refused: dict[str, str] = {}
    false_accepts = false_rejects = errors = 0
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        t0 = time.perf_counter()
        try:
            ok = build(doc["schema"])
        except Exception as exc:
            refused[path.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        builds.append(time.perf_counter() - t0)
        built += 1
        for test in doc.get("tests", []):
            t0 = time.perf_counter()
            try:
                verdict = ok(test["data"])
            except Exception:
                verdict = None
                errors += 1
            checks.append(time.perf_counter() - t0)
            if verdict is None or verdict == test["valid"]:
                continue
            if verdict:
                false_accepts += 1
            else:
                false_rejects += 1
    return {"schemas": len(files), "built": built, "refused": len(refused), "refused_files": refused,
            "instances": len(checks), "false_accepts": false_accepts, "false_rejects": false_rejects,
            "errors": errors,
            "build_ms": {"p50": pct(builds, 50), "p99": pct(builds, 99), "mean": round(float(np.mean(builds)) * 1e3, 4)},
            "check_ms": {"p50": pct(checks, 50), "p99": pct(checks, 99), "mean": round(float(np.mean(checks)) * 1e3, 4)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="folder of MaskBench files")
    ap.add_argument("--json", dest="json_out", help="write the figures here")
    args = ap.parse_args()
    files = sorted(pathlib.Path(args.data).glob("*.json"))
    report = {}
    print("| library | built | refused | instances | false accepts | false rejects | errors | build p50 / p99 ms "
          "| check p50 / p99 ms |\n|---|---|---|---|---|---|---|---|---|")
    for name, build in LIBRARIES.items():
        r = report[name] = measure(files, build)
        print(f"| {name} | {r['built']} | {r['refused']} | {r['instances']} | {r['false_accepts']} | "
              f"{r['false_rejects']} | {r['errors']} | {r['build_ms']['p50']} / {r['build_ms']['p99']} | "
              f"{r['check_ms']['p50']} / {r['check_ms']['p99']} |", flush=True)
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
