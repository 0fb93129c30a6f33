"""What the engine adapters (vLLM, SGLang, transformers) share: where maskd is, from the environment;
the wait for a compile; the one loop that hands a step's answers out (:func:`deliver_answers`);
the EOS-only row (:func:`eos_row`).

The serving engines (SGLang, vLLM) create their grammar backends themselves, in every
tensor-parallel rank, so their adapters read where maskd is from the environment:

* ``MASKD_TARGET``: ``HOST:PORT`` of a maskd server, or ``directory:HOST:PORT`` of a cluster.
* ``MASKD_SESSION``: the session key every rank of one engine shares (default: derived from the
  engine's launch, identical on its ranks).
* ``MASKD_AUTH_TOKEN`` (or ``MASKD_AUTH_TOKEN_FILE``): a bearer token.
* ``MASKD_TLS=1`` and ``MASKD_TLS_ROOT_CERTS=PATH``: TLS (with a private CA).
* ``MASKD_TOKENIZER_FINGERPRINT``: refuse a server with another vocabulary.
* ``MASKD_TIMEOUT_S`` (30): one step's reply; ``MASKD_WAIT_TIMEOUT_S`` (60): how long a sequence
  whose grammar is still compiling may hold a batch before it is given up.
* ``MASKD_RECOVERY_TIMEOUT_S`` (60): how long, after a maskd server is lost, the steps it had wait for
  it (restarted, or another cluster worker) to take their sequences back (the client's
  ``recovery_timeout_s``).

An engine whose step waits for maskd's answer waits ``MASKD_TIMEOUT_S`` + 5 s; one that holds
maskd's requests out of its steps meanwhile (vLLM's ``MASKD_STEP_DEADLINE_S``) waits as long as the
client may take, the later of its two clocks + 5 s (``EngineSettings.reply_bound_s``).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import grpc
import numpy as np

from maskd_client.client import MaskClient
from maskd_client.types import MaskClientError, SeqResult, SeqStatus, StepResult

K = TypeVar("K")


class EngineConfigError(ValueError):
    """The environment does not say how to reach maskd (or says it wrongly)."""


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    target: str
    session: str | None = None
    auth_token: str | None = None
    tls: bool = False
    tls_root_certs: bytes | None = None
    tokenizer_fingerprint: str | None = None
    timeout_s: float = 30.0
    wait_timeout_s: float = 60.0
    recovery_timeout_s: float = 60.0

    def reply_bound_s(self, held: bool) -> float:
        """How long an engine waits for a step's answer before its sequences fail. ``held``: the
        engine holds the step's requests out of its steps meanwhile (the others decode), so as long
        as the client may take (``timeout_s`` for a server that answers, ``recovery_timeout_s`` for
        one it lost and reconnects to, a restart replaying the sequences) and 5 s more: with
        ``timeout_s`` + 5, a maskd restarted within the recovery window but after 35 s (one took 46 s
        beside an engine using every core) failed the requests the client was about to restore.
        Not held (the engine's step waits for the answer): ``timeout_s`` + 5."""
        return (max(self.timeout_s, self.recovery_timeout_s) if held else self.timeout_s) + 5

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineSettings:
        env = os.environ if env is None else env
        target = env.get("MASKD_TARGET", "").strip()
        if not target:
            raise EngineConfigError("MASKD_TARGET is not set: export MASKD_TARGET=HOST:PORT of a maskd server "
                                    "(or directory:HOST:PORT of a maskd cluster) before starting the engine")
        token = env.get("MASKD_AUTH_TOKEN") or None
        token_file = env.get("MASKD_AUTH_TOKEN_FILE")
        if token is None and token_file:
            token = _read(token_file, "MASKD_AUTH_TOKEN_FILE").decode().strip()
        certs_path = env.get("MASKD_TLS_ROOT_CERTS")
        certs = _read(certs_path, "MASKD_TLS_ROOT_CERTS") if certs_path else None
        return cls(target=target, session=env.get("MASKD_SESSION") or None, auth_token=token,
                   tls=_flag(env.get("MASKD_TLS", "")) or certs is not None, tls_root_certs=certs,
                   tokenizer_fingerprint=env.get("MASKD_TOKENIZER_FINGERPRINT") or None,
                   timeout_s=_seconds(env, "MASKD_TIMEOUT_S", 30.0),
                   wait_timeout_s=_seconds(env, "MASKD_WAIT_TIMEOUT_S", 60.0),
                   recovery_timeout_s=_seconds(env, "MASKD_RECOVERY_TIMEOUT_S", 60.0))

    def client(self, default_session: str) -> MaskClient:
        """A client on the shared session (MASKD_SESSION, or the engine's default key)."""
        return MaskClient(self.target, tokenizer=self.tokenizer_fingerprint, session=self.session or default_session,
                          auth_token=self.auth_token, tls=self.tls, tls_root_certs=self.tls_root_certs,
                          timeout_s=self.timeout_s, recovery_timeout_s=self.recovery_timeout_s)


def _read(path: str, name: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise EngineConfigError(f"{name}={path}: {exc.strerror or exc}") from None


def _flag(value: str) -> bool:
    v = value.strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise EngineConfigError(f"MASKD_TLS={value!r}: use 1 or 0")


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise EngineConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise EngineConfigError(f"{name}={raw!r} must be positive")
    return value


def register_compiled(client: Any, spec: Any, wait_timeout_s: float, timeout_s: float) -> str:
    """(an engine's compile thread) The id of ``spec``'s grammar once the server has compiled it,
    waiting up to ``wait_timeout_s`` in all: an engine schedules a request whose grammar is ready,
    and its step must never wait on a compile (every request of the engine would wait with it).
    The server may answer a waiting register still compiling (no thread free to wait on it: a
    burst of new grammars): asked again after a pause. MaskClientError with the compile error, or
    DEADLINE_EXCEEDED past ``wait_timeout_s``."""
    deadline = time.monotonic() + wait_timeout_s
    while True:
        left = deadline - time.monotonic()
        wait_s = max(0.1, min(left, timeout_s))
        asked = time.monotonic()
        try:
            return client.register(spec, wait=True, timeout_s=wait_s, require_ready=True)
        except MaskClientError as exc:
            if exc.code is not grpc.StatusCode.DEADLINE_EXCEEDED or left <= 0:
                raise
            early = wait_s - (time.monotonic() - asked)
            if early > 0.05:
                time.sleep(0.05)


def deliver_answers(result: StepResult, keys: Mapping[str, K], step: Callable[[dict[str, Any]], StepResult],
                    wait_timeout_s: float, ready: Callable[[K, SeqResult, StepResult], None],
                    give_up: Callable[[K, str, SeqResult | None], None],
                    again: Callable[[K, SeqResult], Any] | None = None, poll: Callable[[K], Any] | None = None,
                    first_pause_s: float = 0.001) -> int:
    """The engine adapters' one answer loop (vLLM, SGLang, transformers): hands every sequence of
    ``keys`` (seq_id -> the adapter's own key: a batch row, a slot, a step entry) its answer in
    ``result``: ``ready(key, res, result)`` for rows, ``give_up(key, reason, res)`` for a failure
    or a refusal (``res`` None where the grammar was still compiling when the wait ran out).
    Sequences whose grammar is still compiling are polled (``first_pause_s``, 1 ms, doubling to
    50 ms between polls) until ``wait_timeout_s`` after the loop began, then given up with "grammar
    still compiling after N s". A poll's entry is ``poll(key)`` (default: no tokens; an entry with
    drafts asks for their rows again). ``again``: for a refused sequence, the step entry to send
    once more at once, or None to give it up (an open that named a grammar id the server no longer
    holds is refused with NOT_FOUND and taken back by the client: sent again, it carries the spec).
    ``step`` sends a step and returns its answer; its errors (and ``give_up``'s) propagate. Returns
    the number of polls sent."""
    began = time.monotonic()
    attempt = 0
    carried: dict[str, K] = {}      # waiting over a step that only sent refused entries again
    while True:
        waiting: dict[str, K] = carried
        carried = {}
        resend: dict[str, tuple[K, Any]] = {}
        for sid, key in keys.items():
            res = result.seqs.get(sid)
            if res is None:
                raise MaskClientError(f"maskd's answer has no result for sequence {sid!r}")
            if res.has_rows:
                ready(key, res, result)
            elif res.status is SeqStatus.WAITING:
                waiting[sid] = key
            else:
                entry = again(key, res) if again is not None else None
                if entry is None:
                    give_up(key, res.reason or res.status.name, res)
                else:
                    resend[sid] = (key, entry)
        if waiting and time.monotonic() - began > wait_timeout_s:
            for key in waiting.values():
                give_up(key, f"grammar still compiling after {wait_timeout_s:g} s", None)
            waiting = {}
        if resend:
            # at once and alone: the polls keep their own steps, numbered alike on every rank of a
            # tensor-parallel engine whether or not its open was the one refused
            carried = waiting
            keys = {sid: key for sid, (key, _) in resend.items()}
            result = step({sid: entry for sid, (_, entry) in resend.items()})
            continue
        if not waiting:
            return attempt
        time.sleep(min(0.05, first_pause_s * 2 ** attempt))
        attempt += 1
        keys = waiting
        result = step({sid: [] if poll is None else poll(key) for sid, key in waiting.items()})


def eos_row(eos_token_ids: Iterable[int], words: int) -> np.ndarray:
    """The mask row (``words`` int32 words) that allows only the EOS ids: what an adapter gives a
    sequence that has ended or failed, so its request samples EOS and ends."""
    row = np.zeros(words, dtype=np.uint32)
    for t in eos_token_ids:
        row[int(t) >> 5] |= np.uint32(1) << np.uint32(int(t) & 31)
    return row.view(np.int32)
