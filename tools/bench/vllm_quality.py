"""``maskd bench vllm --quality``: right answers, not only valid ones, on a fixed extraction set.

Every case of extraction_prompts.QUALITY_SET (a chat asking for one pydantic model's fields from one
text with a known answer) goes through one engine with vLLM's guidance backend (the first of
``--engines``, which must be ``guidance``; vllm.py starts it) in each mode, greedy (temperature 0) and
``--quality-samples`` times sampled (temperature 0.7, seeds 0..S-1, the same seed for a case in every
mode, so two modes whose masks agree write the same text):

* ``unconstrained``: no constraint; what it writes is parsed as the first JSON object in the text
  (a model may wrap it in prose or a code fence);
* vLLM's guidance backend (``structured_outputs``), whitespace set per request by the schema's own
  ``x-guidance`` options (they override the engine's ``disable_any_whitespace``):
  ``guidance-compact`` and ``guidance-flexible`` (any run of whitespace, vLLM's default);
* maskd through ``vllm_xargs``, with each whitespace setting it takes per request: ``maskd-compact``,
  ``maskd-flexible`` (maskd's default: runs of at most 8 whitespace characters) and
  ``maskd-unbounded`` (``max_whitespace`` 0: vLLM's flexible).

Per mode and decoding: valid (the text parses and validates against the strict schema), right (valid
and equal to the known answer, strings without case and surrounding space: ``demo.is_right``), mean
completion tokens, finish reasons. For guidance against maskd under the same whitespace (PAIRS, and
maskd's bounded default against guidance's flexible): how many outputs are identical, and each that
differs classified by its first difference (``classify``), with examples. Each mode's results are
written to ``--out``/vllm-quality-results.json as they come.
"""
from __future__ import annotations

import json
import pathlib
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from maskd_tools.bench import vllm_http, vllm_workloads
from maskd_tools.bench.extraction_prompts import QUALITY_SET, Case, messages, strict_schema
from maskd_tools.demo import is_right

if TYPE_CHECKING:
    from maskd_tools.vllm_serve import VllmServer

TEMPERATURE = 0.7
DEFAULT_MAX_TOKENS = 160
# guidance's whitespace (the schema's x-guidance) and maskd's (as vllm_xargs carries it), per mode
GUIDANCE_MODES = {"guidance-compact": False, "guidance-flexible": True}
MASKD_MODES = {"maskd-compact": {"disable_any_whitespace": True}, "maskd-flexible": {},
               "maskd-unbounded": {"max_whitespace": 0}}
MODES = ("unconstrained", *GUIDANCE_MODES, *MASKD_MODES)
PAIRS = (("guidance-compact", "maskd-compact"), ("guidance-flexible", "maskd-unbounded"),
         ("guidance-flexible", "maskd-flexible"))
DIFFERENCES = ("token boundary", "whitespace", "key order", "same value, other spelling", "different value")
EXAMPLES = 3   # per kind of difference


def body(case: Case, mode: str, seed: int | None, max_tokens: int) -> dict[str, Any]:
    """A chat request of ``case`` in ``mode`` (one of MODES), greedy where ``seed`` is None; it asks
    for the tokens' texts (logprobs)."""
    schema = strict_schema(case.prompt.model)
    out: dict[str, Any] = {"messages": messages(case.prompt, case.text), "max_tokens": max_tokens,
                           "logprobs": True, "top_logprobs": 0,
                           **({"temperature": 0, "seed": 0} if seed is None else
                              {"temperature": TEMPERATURE, "seed": seed})}
    if mode in MASKD_MODES:
        out["vllm_xargs"] = {"maskd": json.dumps({"json": schema, **MASKD_MODES[mode]})}
    elif mode in GUIDANCE_MODES:
        out["structured_outputs"] = {"json": {**schema, "x-guidance": {"whitespace_flexible": GUIDANCE_MODES[mode]}}}
    elif mode != "unconstrained":
        raise ValueError(f"unknown quality mode {mode!r}; choose from {', '.join(MODES)}")
    return out


def first_json(text: str) -> Any:
    """The first JSON object in ``text`` (after prose or inside a code fence), or None."""
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch == "{":
            try:
                return decoder.raw_decode(text, i)[0]
            except ValueError:
                continue
    return None


def score(case: Case, mode: str, text: str) -> dict[str, bool]:
    """valid: the output (the whole text; unconstrained: its first JSON object) validates against the
    case's strict schema; right: valid and the known answer."""
    if mode == "unconstrained":
        value = first_json(text)
    else:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
    valid = value is not None and vllm_workloads.validator(strict_schema(case.prompt.model)).is_valid(value)
    return {"valid": valid, "right": valid and is_right(value, case.answer)}


def squeeze(text: str) -> str:
    """``text`` without the whitespace outside JSON strings."""
    out, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in " \t\r\n":
            continue
        out.append(ch)
    return "".join(out)


