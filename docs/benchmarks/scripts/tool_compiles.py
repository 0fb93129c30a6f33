"""Compile time of OpenAI tool sets with llguidance, in process (issue 19's groundwork).

For 10, 50 and 200 tools drawn from MaskBench-dev's BFCL and Glaive parameter schemas (those that
compile alone): one compile of the whole ``tool_choice: "required"`` schema (maskd.tool_specs),
each tool's parameters compiled alone and summed, and a router (the tool names, parameters any
object). Usage: .venv/bin/python docs/benchmarks/scripts/tool_compiles.py [../shared/maskbench-dev]
"""
import json
import pathlib
import random
import statistics
import sys
import time

import llguidance

from maskd.server.tokenizers import load_tokenizer
from maskd.tool_specs import tool_call_schema


def compile_ms(tok, schema) -> tuple[float, bool]:
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(tok.ll, grammar, log_level=0)
    return (time.perf_counter() - t0) * 1e3, matcher.is_error()


def main() -> None:
    folder = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/maskbench-dev")
    tok = load_tokenizer("deepseek-v4")
    params = []
    for path in sorted(folder.glob("*.json")):
        if path.name.startswith(("BFCL", "Glaiveai2K")):
            schema = json.loads(path.read_text())["schema"]
            if isinstance(schema, dict) and schema.get("type") == "object" and not compile_ms(tok, schema)[1]:
                params.append(schema)
    print(f"{len(params)} parameter schemas that compile alone")
    rng = random.Random(0)
    for n in (10, 50, 200):
        chosen = rng.sample(params, n)
        tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": p}} for i, p in enumerate(chosen)]
        whole = [compile_ms(tok, tool_call_schema(tools, "required"))[0] for _ in range(3)]
        alone = [compile_ms(tok, p)[0] for p in chosen]
        router = {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "parameters"], "additionalProperties": False,
            "properties": {"name": {"enum": [f"tool_{i}" for i in range(n)]}, "parameters": {"type": "object"}}}}
        routes = [compile_ms(tok, router)[0] for _ in range(3)]
        print(f"{n} tools: whole {', '.join(f'{x:.1f}' for x in whole)} ms; each alone, summed {sum(alone):.1f} ms "
              f"(median {statistics.median(alone):.2f}); router {', '.join(f'{x:.2f}' for x in routes)} ms")


if __name__ == "__main__":
    main()
