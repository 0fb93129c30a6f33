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

Memory is bounded: at most ``max_grammars`` grammars (least recently used go first) of at most
``max_contexts`` contexts each (the oldest half goes when a grammar fills up), a few next tokens per
context. Metrics count proposed and accepted drafts by source (forced, learned).
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

from maskd.server.engines import Matcher

CONTEXT = 2          # accepted tokens a learned guess is conditioned on
MIN_COUNT = 2        # a guess seen fewer times than this is not proposed
MIN_SHARE = 0.6      # nor one that followed its context in fewer than this share of the cases
NEXT_KEPT = 4        # next tokens counted per context (the rarest goes when a fifth arrives)
FORCED, LEARNED = "forced", "learned"


class GrammarCounts:
    """Counts of next tokens by context for one grammar."""
    __slots__ = ("contexts", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.contexts: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, history: Sequence[int], tokens: Sequence[int]) -> None:
        """Counts each of ``tokens`` after the CONTEXT tokens before it (``history`` ends where they start)."""
        window = list(history[-CONTEXT:])
        contexts = self.contexts
        for t in tokens:
            if len(window) == CONTEXT:
                key = tuple(window)
                nexts = contexts.get(key)
                if nexts is None:
                    if len(contexts) >= self.limit:
                        for old in list(contexts)[: self.limit // 2]:    # the oldest half
                            del contexts[old]
                    nexts = contexts[key] = {}
                if t in nexts:
                    nexts[t] += 1
                elif len(nexts) < NEXT_KEPT:
                    nexts[t] = 1
                else:       # the rarest gives way (and its count is forgotten)
                    rare = min(nexts, key=nexts.__getitem__)
                    del nexts[rare]
                    nexts[t] = 1
                window.pop(0)
            window.append(t)

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
    """What one step proposed for a sequence: the drafts and where each came from."""
    __slots__ = ("drafts", "sources")

    def __init__(self) -> None:
        self.drafts: list[int] = []
        self.sources: list[str] = []


class DraftModel:
    """The server's drafter: learned counts per grammar id and the proposal walk. Thread-safe
    (sessions step on their own threads)."""

    def __init__(self, *, max_grammars: int = 512, max_contexts: int = 8192, metrics: Any = None) -> None:
        self.max_grammars = max_grammars
        self.max_contexts = max_contexts
        self.metrics = metrics
        self._grammars: collections.OrderedDict[str, GrammarCounts] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _counts(self, grammar_id: str) -> GrammarCounts | None:
        counts = self._grammars.get(grammar_id)
        if counts is not None:
            self._grammars.move_to_end(grammar_id)
        return counts

    def learn(self, grammar_id: str, history: Sequence[int], tokens: Sequence[int]) -> None:
        """Tokens a sequence of ``grammar_id`` accepted after ``history`` (its last tokens)."""
        if not tokens:
            return
        with self._lock:
            counts = self._counts(grammar_id)
            if counts is None:
                counts = self._grammars[grammar_id] = GrammarCounts(self.max_contexts)
                while len(self._grammars) > self.max_grammars:     # the least recently used goes
                    self._grammars.popitem(last=False)
            counts.add(history, tokens)

    def propose(self, grammar_id: str, matcher: Matcher, history: Sequence[int], k: int) -> Proposal:
        """Up to ``k`` drafts the grammar allows after ``history`` (the sequence's last tokens); the
        matcher ends where it began."""
        proposal = Proposal()
        drafts, sources = proposal.drafts, proposal.sources
        with self._lock:
            counts = self._counts(grammar_id)
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
        if self.metrics is not None:
            for source in proposal.sources[:n]:
                self.metrics.drafts_accepted.labels(source).inc()
        return n

    def grammars(self) -> int:
        with self._lock:
            return len(self._grammars)

    def stats(self, grammar_id: str) -> int:
        """Contexts learned for a grammar (0: none)."""
        with self._lock:
            counts = self._grammars.get(grammar_id)
            return 0 if counts is None else len(counts.contexts)
