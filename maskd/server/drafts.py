"""Grammar drafts: the draft tokens a server proposes for a sequence (DOMINO's speculation, seed 001).

A step that asks for ``k`` drafts (``SeqStep.propose_drafts``) gets, from the sequence's matcher at
the position after its tokens, up to ``k`` tokens, one position at a time:

1. a guess learned from this grammar's sequences, when one is confident: the token that followed
   the same context most often (see ``Context`` below), at least ``MIN_COUNT`` times and in at
   least ``MIN_SHARE`` of the cases; else
2. the tokens the grammar forces there (llguidance's fast-forward tokens: the canonical
   tokenization of the bytes every continuation starts with);

and every draft is validated, then consumed by the matcher (a token the grammar refuses ends the
proposal), so only drafts the grammar allows are proposed. The matcher is rolled back over them: the fill
phase then writes a row for every draft position as for drafts an engine sent.

Why the learned guess comes first where the grammar forces tokens: forced tokens are the
*canonical* tokenization, but a grammar allows every tokenization of the same bytes and a model
does not always write the canonical one (``{"`` as ``{`` + ``"``); counts of what this grammar's
sequences really wrote there know which one the model takes.

The context a guess is keyed on is (grammar id, the last ``CONTEXT`` accepted tokens). DOMINO keys
its counts on the parser state; llguidance exposes no state id a server could key on (its state is
an Earley parse plus a lexer state), so the tokens just written stand in for it, inside one grammar,
and the grammar itself filters every guess. Counts are learned from every token any sequence of the
grammar accepts on this server once drafts were asked for that grammar (whether or not the sequence
itself asked): grammars nobody drafts cost the step nothing.

Cluster-wide (``shared``, the cluster's grammar store): every ``sync`` sends the counts this server
learned since the last one and takes back, for every grammar it learned or proposed from, the
counts the whole cluster learned (its own included), so a grammar's sequences on every worker
teach the drafts every worker proposes; the same grammar id means the same statistics on every
replica. A server that cannot reach the store keeps proposing from what it has.

Memory is bounded: at most ``max_grammars`` grammars (least recently used go first) of at most
``max_contexts`` contexts each (the oldest half goes when a grammar fills up), a few next tokens per
context. Metrics count proposed and accepted drafts by source (forced, learned).
"""
from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from maskd.server.engines import Matcher

log = logging.getLogger("maskd.server.drafts")

CONTEXT = 2          # accepted tokens a learned guess is conditioned on
MIN_COUNT = 2        # a guess seen fewer times than this is not proposed
MIN_SHARE = 0.6      # nor one that followed its context in fewer than this share of the cases
NEXT_KEPT = 4        # next tokens counted per context (the rarest goes when a fifth arrives)
FORCED, LEARNED = "forced", "learned"


