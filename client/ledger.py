"""The client's record of its sequences: grammar, step, accepted history, handle, typed undo, restores.

The server's state of a sequence is a function of (grammar, accepted tokens), so this ledger is
all a client needs to rebuild it anywhere: ``restore_requests`` reopens sequences at the state
before the steps still in flight, in parts of at most ``max_tokens_per_step`` tokens (the
contract's "Restores"). A sequence's handle (given by its server at open, for columnar steps) is
kept too; it is forgotten when that server's stream is lost, until a restore gives a new one.

Every method is called with the owning client's lock held; the ledger itself does no locking.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import grpc

from maskd.v1 import maskd_pb2 as pb
from maskd_client.types import MaskClientError


@dataclasses.dataclass
class LedgerSequence:
    """One sequence as the client knows it (including the steps it sent but not yet heard back)."""
    spec: pb.GrammarSpec
    step: int = -1                                   # last step sent
    history: list[int] = dataclasses.field(default_factory=list)   # accepted tokens, as sent
    opened: bool = False                             # an open has been sent
    handle: int = 0                                  # its server's handle (0: none known)
    grammar_id: str = ""                             # the open names this id, not the spec ("": the spec)


@dataclasses.dataclass(frozen=True, slots=True)
class UndoRecord:
    """What one step did to one sequence's record, so that it can be taken back."""
    seq_id: str
    step: int                   # the step this advance sent
    n_tokens: int               # tokens it appended to the history
    popped: tuple[int, ...]     # tokens its rollback removed
    opened_here: bool           # it carried the open


@dataclasses.dataclass(frozen=True, slots=True)
class PlainUndo:
    """What one columnar step did to its sequences: each advanced one step by counts[i] tokens."""
    seq_ids: list[str]
    steps: list[int]
    counts: list[int]

    def records(self, only: set[str] | None = None) -> Iterator[UndoRecord]:
        for sid, step, n in zip(self.seq_ids, self.steps, self.counts):
            if only is None or sid in only:
                yield UndoRecord(sid, step, n, (), False)


Undo = UndoRecord | PlainUndo


def records_of(items: Iterable[Undo], only: set[str] | None = None) -> list[UndoRecord]:
    """UndoRecords in order, columnar steps expanded."""
    out: list[UndoRecord] = []
    for u in items:
        if isinstance(u, PlainUndo):
            out.extend(u.records(only))
        elif only is None or u.seq_id in only:
            out.append(u)
    return out


class Advance(NamedTuple):
    """One sequence's input for a step, already checked (ints, rollback in range). A named tuple:
    one is built per sequence and step, and a tuple is the cheapest immutable record to build."""
    seq_id: str
    tokens: list[int]
    drafts: Sequence[int]
    rollback: int
    propose: int = 0
    unmasked: bool = False


