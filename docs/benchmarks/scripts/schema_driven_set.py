"""Writes a MaskBench-format folder of schema-driven JSON: the case DOMINO measures (seed 001, §3.6).

    python docs/benchmarks/scripts/schema_driven_set.py --out out/schema-driven
    maskd bench e2e --data out/schema-driven --modes unstructured,maskd,maskd-drafts

Schema-driven JSON is JSON whose structure the schema fixes: required keys in a fixed order, enum
strings, booleans, small integers, a nested object; the model chooses only the values. MaskBench
is mostly not that (free strings, open objects, arrays of any length), so this folder is the
workload the issue's "schema-driven JSON" names. Eight schemas of business records, each with
``--instances`` valid documents with random values (seeded). Nothing else is tuned: the keys and
enum values are ordinary words.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random

RECORDS = {
    "account": {"id": "int", "status": ["active", "inactive", "pending"], "verified": "bool",
                "role": ["administrator", "user", "guest"], "country": ["France", "Germany", "Japan", "Brazil"],
                "plan": ["free", "professional", "enterprise"]},
    "order": {"order_id": "int", "currency": ["EUR", "USD", "JPY"], "paid": "bool", "items": "int",
              "shipping": {"method": ["standard", "express", "pickup"], "insured": "bool"},
              "channel": ["web", "mobile", "store"]},
    "event": {"severity": ["debug", "info", "warning", "error", "critical"], "service": ["billing", "search",
              "checkout", "identity"], "code": "int", "retryable": "bool", "region": ["eu-west", "us-east",
              "ap-south"]},
    "device": {"kind": ["laptop", "phone", "tablet", "server"], "os": ["linux", "windows", "macos", "android"],
               "managed": "bool", "cores": "int", "encryption": {"enabled": "bool", "algorithm": ["aes256",
               "chacha20"]}},
    "review": {"rating": "int", "recommend": "bool", "sentiment": ["positive", "neutral", "negative"],
               "category": ["electronics", "books", "garden", "toys"], "verified_purchase": "bool"},
    "flight": {"flight_number": "int", "status": ["scheduled", "boarding", "departed", "cancelled"],
               "cabin": ["economy", "business", "first"], "delayed": "bool", "gate": "int"},
    "ticket": {"priority": ["low", "medium", "high", "urgent"], "team": ["support", "engineering", "sales"],
               "escalated": "bool", "age_days": "int", "resolution": ["fixed", "duplicate", "wontfix", "open"]},
    "sensor": {"sensor_id": "int", "unit": ["celsius", "fahrenheit", "kelvin"], "reading": "int",
               "calibrated": "bool", "location": {"building": ["north", "south", "east"], "floor": "int"}},
}


def schema_of(spec: dict) -> dict:
    props = {}
    for key, kind in spec.items():
        if kind == "int":
            props[key] = {"type": "integer", "minimum": 0, "maximum": 999}
        elif kind == "bool":
            props[key] = {"type": "boolean"}
        elif isinstance(kind, list):
            props[key] = {"enum": kind}
        else:
            props[key] = schema_of(kind)
    return {"type": "object", "properties": props, "required": list(spec), "additionalProperties": False}


def instance_of(spec: dict, rng: random.Random) -> dict:
    out = {}
    for key, kind in spec.items():
        if kind == "int":
            out[key] = rng.randint(0, 999)
        elif kind == "bool":
            out[key] = rng.random() < 0.5
        elif isinstance(kind, list):
            out[key] = rng.choice(kind)
        else:
            out[key] = instance_of(kind, rng)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--instances", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for name, spec in RECORDS.items():
        tests = [{"description": f"{name} #{i}", "valid": True, "data": instance_of(spec, rng)}
                 for i in range(args.instances)]
        doc = {"description": f"schema-driven {name}", "meta": {"features": ["enum", "required"]},
               "schema": schema_of(spec), "tests": tests}
        (out / f"schema_driven_{name}.json").write_text(json.dumps(doc, indent=1))
    print(f"{len(RECORDS)} schemas, {args.instances} instances each, in {out}")


if __name__ == "__main__":
    main()
