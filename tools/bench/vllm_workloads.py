"""What ``maskd bench vllm`` asks the engine for: the schemas of each workload and of a compile burst
(and, with ``--drafts``, the prompts of ``account``: ``account_prompt``).

* ``free-text``: one free string field (nearly every token free);
* ``records``: four records of four typed fields (most tokens forced);
* ``maskbench``: MaskBench schemas (``--data``, ``--limit`` of them evenly spaced), request i
  asking for schema i mod n. Only schemas that llguidance (compact JSON) and xgrammar both compile
  in process are taken, so every backend of the comparison serves the same requests; schemas an
  engine's own backend still refuses (HTTP 400 in the warm-up) leave that engine's workload, and
  the report says how many.
* ``tools``: an agent's tool calls: the call array vLLM builds for ``tool_choice: "required"``
  over ``--tool-set`` tools of MaskBench-dev's BFCL / Glaive parameter schemas. The warm-up sends
  the base set; every measured request sends the base set with one tool replaced by a tool never
  seen (its name and description carry the request's tag), in another order: the case issue 19's
  per-tool pieces are for. Each such request is a new grammar to every backend: vLLM's compiles
  the array whole, maskd composes it from the pieces it has and the new tool's.

A compile burst sends grammars no backend has seen: MaskBench schemas outside the workload's
sample (or variants of ``records`` without a MaskBench folder), each with a ``title`` unique to
its round and mode, so every backend compiles each one (vLLM's caches and maskd's content address
both key on the schema's text).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence

FREE_TEXT = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
             "additionalProperties": False}
RECORD = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"},
                                           "kind": {"enum": ["alpha", "beta", "gamma"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["id", "ok", "kind", "score"], "additionalProperties": False}
RECORDS = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 4,
                                                        "maxItems": 4}},
           "required": ["records"], "additionalProperties": False}
# Schema-driven JSON of one account (six required keys: enums, a boolean, an integer): grammar drafts'
# workload (tests/vllm_engine/test_real_model.py, docs/decisions/0011-grammar-drafts.md).
ACCOUNT = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "status": {"enum": ["active", "inactive", "pending"]},
    "verified": {"type": "boolean"},
    "role": {"enum": ["administrator", "user", "guest"]},
    "country": {"enum": ["France", "Germany", "Japan"]},
    "plan": {"enum": ["free", "professional", "enterprise"]}},
    "required": ["id", "status", "verified", "role", "country", "plan"], "additionalProperties": False}
BUILT_IN = {"free-text": FREE_TEXT, "records": RECORDS}
WORKLOADS = (*BUILT_IN, "maskbench", "tools")
# ``--drafts``' workloads (vllm_drafts.py): ``account`` (completions: account_prompt, ACCOUNT) and
# ``extraction`` (chat: extraction_prompts.py's prompts, each under its pydantic model's strict schema).
DRAFT_WORKLOADS = ("account", "extraction")


def account_prompt(i: int) -> str:
    """Request i of the ``account`` workload: an example account (compact JSON), then account #i."""
    example = json.dumps({"id": 7, "status": "active", "verified": True, "role": "user", "country": "Japan",
                          "plan": "free"}, separators=(",", ":"))
    return f"Accounts like {example}. Account #{i}:"


def compiles_in_process(schema: dict) -> bool:
    """Whether llguidance (compact JSON) and xgrammar both build a grammar for ``schema``."""
    import llguidance
    import xgrammar

    text = json.dumps(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        if llguidance.LLMatcher.validate_grammar(grammar):
            return False
        xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
    except Exception:   # either engine's refusal, whatever its type
        return False
    return True


def maskbench_schemas(data_dir: str | os.PathLike, limit: int) -> tuple[list[tuple[str, dict]], list[dict]]:
    """(the workload's ``limit`` schemas, evenly spaced over the files both engines compile; every
    other such schema, for bursts)."""
    from maskd_tools.bench.common import spread
    from maskd_tools.conformance import load_suite

    with _quiet_stderr():   # xgrammar's C++ warnings, one per schema feature it approximates
        usable = [(name, schema) for name, schema, _ in load_suite(data_dir)
                  if isinstance(schema, dict) and compiles_in_process(schema)]
    if not usable:
        raise ValueError(f"no schema in {data_dir} compiles with both llguidance and xgrammar")
    chosen = spread(usable, limit)
    names = {n for n, _ in chosen}
    return chosen, [s for n, s in usable if n not in names]


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def tool_pool(data_dir: str | os.PathLike, tokenizer: str = "deepseek-v4") -> list[tuple[str, dict]]:
    """(file stem, parameters schema) of the MaskBench-dev tools ``maskd bench tools`` draws from."""
    import pathlib

    from maskd.server.tokenizers import load_tokenizer
    from maskd_tools.bench.tools import tool_pool as pool_of

    folder = pathlib.Path(data_dir)
    if not folder.is_dir():
        raise ValueError(f"no MaskBench-dev folder at {folder}")
    pool = pool_of(folder, load_tokenizer(tokenizer))
    if len(pool) < 2:
        raise ValueError(f"{folder} has fewer than 2 BFCL / Glaive tools that compile alone")
    return pool


def tool_sets(pool: Sequence[tuple[str, dict]], size: int, n: int, tag: str) -> list[dict]:
    """``n`` call arrays (``tool_choice: "required"``, as vLLM builds them): the base set of the pool's
    first ``size`` tools with tool i replaced by a tool new to ``tag``, in an order of its own."""
    import random

    from maskd.tool_specs import tool_call_schema
    from maskd_tools.bench.tools import _tool

    size = min(size, len(pool) - 1)
    base = [_tool(stem, schema, "base") for stem, schema in pool[:size]]
    rng = random.Random(tag)
    out = []
    for i in range(n):
        stem, schema = pool[size + i % (len(pool) - size)]
        tools = base[:i % size] + base[i % size + 1:] + [_tool(stem, schema, f"{tag}-{i}")]
        rng.shuffle(tools)
        out.append(tool_call_schema(tools, "required"))
    return out


def base_tool_set(pool: Sequence[tuple[str, dict]], size: int) -> dict:
    from maskd.tool_specs import tool_call_schema
    from maskd_tools.bench.tools import _tool

    return tool_call_schema([_tool(stem, schema, "base") for stem, schema in pool[:min(size, len(pool) - 1)]],
                            "required")


def burst_schemas(pool: Sequence[dict], n: int, tag: str) -> list[dict]:
    """``n`` schemas with a title unique to ``tag``: from ``pool`` in turn, or ``records`` variants."""
    source = list(pool) or [RECORDS]
    return [{**source[i % len(source)], "title": f"maskd-bench-burst-{tag}-{i}"} for i in range(n)]


def validator(schema: dict):
    """A jsonschema validator of the schema's own draft (formats not asserted: both backends of a
    comparison are judged alike)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)
