"""A template with named holes registered through `maskd serve` (issue 19; WGrammar's structure
factory): each round the same template, three holes filled with MaskBench-dev object schemas, one
of which is new (never seen by the server). Sent three ways, alternating within each round:

* template: `{"template": {"schema": ..., "arguments": ...}}`, composed from the template's router
  (compiled once) and the pieces the server holds, the new argument compiled;
* whole: the filled-in schema as a `json_schema` (what a user sends without templates), compiled whole;
* known: the template again with all three arguments known, in a combination not sent before.

Register with wait (ready to serve), medians ms over the rounds after the first.

    .venv/bin/python docs/benchmarks/scripts/template_register.py --data ../shared/maskbench-dev [--rounds 12]
        [--whitespace compact]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

ENVELOPE = {
    "type": "object",
    "properties": {
        "thought": {"type": "string"},
        "action": {"$hole": "action"},
        "context": {"$hole": "context"},
        "steps": {"type": "array", "items": {"$hole": "step"}},
    },
    "required": ["thought", "action", "context", "steps"],
}


def object_schemas(folder: pathlib.Path, tok) -> list[dict]:
    """MaskBench-dev's schemas a hole takes (``"type": "object"``, no $ref or $defs) that llguidance
    compiles, the largest first."""
    import llguidance

    pool = []
    for path in sorted(folder.glob("*.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
        text = json.dumps(schema)
        if not isinstance(schema, dict) or schema.get("type") != "object" or "$ref" in text or "$defs" in text:
            continue
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        if not llguidance.LLMatcher(tok.ll, grammar, log_level=0).is_error():
            pool.append(schema)
    return sorted(pool, key=lambda s: -len(json.dumps(s)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--cpu", type=int, default=1, help="the CPU `maskd serve` (and its compile workers) runs on")
    ap.add_argument("--skip", type=int, default=40, help="new arguments: the pool's schemas from this rank on")
    ap.add_argument("--whitespace", choices=("flexible", "compact"), default="flexible",
                    help="the JSON layout of all three (compact JSON forces bytes across the template and its arguments)")
    args = ap.parse_args()

    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tools.bench import common
    from maskd_client import MaskClient

    pool = object_schemas(pathlib.Path(args.data), load_tokenizer("deepseek-v4"))
    fixed = {"context": pool[0], "step": pool[1]}       # the two largest
    fresh = iter(pool[2 + args.skip:])

    def template(arguments) -> GrammarSpec:
        return GrammarSpec.from_dict({"template": {"schema": ENVELOPE, "arguments": arguments},
                                      "whitespace": args.whitespace})

    srv = common.subprocess_server("deepseek-v4", 1, cpus=[args.cpu], json_schema_mode="complete")
    took: dict[str, list[float]] = {"template": [], "whole": [], "known": []}
    try:
        with MaskClient(srv.address, want_forced_tokens=False, timeout_s=600) as mc:
            held = next(fresh)        # an action the server holds a piece of (the last round's template)
            mc.register(template({**fixed, "action": held}).to_proto(), wait=True)
            for r in range(args.rounds):
                action_t, action_w = next(fresh), next(fresh)
                specs = {
                    "template": template({**fixed, "action": action_t}),
                    "whole": GrammarSpec.from_dict({"json_schema": json.loads(template({**fixed, "action": action_w}).text),
                                                    "whitespace": args.whitespace}),
                    "known": template({"context": fixed["step"], "step": fixed["context"], "action": held}),
                }
                order = list(specs) if r % 2 else list(reversed(specs))
                for name in order:
                    t0 = time.perf_counter()
                    mc.register(specs[name].to_proto(), wait=True)
                    if r:
                        took[name].append((time.perf_counter() - t0) * 1e3)
                held = action_t
                time.sleep(0.2)
    finally:
        srv.close()
    sizes = [len(json.dumps(s)) for s in (fixed["context"], fixed["step"])]
    print(f"template: 3 holes, the fixed arguments {sizes[0]} and {sizes[1]} bytes of JSON, {args.whitespace} JSON; "
          f"maskd serve on CPU {args.cpu}")
    for name, values in took.items():
        print(f"{name:>8}: register median {statistics.median(values):7.2f} ms  (min {min(values):.2f}, "
              f"max {max(values):.2f}, n={len(values)})")


if __name__ == "__main__":
    main()
