"""MaskBench conformance through the wire (and the same check in-process, as baseline).

For every MaskBench file (``schema`` + ``tests`` with ``valid`` and ``data``) the schema is
registered through the server; every test instance is tokenized from
``json.dumps(data, ensure_ascii=False)`` and driven through session steps. A valid
instance passes when every token is allowed by the row the server returned and the
end state allows EOS; an invalid one passes when some token is disallowed or the end
does not allow EOS. Instances run as a continuously refilled batch of sequences.

The report names the server's JSON schema mode (``--json-schema-mode``): in ``complete`` mode a
schema the grammar cannot enforce whole is compiled relaxed and each finished document is checked
by a JSON Schema validator, so an invalid instance may also be rejected by the sequence failing
with the validator's message (counted as ``validator_rejects``). ``server_us_per_mask`` is the
server's own time per mask row (``server_seconds`` of every step over its rows).

``passing`` is MaskBench's verdict per schema: it compiles, every valid instance is accepted and
every invalid one rejected. ``by_keyword`` breaks schemas, passing and false verdicts down by the
JSON Schema keywords each schema holds.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import pathlib
import re
import sys
import time
from collections.abc import Iterator

import numpy as np

from maskd.specs import JSON_SCHEMA_MODES
from maskd_tools.progress import bar

SAMPLE_DIR = pathlib.Path(__file__).parent / "samples" / "maskbench"


@dataclasses.dataclass
class ConformanceCase:
    """One test of a MaskBench file (valid or invalid) as tokens: its verdict is accept or reject."""
    file: str
    index: int
    valid: bool
    tokens: list[int]


def load_suite(data_dir: str | pathlib.Path, limit: int | None = None) -> list[tuple[str, dict, list]]:
    """(file name, schema, tests) per MaskBench file, sorted by name."""
    folder = pathlib.Path(data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"no MaskBench folder at {folder}")
    files = sorted(folder.glob("*.json"))
    if not files:
        raise ValueError(f"no MaskBench files (*.json) in {folder}")
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be at least 1, not {limit}")
        files = files[:limit]
    suite = []
    for path in files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            suite.append((path.name, doc["schema"], list(doc.get("tests", []))))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a MaskBench file (schema + tests): {exc}") from exc
    if not any(tests for _, _, tests in suite):
        raise ValueError(f"the {len(suite)} MaskBench files in {folder} hold no test instances")
    return suite


def _instances(suite, compiled: set[str], encode) -> Iterator[ConformanceCase]:
    for name, _schema, tests in suite:
        if name not in compiled:
            continue
        for i, test in enumerate(tests):
            yield ConformanceCase(name, i, bool(test["valid"]),
                                  encode(json.dumps(test["data"], ensure_ascii=False)))


def _allowed(bitmask: np.ndarray, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    words = bitmask[rows, tokens >> 5]
    return ((words >> (tokens & 31)) & 1).astype(bool)


class _VerdictTally:
    """The verdicts of a conformance run: valid instances accepted, invalid ones rejected, the misses."""

    def __init__(self) -> None:
        self.valid_total = self.valid_accepted = self.invalid_total = self.invalid_rejected = 0
        self.masks = 0
        self.server_seconds = 0.0
        self.validator_rejects = 0
        self.false_accepts: list[dict] = []
        self.false_rejects: list[dict] = []

    @property
    def done(self) -> int:
        return self.valid_total + self.invalid_total

    def verdict(self, inst: ConformanceCase, accepted: bool, why: str = "") -> None:
        if not accepted and "JSON schema" in why:
            self.validator_rejects += 1
        if inst.valid:
            self.valid_total += 1
            if accepted:
                self.valid_accepted += 1
            else:
                self.false_rejects.append({"file": inst.file, "test": inst.index, "why": why})
        else:
            self.invalid_total += 1
            if not accepted:
                self.invalid_rejected += 1
            else:
                self.false_accepts.append({"file": inst.file, "test": inst.index})


def run_through_server(target: str, tokenizer_spec: str, suite, *, batch: int = 64,
                       register_threads: int = 8) -> dict:
    from maskd.server.tokenizers import load_tokenizer
    from maskd_client import MaskClient, MaskClientError, SeqStatus

    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer_spec)
    tally = _VerdictTally()
    compile_errors: dict[str, str] = {}
    with MaskClient(target, tokenizer=tok.fingerprint, want_forced_tokens=False, timeout_s=600) as mc:
        info = mc.info()
        mode = info.json_schema_mode or "strict"
        eos = np.array(info.eos_token_ids[:1], dtype=np.int64)

        def register(item):
            name, schema, _ = item
            try:
                mc.register({"json_schema": schema}, wait=True)
                return name, None
            except MaskClientError as exc:
                return name, str(exc)

        with concurrent.futures.ThreadPoolExecutor(register_threads) as pool, \
                bar(total=len(suite), desc="compile", unit="schema") as compiling:
            for name, err in pool.map(register, suite):
                compiling.update(1)
                if err is not None:
                    compile_errors[name] = err
        compiled = {name for name, _, _ in suite if name not in compile_errors}
        checking = bar(total=sum(len(tests) for name, _, tests in suite if name in compiled), desc="check",
                       unit="instance")
        schemas = {name: schema for name, schema, _ in suite}
        source = _instances(suite, compiled, tok.encode)
        active: dict[str, tuple[ConformanceCase, int]] = {}   # seq -> (instance, tokens sent)
        counter = 0
        exhausted = False
        while active or not exhausted:
            checking.update(tally.done - checking.n)
            while not exhausted and len(active) < batch:
                inst = next(source, None)
                if inst is None:
                    exhausted = True
                    break
                seq_id = f"{inst.file}#{inst.index}#{counter}"
                counter += 1
                mc.open(seq_id, {"json_schema": schemas[inst.file]})
                active[seq_id] = (inst, -1)
            if not active:
                break
            request = {}
            for seq_id, (inst, sent) in active.items():
                request[seq_id] = [] if sent < 0 else [inst.tokens[sent]]
            result = mc.step(request)
            tally.server_seconds += result.server_seconds
            check_ids, check_rows, check_tokens = [], [], []
            for seq_id, (inst, sent) in list(active.items()):
                r = result.seqs[seq_id]
                pos = sent + 1 if sent >= 0 else 0   # tokens applied so far
                if r.status is SeqStatus.WAITING:
                    continue  # grammar not ready: ask again with no tokens
                active[seq_id] = (inst, pos)
                if r.status in (SeqStatus.FAILED, SeqStatus.ERROR):
                    tally.verdict(inst, False, r.reason)
                    del active[seq_id]
                    mc.close(seq_id)
                    continue
                check_ids.append(seq_id)
                check_rows.append(r.row)
                check_tokens.append(inst.tokens[pos] if pos < len(inst.tokens) else int(eos[0]))
            if not check_ids:
                continue
            ok = _allowed(result.bitmask, np.array(check_rows), np.array(check_tokens, dtype=np.int64))
            tally.masks += len(check_ids)
            for seq_id, good in zip(check_ids, ok):
                inst, pos = active[seq_id]
                at_end = pos >= len(inst.tokens)
                if not good or at_end:
                    why = "" if good else ("EOS not allowed at the end" if at_end
                                           else f"token {pos} ({inst.tokens[pos]}) not allowed")
                    tally.verdict(inst, bool(good), why)
                    del active[seq_id]
                    mc.close(seq_id)
        checking.close()
    return _report(suite, compile_errors, tally, time.perf_counter() - t0, target, mode)


def run_in_process(tokenizer_spec: str, suite) -> dict:
    """The same check straight on llguidance (no server): the baseline."""
    import llguidance

    from maskd.server.tokenizers import load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer_spec)
    tally = _VerdictTally()
    compile_errors: dict[str, str] = {}
    for name, schema, tests in bar(suite, desc="schemas", unit="schema"):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok.ll)
        matcher = None if is_error else llguidance.LLMatcher(tok.ll, grammar, log_level=0)
        if matcher is None or matcher.is_error():
            compile_errors[name] = (msgs[0] if msgs else matcher.get_error()) if is_error or matcher else "error"
            continue
        for i, test in enumerate(tests):
            inst = ConformanceCase(name, i, bool(test["valid"]),
                                   tok.encode(json.dumps(test["data"], ensure_ascii=False)))
            m = llguidance.LLMatcher(tok.ll, grammar, log_level=0)
            n = m.validate_tokens(inst.tokens)
            tally.masks += min(n + 1, len(inst.tokens) + 1)
            accepted = n == len(inst.tokens) and m.consume_tokens(inst.tokens) and m.is_accepting()
            tally.verdict(inst, bool(accepted), "" if accepted else
                          (f"stops at token {n}" if n < len(inst.tokens) else "EOS not allowed at the end"))
    return _report(suite, compile_errors, tally, time.perf_counter() - t0, "in-process llguidance", "strict")


# Keywords the report breaks results down by (a schema counts under each keyword it holds anywhere).
KEYWORDS = ("$ref", "allOf", "anyOf", "oneOf", "not", "if", "dependencies", "dependentRequired",
            "dependentSchemas", "patternProperties", "additionalProperties", "propertyNames", "minProperties",
            "maxProperties", "required", "uniqueItems", "contains", "prefixItems", "pattern", "format",
            "enum", "const", "multipleOf", "unevaluatedProperties")


def schema_keywords(schema, depth: int = 0) -> set[str]:
    """The keywords of ``KEYWORDS`` a schema holds anywhere (property names are not keywords)."""
    found: set[str] = set()
    if depth > 200:
        return found
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in KEYWORDS:
                found.add(key)
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") \
                    and isinstance(value, dict):
                for sub in value.values():
                    found |= schema_keywords(sub, depth + 1)
            elif key not in ("enum", "const", "default", "examples"):
                found |= schema_keywords(value, depth + 1)
    elif isinstance(schema, list):
        for item in schema:
            found |= schema_keywords(item, depth + 1)
    return found


def passing_by_keyword(suite, compile_errors: dict, failing: set[str], tally: _VerdictTally) -> list[dict]:
    """Per keyword: schemas holding it, how many pass, and the false rejects / accepts among them."""
    rows: dict[str, dict] = {}
    rejects = collections.Counter(x["file"] for x in tally.false_rejects)
    accepts = collections.Counter(x["file"] for x in tally.false_accepts)
    for name, schema, _ in suite:
        for kw in schema_keywords(schema):
            row = rows.setdefault(kw, {"keyword": kw, "schemas": 0, "passing": 0, "compile_errors": 0,
                                       "false_rejects": 0, "false_accepts": 0})
            row["schemas"] += 1
            row["passing"] += name not in failing
            row["compile_errors"] += name in compile_errors
            row["false_rejects"] += rejects[name]
            row["false_accepts"] += accepts[name]
    return sorted(rows.values(), key=lambda r: (r["passing"] - r["schemas"], -r["schemas"], r["keyword"]))


def _report(suite, compile_errors: dict, tally: _VerdictTally, seconds: float, target: str, mode: str) -> dict:
    # MaskBench's verdict per schema: it passes when it compiles, every valid instance is accepted
    # and every invalid one rejected.
    failing = set(compile_errors) | {x["file"] for x in tally.false_rejects} | {x["file"] for x in tally.false_accepts}
    return {
        "target": target,
        "json_schema_mode": mode,
        "schemas": len(suite),
        "passing": len(suite) - len(failing),
        "passing_percent": round(100.0 * (len(suite) - len(failing)) / len(suite), 2) if suite else None,
        "failing_files": sorted(failing),
        "by_keyword": passing_by_keyword(suite, compile_errors, failing, tally),
        "compiled": len(suite) - len(compile_errors),
        "compile_errors": len(compile_errors),
        "valid_total": tally.valid_total,
        "valid_accepted": tally.valid_accepted,
        "invalid_total": tally.invalid_total,
        "invalid_rejected": tally.invalid_rejected,
        "false_accepts": tally.false_accepts,
        "false_rejects": tally.false_rejects,
        "masks": tally.masks,
        "validator_rejects": tally.validator_rejects,
        "server_us_per_mask": round(tally.server_seconds / tally.masks * 1e6, 2) if tally.server_seconds and tally.masks
        else None,
        "seconds": round(seconds, 3),
        "compile_error_files": sorted(compile_errors),
        "compile_error_messages": dict(collections.OrderedDict(sorted(compile_errors.items()))),
        "compile_errors_by_reason": errors_by_reason(compile_errors),
    }


def summary_line(report: dict) -> str:
    return (f"{report['target']} ({report['json_schema_mode']} JSON schemas): schemas {report['schemas']}, "
            f"passing {report['passing']} ({report['passing_percent']} %), compiled {report['compiled']}, "
            f"compile errors {report['compile_errors']}, valid accepted {report['valid_accepted']}/"
            f"{report['valid_total']}, invalid rejected {report['invalid_rejected']}/{report['invalid_total']}, "
            f"false accepts {len(report['false_accepts'])}, false rejects {len(report['false_rejects'])}, "
            f"masks {report['masks']}, validator rejects {report['validator_rejects']}, "
            f"server {report['server_us_per_mask']} us/mask, {report['seconds']} s")


# -- the command line ----------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("conformance", help="MaskBench conformance through a maskd server",
                       description="Every valid MaskBench instance must be accepted token by token and every "
                                   "invalid one rejected, through a real server (or in process, as baseline).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HOST:PORT of a maskd server (or of a cluster directory)")
    where.add_argument("--embedded", action="store_true", help="start a server on a free loopback port")
    where.add_argument("--in-process", action="store_true", help="llguidance in this process, no server")
    p.add_argument("--data", default=str(SAMPLE_DIR), help="folder of MaskBench files (default: built-in sample)")
    p.add_argument("--tokenizer", default="deepseek-v4", help="tokenizer spec (as for maskd serve)")
    p.add_argument("--limit", type=int, default=None, help="first N files only")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--threads", type=int, default=None, help="embedded server's fill threads (default: CPUs)")
    p.add_argument("--json-schema-mode", choices=JSON_SCHEMA_MODES, default=None,
                   help="embedded server's JSON schema mode (default: the server's, complete); a --target "
                        "server reports its own")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="how long --target may take to answer its health check before the run gives up")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    p.set_defaults(func=cmd_conformance)


def cmd_conformance(args) -> int:
    prog = "maskd conformance"
    if args.batch < 1:
        sys.exit(f"{prog}: --batch must be at least 1, not {args.batch}")
    try:
        suite = load_suite(args.data, args.limit)
    except (FileNotFoundError, ValueError) as exc:
        sys.exit(f"{prog}: {exc}")
    from maskd.server.tokenizers import TokenizerError, load_tokenizer
    try:
        load_tokenizer(args.tokenizer)   # cached: the run below takes the same one
    except TokenizerError as exc:
        sys.exit(f"{prog}: {exc}")
    server = None
    if args.in_process:
        report = run_in_process(args.tokenizer, suite)
    else:
        from maskd_client import MaskClientError
        target = args.target
        if args.embedded:
            from maskd.server.app import start_or_exit
            from maskd.server.config import ServerConfig
            config = ServerConfig(port=0, tokenizer=args.tokenizer, threads=args.threads)
            if args.json_schema_mode:
                config.json_schema_mode = args.json_schema_mode
            server = start_or_exit(config, prog)
            target = server.address
        else:
            target = _reachable_target(prog, target, args.connect_timeout)
        try:
            report = run_through_server(target, args.tokenizer, suite, batch=args.batch)
        except MaskClientError as exc:
            sys.exit(f"{prog}: {exc}")
        finally:
            if server is not None:
                server.stop(grace=1.0)
    print(summary_line(report))
    for item in report["false_accepts"][:20]:
        print(f"  false accept: {item['file']} test {item['test']}")
    for item in report["false_rejects"][:20]:
        print(f"  false reject: {item['file']} test {item['test']}: {item['why'][:200]}")
    for line in compile_error_lines(report):
        print(line)
    for line in keyword_lines(report):
        print(line)
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 1 if report["false_accepts"] or report["false_rejects"] else 0


def _reachable_target(prog: str, target: str, connect_timeout_s: float) -> str:
    """The target as the client takes it (``directory:`` for a cluster directory), once it answers
    its health check; exits naming the reason when nothing answers within the deadline."""
    from maskd_client import MaskClientError
    from maskd_client.health import SERVING, check
    from maskd_client.routing import is_directory

    try:
        status = check(target, connect_timeout_s=connect_timeout_s)
    except MaskClientError as exc:
        sys.exit(f"{prog}: {exc}")
    if status != SERVING:
        sys.exit(f"{prog}: {target} answers but is not serving (health {status}: draining or starting)")
    if not target.startswith("directory:") and is_directory(target):
        target = f"directory:{target}"
    return target


_GRAMMAR_PREFIX = re.compile(r"^grammar \S+ does not compile: ")


def keyword_lines(report: dict) -> list[str]:
    """The keywords under which some schema fails (all of them with -v style detail in the JSON)."""
    rows = [r for r in report["by_keyword"] if r["passing"] < r["schemas"]]
    if not rows:
        return []
    lines = ["failing schemas by keyword (schemas holding it: passing / all, false rejects, false accepts, "
             "compile errors):"]
    lines += [f"  {r['keyword']:<22} {r['passing']}/{r['schemas']}, {r['false_rejects']}, {r['false_accepts']}, "
              f"{r['compile_errors']}" for r in rows]
    return lines


def reason_of(message: str) -> str:
    """What a compile error says, without what names one schema: the grammar id, the quoted regex
    of a multi-line message (its last line holds the reason), text after '; ' (where it was)."""
    lines = [ln.strip() for ln in _GRAMMAR_PREFIX.sub("", (message or "").strip()).splitlines() if ln.strip()]
    if not lines:
        return "(no message)"
    reason = lines[0]
    if reason.endswith(":") and len(lines) > 1:
        last = lines[-1]
        reason = f"{reason} {last[len('error:'):].strip() if last.startswith('error:') else last}"
    return reason.split("; ")[0][:200]


def errors_by_reason(errors: dict[str, str]) -> list[dict]:
    """[{reason, count, files}], the most frequent reason first."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for name, message in sorted(errors.items()):
        groups[reason_of(message)].append(name)
    return [{"reason": r, "count": len(files), "files": files}
            for r, files in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def compile_error_lines(report: dict, *, files_shown: int = 3) -> list[str]:
    groups = report.get("compile_errors_by_reason") or []
    if not groups:
        return []
    lines = [f"compile errors: {report['compile_errors']} schemas, {len(groups)} reasons"]
    for g in groups:
        more = f" (+{g['count'] - files_shown} more)" if g["count"] > files_shown else ""
        lines.append(f"  {g['count']:>4} x {g['reason']}: {', '.join(g['files'][:files_shown])}{more}")
    return lines
