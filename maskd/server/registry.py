"""The sessions of one server: attached streams, shared keys, and what they hold."""
from __future__ import annotations

import threading

from maskd.server.config import Limits
from maskd.server.engines import Engine
from maskd.server.grammar_cache import GrammarCache
from maskd.server.session import Session


class SessionRegistry:
    """Sessions by key. Streams with the same key share a session (tensor-parallel ranks); a
    session lives while a stream is attached, and its sequences go with the last stream."""

    def __init__(self, engine: Engine, cache: GrammarCache, limits: Limits) -> None:
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def attach(self, key: str) -> Session:
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session = Session(key, self.engine, self.cache, self.limits)
                self._sessions[key] = session
            session.streams += 1
            return session

    def detach(self, session: Session) -> None:
        with self._lock:
            session.streams -= 1
            if session.streams == 0:
                del self._sessions[session.key]
                session.close_all()  # a dropped stream frees all its sequences

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def live_sequences(self) -> int:
        return sum(len(s.seqs) for s in self.sessions())

    def waiting_sequences(self) -> int:
        return sum(s.waiting_count() for s in self.sessions())