def _keys(value: Any) -> Any:
    if isinstance(value, dict):
        return [(k, _keys(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_keys(v) for v in value]
    return None


def classify(a: str, b: str, a_pieces: Sequence[str] = (), b_pieces: Sequence[str] = ()) -> str:
    """Why two outputs of one request differ, by their first difference: "identical"; "token boundary"
    (the same characters in other tokens: one grammar allowed a token the other did not, and the texts
    may part after it); "whitespace" (equal but for whitespace outside strings, or parting where one
    writes whitespace); "key order"; "same value, other spelling" (escapes, number forms); "different
    value" (the model chose another token at a token boundary both share)."""
    if a == b:
        return "identical" if list(a_pieces) == list(b_pieces) else "token boundary"
    if squeeze(a) == squeeze(b):
        return "whitespace"
    try:
        va, vb = json.loads(a), json.loads(b)
        if va == vb:
            return "key order" if _keys(va) != _keys(vb) else "same value, other spelling"
    except ValueError:
        pass
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if a_pieces and b_pieces:
        j = next((i for i, (x, y) in enumerate(zip(a_pieces, b_pieces)) if x != y), min(len(a_pieces), len(b_pieces)))
        if len("".join(a_pieces[:j])) < k:
            return "token boundary"
    if a[k:k + 1].isspace() or b[k:k + 1].isspace():
        return "whitespace"
    return "different value"


def measure(engine: VllmServer, args, concurrency: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every case in every mode, greedy and ``args.quality_samples`` times sampled, ``concurrency`` at
    a time: one result per request."""
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS
    seeds: list[int | None] = [None, *range(args.quality_samples)]
    results = []
    asked = [(case, seed) for seed in seeds for case in QUALITY_SET]
    partial = pathlib.Path(args.out) / "vllm-quality-results.json"
    for mode in MODES:
        done, wall = vllm_http.send(engine.url, lambda i, mode=mode: body(asked[i][0], mode, asked[i][1], max_tokens),
                                    concurrency, len(asked))
        for i, (case, seed) in enumerate(asked):
            r = done[i]
            results.append({"mode": mode, "case": case.name, "seed": seed, "text": r["text"], "pieces": r["pieces"],
                            "tokens": r["tokens"], "finish": r["finish"], "error": r["error"],
                            **score(case, mode, r["text"])})
        partial.write_text(json.dumps(results))
        mine = results[-len(asked):]
        log(f"maskd bench vllm: quality {mode}: valid {sum(r['valid'] for r in mine)}/{len(mine)}, right "
            f"{sum(r['right'] for r in mine)}, {wall:.0f} s")
    return results


def summarize(results: Sequence[dict[str, Any]], pairs: Sequence[tuple[str, str]] = PAIRS) -> dict[str, Any]:
    """Per mode and decoding (greedy, sampled): requests, valid, right, mean tokens, finish reasons,
    errors; per pair of modes (same cases, same seeds): identical outputs and the differences by kind."""
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        for decoding in ("greedy", "sampled"):
            rs = [r for r in results if r["mode"] == mode and (r["seed"] is None) == (decoding == "greedy")]
            if rs:
                rows.append({"mode": mode, "decoding": decoding, "requests": len(rs),
                             "valid": sum(r["valid"] for r in rs), "right": sum(r["right"] for r in rs),
                             "mean_tokens": statistics.mean(r["tokens"] for r in rs),
                             "finish": vllm_http.count(r["finish"] for r in rs),
                             "errors": sum(r["error"] is not None for r in rs)})
    compared = []
    for left, right in pairs:
        mine = {(r["case"], r["seed"]): r for r in results if r["mode"] == right}
        for decoding in ("greedy", "sampled"):
            kinds: dict[str, int] = {}
            examples: dict[str, list] = {}
            n = 0
            for a in results:
                b = mine.get((a["case"], a["seed"]))
                if a["mode"] != left or b is None or (a["seed"] is None) != (decoding == "greedy"):
                    continue
                n += 1
                kind = classify(a["text"], b["text"], a["pieces"], b["pieces"])
                kinds[kind] = kinds.get(kind, 0) + 1
                if kind != "identical" and len(examples.setdefault(kind, [])) < EXAMPLES:
                    examples[kind].append({"case": a["case"], "seed": a["seed"], left: a["text"], right: b["text"]})
            if n:
                compared.append({"modes": [left, right], "decoding": decoding, "compared": n,
                                 "identical": kinds.pop("identical", 0), "differences": kinds, "examples": examples})
    return {"rows": rows, "compared": compared}


def markdown(quality: dict[str, Any]) -> list[str]:
    """The report's section: the table per mode, then each comparison with an example per kind."""
    lines = [f"## Quality: {quality['cases']} extraction cases with known answers", "",
             f"Greedy, and {quality['samples']} samples per case at temperature {TEMPERATURE} (seeds 0..), at "
             f"most {quality['max_tokens']} tokens. Valid: parses (unconstrained: the first JSON object in the "
             "text) and validates; right: valid and the known answer.", "",
             "| mode | decoding | valid | right | mean tokens | finish | errors |", "|---|---|---|---|---|---|---|"]
    for r in quality["summary"]["rows"]:
        lines.append(f"| {r['mode']} | {r['decoding']} | {r['valid']}/{r['requests']} | {r['right']}/{r['requests']} "
                     f"| {r['mean_tokens']:.1f} | {', '.join(f'{k} {v}' for k, v in r['finish'].items())} "
                     f"| {r['errors']} |")
    lines.append("")
    for c in quality["summary"]["compared"]:
        left, right = c["modes"]
        kinds = ", ".join(f"{k} {v}" for k, v in c["differences"].items()) or "none"
        lines.append(f"{left} against {right}, {c['decoding']}: {c['identical']}/{c['compared']} identical; "
                     f"the others by their first difference: {kinds}.")
        lines += [f"- {kind} ({x['case']}): `{x[left][:120]!r}` against `{x[right][:120]!r}`"
                  for kind, (x, *_) in c["examples"].items()]
        lines.append("")
    return lines


def report(results: list[dict[str, Any]], args) -> dict[str, Any]:
    return {"cases": len(QUALITY_SET), "samples": args.quality_samples, "temperature": TEMPERATURE,
            "max_tokens": args.max_tokens or DEFAULT_MAX_TOKENS, "summary": summarize(results), "results": results}
