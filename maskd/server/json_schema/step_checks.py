"""Complete mode on the step path: the hooks the step protocol (session.py) calls.

Only sequences whose grammar is a relaxation (``CompiledGrammar.checker`` set) have a
``DocumentBuffer``; while a session holds none, every hook is skipped by one truth test
(``checks.live``), so plain grammars pay nothing. The hooks:

- ``open_document``: when a sequence gets its matcher, its buffer (or None).
- ``consumed``: after the batched consume, the accepted tokens go into the buffers; an EOS token
  on a document that does not pass turns into that sequence's rejection (the validator's message).
- ``start`` / ``finish``: around the batched mask fill. ``start`` reads the matchers' states and
  hands the checks (decoding the new bytes, early checks of closed sub-documents, the final check
  where EOS is grammatical) to a validation thread, which runs while the fill runs natively with
  the GIL released; ``finish`` waits for it and applies the verdicts: EOS is cleared from the rows
  of documents that do not pass, and a sequence whose document cannot pass any more (a failed
  sub-document, a grammar that allows nothing but EOS, or a root value that has ended so that only
  whitespace could follow) fails with the validator's message.
  Both happen in the step that brought the tokens, so every rank and every replay sees the same.

Metrics: ``maskd_validation_seconds`` (the checks of one step, off and on the fill's time) and
``maskd_validation_failures{kind}`` (final, early, eos, draft).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from maskd.server.json_schema.closers import CloserTable
from maskd.server.json_schema.documents import DocumentBuffer
from maskd.v1.contract import Code, SeqStatus

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="maskd-validate")
        return _POOL


class _Job:
    __slots__ = ("adv", "doc", "problem", "stopped", "want_final")

    def __init__(self, adv: Any, doc: DocumentBuffer, stopped: bool, want_final: bool) -> None:
        self.adv = adv
        self.doc = doc
        self.stopped = stopped
        self.want_final = want_final
        self.problem: str | None = None


def _run(jobs: list[_Job]) -> float:
    t0 = time.perf_counter()
    for job in jobs:
        job.problem = job.doc.final() if job.want_final else job.doc.advance()
    return time.perf_counter() - t0


class DocumentChecks:
    def __init__(self, engine, metrics=None) -> None:
        self.eos = frozenset(int(t) for t in engine.tokenizer.eos_token_ids)
        self.metrics = metrics
        self.live: weakref.WeakSet[DocumentBuffer] = weakref.WeakSet()

    # -- hooks --------------------------------------------------------------------------------------
    def open_document(self, compiled) -> DocumentBuffer | None:
        checker = getattr(compiled, "checker", None)
        if checker is None:
            return None
        doc = DocumentBuffer(checker)
        self.live.add(doc)
        return doc

    def consumed(self, consume: Sequence[Any], reasons: list) -> list:
        """Buffers take the accepted tokens; an EOS on a document that does not pass is refused."""
        for i, adv in enumerate(consume):
            if adv.seq.doc is not None and reasons[i] is None:
                reasons[i] = self.take(adv.seq, adv.tokens)
        return reasons

    def take(self, seq: Any, tokens: Sequence[int]) -> str | None:
        """A sequence's document takes the tokens its matcher accepted; the reason to refuse them
        when they end (EOS) a document that does not pass, else None."""
        doc = seq.doc
        if self.eos.isdisjoint(tokens):   # the common case, without a Python loop
            doc.extend(tokens)
            return None
        eos_at = next(k for k, t in enumerate(tokens) if int(t) in self.eos)
        doc.extend(tokens[:eos_at])
        problem = self._timed(doc.final)
        if problem is not None:
            self._count("eos")
            seq.doc = None
            return f"EOS on a document that does not pass: {problem}"
        doc.extend(tokens[eos_at:])   # kept so that a rollback takes back the same tokens
        return None

    def start(self, fill: Sequence[Any]) -> tuple[concurrent.futures.Future, list[_Job]] | None:
        jobs = []
        for adv in fill:
            doc = adv.seq.doc
            if doc is None:
                continue
            stopped = adv.seq.finished     # the grammar's state, as the step read it before the fill
            final = adv.res.accepting
            if final or doc.checker.scans or adv.drafts:   # else nothing to do until EOS is grammatical
                jobs.append(_Job(adv, doc, stopped, final))
        if not jobs:
            return None
        return _pool().submit(_run, jobs), jobs

    def finish(self, pending, out: np.ndarray, refusals) -> None:
        future, jobs = pending
        seconds = future.result()
        if self.metrics is not None:
            self.metrics.validation_seconds.observe(seconds)
        for job in jobs:
            adv = job.adv
            res = adv.res
            if job.problem is not None:
                final = job.want_final and job.doc.doomed is None
                if not final or job.stopped or job.doc.closed():
                    self._fail(adv, out, job.problem, refusals, "final" if final else "early")
                    continue
                # EOS is grammatical but the document does not pass: more output may still make it pass.
                self._clear_eos(out, res.first_row)
                res.accepting = False
                if not out[res.first_row].any():
                    self._fail(adv, out, job.problem, refusals, "final")
                    continue
            if job.doc.checker.closers is not None and self._keep_open(adv, job.doc, out, refusals):
                continue
            if adv.drafts:
                self._check_drafts(adv, out)

    # -- helpers --------------------------------------------------------------------------------------
    def _keep_open(self, adv, doc: DocumentBuffer, out: np.ndarray, refusals) -> bool:
        """Takes out of the row the tokens that would close (or write whole) a sub-document that
        does not pass, so no output is closed into a state no continuation can make valid (draft
        rows keep what the grammar allows). True when that left nothing and the sequence failed."""
        row = out[adv.res.first_row]
        vetoes = doc.checker.row_vetoes(doc.state, doc.data, row)
        if not vetoes:
            return False
        for ids in vetoes:
            CloserTable.clear(row, ids)
        if row.any():
            return False
        why = str(getattr(doc.state, "veto", "")) or "no continuation passes"
        self._fail(adv, out, f"the document does not match the JSON schema and nothing the grammar allows "
                             f"here can make it: {why}", refusals, "early")
        return True

    def _check_drafts(self, adv, out: np.ndarray) -> None:
        """Draft positions: EOS only where the document with the drafts up to there passes, and no
        draft EOS counts as valid on a document that does not pass."""
        res, doc, drafts = adv.res, adv.seq.doc, list(adv.drafts)
        for j, t in enumerate(drafts[:res.drafts_valid]):
            if int(t) in self.eos and doc.final_with(drafts[:j]) is not None:
                self._count("draft")
                res.drafts_valid = j
                out[res.first_row + 1 + j: res.first_row + res.num_rows] = 0
                break
        for j in range(min(len(drafts), res.drafts_valid)):
            row = res.first_row + 1 + j
            if self._eos_allowed(out[row]) and doc.final_with(drafts[:j + 1]) is not None:
                self._clear_eos(out, row)

    def _eos_allowed(self, row: np.ndarray) -> bool:
        return any((int(row[t >> 5]) >> (t & 31)) & 1 for t in self.eos)

    def _clear_eos(self, out: np.ndarray, row: int) -> None:
        words = out.view(np.uint32)
        for t in self.eos:
            if t >> 5 < out.shape[1]:
                words[row, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)

    def _fail(self, adv, out: np.ndarray, problem: str, refusals, kind: str) -> None:
        res, seq = adv.res, adv.seq
        out[res.first_row: res.first_row + res.num_rows] = 0
        res.status = SeqStatus.FAILED
        res.code = Code.INVALID_ARGUMENT
        res.reason = problem
        res.accepting = False
        res.num_rows = 0
        res.drafts_valid = 0
        del res.forced_tokens[:]
        seq.fail(problem, Code.INVALID_ARGUMENT)
        refusals["schema_invalid"] += 1
        self._count(kind)

    def _timed(self, fn):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            if self.metrics is not None:
                self.metrics.validation_seconds.observe(time.perf_counter() - t0)

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.validation_failures.labels(kind).inc()
