"""The sessions of one server, namespaced by tenant, and the streams attached to them.

Streams with the same (tenant, session key) share a session (tensor-parallel ranks); a session
lives while a stream is attached, and its sequences go with the last stream. A tenant never sees
another tenant's sessions: the key is only looked up within the caller's tenant. Each attached
stream records when it last carried a message, so idle streams can be ended (``idle``).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from maskd.server.config import Limits
from maskd.server.drafts import DraftModel, SharedDraftCounts
from maskd.server.engines import Engine
from maskd.server.grammar_cache import GrammarCache
from maskd.server.quotas import Quotas
from maskd.server.session import Session


@dataclasses.dataclass(eq=False)
class Attachment:
    """One Session stream attached to a session."""
    session: Session
    context: Any                                   # the gRPC call's context (to end it when idle)
    last_active: float = dataclasses.field(default_factory=time.monotonic)


class SessionRegistry:
    def __init__(self, engine: Engine, cache: GrammarCache, limits: Limits, quotas: Quotas,
                 shared_drafts: SharedDraftCounts | None = None) -> None:
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self.quotas = quotas
        # Grammar drafts, learned from every session (and the cluster's, with a shared store).
        self.drafts = DraftModel(metrics=cache.metrics, shared=shared_drafts)
        if cache.metrics is not None:
            cache.metrics.watch_drafts(self.drafts)
        self._sessions: dict[tuple[str, str], Session] = {}
        self._attached: set[Attachment] = set()
        self._lock = threading.Lock()

    def attach(self, tenant: str, key: str, context: Any = None) -> Attachment:
        with self._lock:
            session = self._sessions.get((tenant, key))
            if session is None:
                session = Session(key, self.engine, self.cache, self.limits, tenant=tenant, quotas=self.quotas,
                                  drafts=self.drafts)
                self._sessions[(tenant, key)] = session
            session.streams += 1
            attachment = Attachment(session, context)
            self._attached.add(attachment)
            return attachment

    def detach(self, attachment: Attachment) -> None:
        session = attachment.session
        with self._lock:
            self._attached.discard(attachment)
            session.streams -= 1
            if session.streams == 0:
                del self._sessions[(session.tenant, session.key)]
                session.close_all()  # a dropped stream frees all its sequences

    def idle(self, older_than_s: float) -> list[Attachment]:
        """Streams that carried no message for ``older_than_s`` seconds."""
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            return [a for a in self._attached if a.last_active < cutoff]

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def live_sequences(self) -> int:
        return sum(len(s.seqs) for s in self.sessions())

    def waiting_sequences(self) -> int:
        return sum(s.waiting_count() for s in self.sessions())