class SequenceLedger:
    def __init__(self) -> None:
        self._seqs: dict[str, LedgerSequence] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def ids(self) -> list[str]:
        return list(self._seqs)

    def history(self, seq_id: str) -> list[int]:
        return list(self._seqs[seq_id].history)

    def spec(self, seq_id: str) -> pb.GrammarSpec:
        return self._seqs[seq_id].spec

    # -- opening and closing ----------------------------------------------------------------------
    def open(self, seq_id: str, spec: pb.GrammarSpec, grammar_id: str = "") -> None:
        if seq_id in self._seqs:
            raise MaskClientError(f"sequence {seq_id!r} is already open on this client",
                                  grpc.StatusCode.ALREADY_EXISTS)
        self._seqs[seq_id] = LedgerSequence(spec, grammar_id=grammar_id)

    def close(self, seq_id: str) -> pb.SeqStep | None:
        """Forgets a sequence; returns the close entry for the server (None if it never got there)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None or not seq.opened:
            return None
        return pb.SeqStep(seq_id=seq_id, step=seq.step, close=True)

    # -- steps ------------------------------------------------------------------------------------
    def checked(self, advances: Sequence[Advance]) -> list[LedgerSequence]:
        """Each input's record, every input checked first: MaskClientError (nothing changed) for an
        unknown sequence, a negative propose or a rollback past its history."""
        seqs = self._seqs
        records: list[LedgerSequence] = []
        append = records.append
        for a in advances:
            seq = seqs.get(a.seq_id)
            if seq is None:
                raise MaskClientError(f"sequence {a.seq_id!r} is not open on this client", grpc.StatusCode.NOT_FOUND)
            if a.propose and a.propose < 0:
                raise MaskClientError(f"sequence {a.seq_id!r}: propose must be >= 0, not {a.propose}",
                                      grpc.StatusCode.INVALID_ARGUMENT)
            if a.rollback and (a.rollback < 0 or a.rollback > len(seq.history)):
                raise MaskClientError(f"cannot roll back {a.rollback} tokens of {a.seq_id!r}: it has "
                                      f"{len(seq.history)}", grpc.StatusCode.OUT_OF_RANGE)
            append(seq)
        return records

    def plain(self, tokens_by_seq: Mapping[str, Any]) -> tuple[list[str], list[LedgerSequence], list[list[int]]] | None:
        """The decode step's common case checked in one pass, with no Advance per input: every input
        a list of one int, every sequence open on its server with its handle known. (ids, records,
        tokens) for ``advance_plain``; None where any input needs ``checked`` (nothing changed)."""
        seqs = self._seqs
        records: list[LedgerSequence] = []
        tokens: list[list[int]] = []
        for sid, value in tokens_by_seq.items():
            seq = seqs.get(sid)
            if (seq is None or seq.handle <= 0 or not seq.opened or type(value) is not list or len(value) != 1
                    or type(value[0]) is not int):
                return None
            records.append(seq)
            tokens.append(value)
        return list(tokens_by_seq), records, tokens

    def advance(self, a: Advance) -> tuple[pb.SeqStep, UndoRecord]:
        """Applies one checked input to its record; returns its wire entry and its undo record."""
        seq = self._seqs[a.seq_id]
        entry = pb.SeqStep(seq_id=a.seq_id, tokens=a.tokens, draft_tokens=a.drafts, rollback=a.rollback,
                           propose_drafts=a.propose, sampled_unmasked=a.unmasked)
        opened_here = not seq.opened
        if opened_here:
            if seq.grammar_id:
                entry.grammar_id = seq.grammar_id
            else:
                entry.spec.CopyFrom(seq.spec)
            seq.opened = True
        popped: tuple[int, ...] = ()
        if a.rollback:
            popped = tuple(seq.history[-a.rollback:])
            del seq.history[-a.rollback:]
        seq.step += 1
        entry.step = seq.step
        seq.history.extend(a.tokens)
        return entry, UndoRecord(a.seq_id, seq.step, len(a.tokens), popped, opened_here)

    @staticmethod
    def advance_plain(seq_ids: list[str], seqs: list[LedgerSequence],
                      tokens: list[list[int]]) -> tuple[list[int], list[int], PlainUndo]:
        """Columnar steps of sequences that can take them (open on their server, handle known; their
        records as ``checked`` gave them): (handles, steps, undo)."""
        handles, steps, counts = [], [], []
        for seq, toks in zip(seqs, tokens):
            seq.step += 1
            seq.history.extend(toks)
            handles.append(seq.handle)
            steps.append(seq.step)
            counts.append(len(toks))
        return handles, steps, PlainUndo(seq_ids, steps, counts)

    def set_handles(self, handles: dict[str, int]) -> None:
        for sid, h in handles.items():
            seq = self._seqs.get(sid)
            if seq is not None:
                seq.handle = h

    def forget_handles(self, seq_ids: Iterable[str]) -> None:
        for sid in seq_ids:
            seq = self._seqs.get(sid)
            if seq is not None:
                seq.handle = 0

    def undo(self, records: Iterable[Undo], only: set[str] | None = None) -> None:
        """Takes back what steps did (newest first), e.g. for entries the server refused."""
        for rec in reversed(records_of(records, only)):
            seq = self._seqs.get(rec.seq_id)
            if seq is None or seq.step != rec.step:
                continue
            _revert(seq, rec)

    def retract(self, records: Iterable[Undo], only: set[str]) -> None:
        """Takes back the tokens of answered steps the server did not consume (sampled_unmasked
        tokens it refused: ``resample``); the steps themselves count."""
        for rec in records_of(records, only):
            seq = self._seqs.get(rec.seq_id)
            if seq is not None and seq.step == rec.step and rec.n_tokens:
                del seq.history[-rec.n_tokens:]

    # -- restores ---------------------------------------------------------------------------------
    def restore_requests(self, seq_ids: Iterable[str], in_flight: Sequence[Sequence[Undo]],
                         max_tokens_per_step: int) -> list[pb.StepRequest]:
        """Messages that reopen ``seq_ids`` at their state before the steps in ``in_flight`` (oldest
        first): each opened sequence at its last acknowledged step with its whole history, in
        parts of at most ``max_tokens_per_step`` tokens (part k of every sequence in message k)."""
        wanted = set(seq_ids)
        state = {sid: dataclasses.replace(s, history=list(s.history))
                 for sid, s in self._seqs.items() if sid in wanted}
        for records in reversed(in_flight):
            for rec in reversed(records_of(records)):
                seq = state.get(rec.seq_id)
                if seq is not None and seq.step == rec.step:
                    _revert(seq, rec)
        limit = max(1, max_tokens_per_step)
        requests: list[pb.StepRequest] = []
        for sid, seq in state.items():
            if not seq.opened or seq.step < 0:
                continue
            for k, offset in enumerate(_part_offsets(len(seq.history), limit)):
                if k == len(requests):
                    requests.append(pb.StepRequest())
                entry = requests[k].seqs.add(seq_id=sid, step=seq.step, history_offset=offset,
                                             tokens=seq.history[offset:offset + limit])
                entry.spec.CopyFrom(seq.spec)
        return requests


def _revert(seq: LedgerSequence, rec: UndoRecord) -> None:
    if rec.n_tokens:
        del seq.history[-rec.n_tokens:]
    seq.history.extend(rec.popped)
    seq.step -= 1
    if rec.opened_here:
        seq.opened = False
        seq.grammar_id = ""     # refused (the server no longer holds that id?) or lost: the spec goes next


def _part_offsets(n: int, limit: int) -> Iterator[int]:
    yield 0
    yield from range(limit, n, limit)
