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
  the GIL released; ``finish`` waits for it, edits the rows (EOS cleared from the rows of documents
  that do not pass, tokens that would close a sub-document that cannot pass taken out, the rows of
  a document that cannot pass any more emptied) and returns a ``Verdict`` per entry it changed:
  which sequences fail and why (a failed sub-document, a grammar that allows nothing but EOS, or a
  root value that has ended so that only whitespace could follow), which lose EOS, whose drafts are
  cut. The step protocol applies them to the entries' answers and sequences; nothing here writes
  to those. Both happen in the step that brought the tokens, so every rank and every replay sees
  the same.

Metrics: ``maskd_validation_seconds`` (the checks of one step, off and on the fill's time) and
``maskd_validation_failures{kind}`` (final, early, eos, draft).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from maskd.server.json_schema.closers import CloserTable
from maskd.server.json_schema.documents import DocumentBuffer

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


@dataclasses.dataclass(slots=True)
class Verdict:
    """What the checks decided for one checked entry (``job``, the step's ``Fill``: ``job.i`` is
    its index in the step's answers); its rows are edited already, the session applies the rest."""
    job: Any
    failed: str = ""                  # the document cannot pass any more: its sequence fails with this
    no_eos: bool = False              # EOS taken out of its row: the document does not pass yet
    drafts_valid: int | None = None   # its drafts cut to this many (an EOS draft on a document that does not pass)


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
            return f"EOS on a document that does not pass: {problem}"
        doc.extend(tokens[eos_at:])   # kept so that a rollback takes back the same tokens
        return None

    def start(self, answers: Any, fill: Sequence[Any]) -> tuple[concurrent.futures.Future, list[_Job], Any] | None:
        """Hands off the checks of the entries about to be filled (``fill``: each with its index
        ``i`` in the step's ``answers``, step_answers.py, whose state the step read already)."""
        jobs = []
        for adv in fill:
            doc = adv.seq.doc
            if doc is None:
                continue
            stopped = adv.seq.finished     # the grammar's state, as the step read it before the fill
            final = answers.accepting(adv.i)
            if final or doc.checker.scans or adv.drafts:   # else nothing to do until EOS is grammatical
                jobs.append(_Job(adv, doc, stopped, final))
        if not jobs:
            return None
        return _pool().submit(_run, jobs), jobs, answers

    def finish(self, pending, out: np.ndarray) -> list[Verdict]:
        """Waits for the checks ``start`` handed off, edits the rows and returns the verdicts."""
        future, jobs, answers = pending
        seconds = future.result()
        if self.metrics is not None:
            self.metrics.validation_seconds.observe(seconds)
        verdicts: list[Verdict] = []
        for job in jobs:
            adv = job.adv
            num_rows = answers.num_rows[adv.i]
            if not num_rows:
                continue                                # failed in the fill: no rows to check
            first_row = answers.first_row[adv.i]       # (a fault in the fill may have moved it up)
            verdict = Verdict(adv)
            if job.problem is not None:
                final = job.want_final and job.doc.doomed is None
                if not final or job.stopped or job.doc.closed():
                    kind = "final" if final else "early"
                    verdicts.append(self._fail(verdict, out, first_row, num_rows, job.problem, kind))
                    continue
                # EOS is grammatical but the document does not pass: more output may still make it pass.
                self._clear_eos(out, first_row)
                verdict.no_eos = True
                if not out[first_row].any():
                    verdicts.append(self._fail(verdict, out, first_row, num_rows, job.problem, "final"))
                    continue
            if job.doc.checker.closers is not None:
                why = self._keep_open(first_row, job.doc, out)
                if why is not None:
                    verdicts.append(self._fail(verdict, out, first_row, num_rows, why, "early"))
                    continue
            if adv.drafts:
                verdict.drafts_valid = self._check_drafts(adv, first_row, num_rows,
                                                          answers.drafts_valid.get(adv.i, 0), out)
            if verdict.no_eos or verdict.drafts_valid is not None:
                verdicts.append(verdict)
        return verdicts

    # -- helpers --------------------------------------------------------------------------------------
    def _keep_open(self, first_row: int, doc: DocumentBuffer, out: np.ndarray) -> str | None:
        """Takes out of the row the tokens that would close (or write whole) a sub-document that
        does not pass, so no output is closed into a state no continuation can make valid (draft
        rows keep what the grammar allows). The reason to fail when that left nothing, else None."""
        row = out[first_row]
        vetoes = doc.checker.row_vetoes(doc.state, doc.data, row)
        if not vetoes:
            return None
        for ids in vetoes:
            CloserTable.clear(row, ids)
        if row.any():
            return None
        why = str(getattr(doc.state, "veto", "")) or "no continuation passes"
        return f"the document does not match the JSON schema and nothing the grammar allows here can make it: {why}"

    def _check_drafts(self, adv, first_row: int, num_rows: int, drafts_valid: int, out: np.ndarray) -> int | None:
        """Draft positions: EOS only where the document with the drafts up to there passes, and no
        draft EOS counts as valid on a document that does not pass (its drafts are cut there: the
        new count, None when none was cut)."""
        doc, drafts = adv.seq.doc, list(adv.drafts)
        valid = drafts_valid
        for j, t in enumerate(drafts[:valid]):
            if int(t) in self.eos and doc.final_with(drafts[:j]) is not None:
                self._count("draft")
                valid = j
                out[first_row + 1 + j: first_row + num_rows] = 0
                break
        for j in range(min(len(drafts), valid)):
            row = first_row + 1 + j
            if self._eos_allowed(out[row]) and doc.final_with(drafts[:j + 1]) is not None:
                self._clear_eos(out, row)
        return valid if valid != drafts_valid else None

    def _eos_allowed(self, row: np.ndarray) -> bool:
        return any((int(row[t >> 5]) >> (t & 31)) & 1 for t in self.eos)

    def _clear_eos(self, out: np.ndarray, row: int) -> None:
        words = out.view(np.uint32)
        for t in self.eos:
            if t >> 5 < out.shape[1]:
                words[row, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)

    def _fail(self, verdict: Verdict, out: np.ndarray, first_row: int, num_rows: int, problem: str,
              kind: str) -> Verdict:
        out[first_row: first_row + num_rows] = 0
        verdict.failed = problem
        self._count(kind)
        return verdict

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