class GrammarCounts:
    """Counts of next tokens by context for one grammar (and the drafts proposed from it on this
    server, and how many of them the next steps took)."""
    __slots__ = ("accepted", "contexts", "limit", "proposed")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.contexts: dict[tuple[int, ...], dict[int, int]] = {}
        self.proposed = self.accepted = 0

    def add(self, history: Sequence[int], tokens: Sequence[int]) -> None:
        """Counts each of ``tokens`` after the CONTEXT tokens before it (``history`` ends where they start)."""
        window = list(history[-CONTEXT:])
        for t in tokens:
            if len(window) == CONTEXT:
                self.bump(tuple(window), t, 1)
                window.pop(0)
            window.append(t)

    def bump(self, key: tuple[int, ...], t: int, n: int) -> None:
        """``n`` more of token ``t`` after context ``key``, within the bounds."""
        contexts = self.contexts
        nexts = contexts.get(key)
        if nexts is None:
            if len(contexts) >= self.limit:
                for old in list(contexts)[: self.limit // 2]:    # the oldest half
                    del contexts[old]
            nexts = contexts[key] = {}
        if t in nexts:
            nexts[t] += n
        elif len(nexts) < NEXT_KEPT:
            nexts[t] = n
        else:       # the rarest gives way (and its count is forgotten)
            rare = min(nexts, key=nexts.__getitem__)
            del nexts[rare]
            nexts[t] = n

    def rows(self) -> np.ndarray:
        """The counts as rows of (context tokens..., next token, count): what travels between a
        server and the cluster's store."""
        flat = [(*key, t, n) for key, nexts in self.contexts.items() for t, n in nexts.items()]
        return np.array(flat, dtype=np.int64).reshape(len(flat), CONTEXT + 2)

    def merge(self, rows: np.ndarray) -> None:
        """Adds counts in the form ``rows`` gives them."""
        for r in np.asarray(rows, dtype=np.int64).reshape(-1, CONTEXT + 2).tolist():
            self.bump(tuple(r[:CONTEXT]), r[CONTEXT], r[CONTEXT + 1])

    def guess(self, context: Sequence[int]) -> int | None:
        nexts = self.contexts.get(tuple(context[-CONTEXT:]))
        if not nexts:
            return None
        best = max(nexts, key=nexts.__getitem__)
        n = nexts[best]
        if n < MIN_COUNT or n < MIN_SHARE * sum(nexts.values()):
            return None
        return best


class Proposal:
    """What one step proposed for a sequence: the drafts, where each came from, and whose counts
    (the grammar's key) they are scored on."""
    __slots__ = ("drafts", "key", "sources")

    def __init__(self, key: str = "") -> None:
        self.key = key
        self.drafts: list[int] = []
        self.sources: list[str] = []


class SharedDraftCounts(Protocol):
    """What the cluster's store offers a server's drafter (maskd_cluster's grammar store)."""

    def exchange_draft_counts(self, learned: dict[str, np.ndarray], wanted: list[str]) -> dict[str, np.ndarray]:
        """Adds ``learned`` (counts as ``GrammarCounts.rows``) to the cluster's; returns the
        cluster's counts of the ``wanted`` keys it has."""


class DraftModel:
    """The server's drafter: learned counts per grammar id and the proposal walk. Thread-safe
    (sessions step on their own threads)."""

    def __init__(self, *, max_grammars: int = 512, max_contexts: int = 8192, metrics: Any = None,
                 shared: SharedDraftCounts | None = None) -> None:
        self.max_grammars = max_grammars
        self.max_contexts = max_contexts
        self.metrics = metrics
        self.shared = shared
        self._grammars: collections.OrderedDict[str, GrammarCounts] = collections.OrderedDict()
        self._lock = threading.Lock()
        # With a shared store: counts learned here since the last sync, and keys proposed from.
        self._unsent: dict[str, GrammarCounts] = {}
        self._asked: set[str] = set()

    def _counts(self, grammar_id: str) -> GrammarCounts | None:
        counts = self._grammars.get(grammar_id)
        if counts is not None:
            self._grammars.move_to_end(grammar_id)
        return counts

    def _new_counts(self, grammar_id: str) -> GrammarCounts:
        counts = self._grammars[grammar_id] = GrammarCounts(self.max_contexts)
        while len(self._grammars) > self.max_grammars:     # the least recently used goes
            self._grammars.popitem(last=False)
        return counts

    def learn(self, grammar_id: str, history: Sequence[int], tokens: Sequence[int]) -> None:
        """Tokens a sequence of ``grammar_id`` accepted after ``history`` (its last tokens)."""
        if not tokens:
            return
        with self._lock:
            counts = self._counts(grammar_id) or self._new_counts(grammar_id)
            counts.add(history, tokens)
            if self.shared is not None:
                unsent = self._unsent.get(grammar_id)
                if unsent is None:
                    if len(self._unsent) >= self.max_grammars:   # bounded like the counts themselves
                        del self._unsent[next(iter(self._unsent))]
                    unsent = self._unsent[grammar_id] = GrammarCounts(self.max_contexts)
                unsent.add(history, tokens)

    def sync(self) -> int:
        """One exchange with the cluster's store: what was learned here goes out, the cluster's
        counts of every grammar learned or proposed from since the last sync come back (plus what
        was learned here meanwhile). Returns the grammars updated; a store that does not answer
        costs nothing but the exchange (counts learned meanwhile go out with the next one)."""
        if self.shared is None:
            return 0
        with self._lock:
            unsent, self._unsent = self._unsent, {}
            wanted = sorted(set(unsent) | self._asked)
            self._asked = set()
        if not wanted:
            return 0
        try:
            merged = self.shared.exchange_draft_counts({k: c.rows() for k, c in unsent.items()}, wanted)
        except Exception as exc:   # the store is gone or slow: keep what is known here, resend later
            log.warning("grammar drafts: cannot exchange counts with the cluster's store: %s", exc)
            with self._lock:
                for key, counts in unsent.items():
                    again = self._unsent.setdefault(key, GrammarCounts(self.max_contexts))
                    again.merge(counts.rows())
            return 0
        with self._lock:
            for key, rows in merged.items():
                counts = GrammarCounts(self.max_contexts)
                counts.merge(rows)
                before = self._grammars.get(key)
                if before is not None:     # this server's own tallies stay
                    counts.proposed, counts.accepted = before.proposed, before.accepted
                since = self._unsent.get(key)
                if since is not None:
                    counts.merge(since.rows())
                self._grammars[key] = counts
                self._grammars.move_to_end(key)
            while len(self._grammars) > self.max_grammars:
                self._grammars.popitem(last=False)
        return len(merged)

    def propose(self, grammar_id: str, matcher: Matcher, history: Sequence[int], k: int) -> Proposal:
        """Up to ``k`` drafts the grammar allows after ``history`` (the sequence's last tokens); the
        matcher ends where it began."""
        proposal = Proposal(grammar_id)
        drafts, sources = proposal.drafts, proposal.sources
        with self._lock:
            counts = self._counts(grammar_id)
            if self.shared is not None:
                self._asked.add(grammar_id)
        context = list(history[-CONTEXT:])
        consumed = 0
        try:
            while len(drafts) < k and not matcher.is_stopped():
                guess = None
                if counts is not None and len(context) >= CONTEXT:
                    with self._lock:
                        guess = counts.guess(context)
                # Validated before they are consumed: a refused token would leave the matcher failed.
                if guess is not None and matcher.validate([guess]) == 1:
                    take, source = [guess], LEARNED
                else:
                    forced = matcher.forced_tokens()[: k - len(drafts)]
                    take, source = forced[: matcher.validate(forced)] if forced else [], FORCED
                    if not take:
                        break
                if matcher.consume(take) is not None:
                    raise RuntimeError(f"the grammar refused drafts {take} it validated")
                consumed += len(take)
                drafts.extend(take)
                sources.extend([source] * len(take))
                context = (context + take)[-CONTEXT:]
        finally:
            if consumed:
                matcher.rollback(consumed)
        if drafts:
            with self._lock:
                counts = self._counts(grammar_id) or self._new_counts(grammar_id)
                counts.proposed += len(drafts)
        if self.metrics is not None and drafts:
            for source in (FORCED, LEARNED):
                n = sources.count(source)
                if n:
                    self.metrics.drafts_proposed.labels(source).inc(n)
        return proposal

    def accepted(self, proposal: Proposal, tokens: Sequence[int]) -> int:
        """How many of a proposal's drafts the next step's tokens took (their common prefix: an
        engine sends the accepted drafts, then its bonus token); counted by source."""
        n = 0
        for d, t in zip(proposal.drafts, tokens):
            if d != t:
                break
            n += 1
        if n:
            with self._lock:
                counts = self._grammars.get(proposal.key)
                if counts is not None:
                    counts.accepted += n
        if self.metrics is not None:
            for source in proposal.sources[:n]:
                self.metrics.drafts_accepted.labels(source).inc()
        return n

    def per_grammar(self) -> list[tuple[str, int, int]]:
        """(key, drafts proposed, drafts accepted) of every grammar the drafter holds (bounded by
        ``max_grammars``): what the per-grammar metrics report."""
        with self._lock:
            return [(key, c.proposed, c.accepted) for key, c in self._grammars.items() if c.proposed]

    def grammars(self) -> int:
        with self._lock:
            return len(self._grammars)

    def stats(self, grammar_id: str) -> int:
        """Contexts learned for a grammar (0: none)."""
        with self._lock:
            counts = self._grammars.get(grammar_id)
            return 0 if counts is None else len(counts.contexts)
