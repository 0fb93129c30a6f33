"""A decode loop that checks every row: what ``maskd soak`` and ``maskd chaos`` run.

A batch of B sequences replays MaskBench valid instances through a maskd client (one open, then
one token per step, then a close; a finished sequence is replaced by the next instance). A mirror
of llguidance matchers in this process applies the same tokens, so every row the server sends is
compared bit for bit with the row the engine computes here, and every instance token is checked
against its row. Per sequence a digest of all its rows is kept, so two runs (one undisturbed, one
with servers killed under it) can be compared sequence by sequence.
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

import numpy as np

from maskd_tools.bench import common


@dataclasses.dataclass
class Slot:
    sid: str
    inst: common.Instance
    applied: int = 0              # tokens the server has applied (as of the last reply)
    send: list[int] = dataclasses.field(default_factory=list)
    matcher: Any = None           # the mirror's llguidance matcher
    digest: Any = None


@dataclasses.dataclass
class Counts:
    steps: int = 0
    rows_checked: int = 0
    rows_differing: int = 0       # server row != in-process row: a server or wire bug
    token_violations: int = 0     # an instance token its row rejects (llguidance's own false rejects too)
    failed: int = 0               # sequences answered FAILED or ERROR
    waiting: int = 0
    completed: int = 0
    reasons: dict = dataclasses.field(default_factory=dict)


def load_instances(data: str, tokenizer, limit: int | None, seed: int) -> list[common.Instance]:
    schemas = [s for s in common.load_schemas(data, tokenizer, limit) if s.instances]
    pool = [common.Instance(s, toks) for s in schemas for toks in s.instances if toks]
    random.Random(seed).shuffle(pool)
    return pool


class Replay:
    """B sequences replaying instances through ``client``, every row checked against the mirror."""

    def __init__(self, client, tokenizer, pool: list[common.Instance], batch: int, tag: str = "r") -> None:
        import llguidance

        self.client, self.tok, self.pool, self.tag = client, tokenizer, pool, tag
        self.llg = llguidance
        self.eos = int(tokenizer.eos_token_ids[0])
        self.words = (tokenizer.logits_width + 31) // 32
        self.counts = Counts()
        self.digests: dict[str, str] = {}      # finished sequence -> digest of all its rows
        self._templates: dict[str, Any] = {}
        self._cursor = 0
        self._bad: set[str] = set()            # schemas the server refuses (skipped afterwards)
        self._executor = llguidance.LLExecutor(num_threads=1)
        self.slots = [self._new_slot() for _ in range(batch)]

    def _template(self, schema: common.Schema):
        t = self._templates.get(schema.name)
        if t is None:
            grammar = common.llguidance_grammar(schema.text)     # the server's grammar, whitespace bound included
            t = self._templates[schema.name] = self.llg.LLMatcher(self.tok.ll, grammar, log_level=0)
        return t

    def _new_slot(self) -> Slot:
        while True:
            inst = self.pool[self._cursor % len(self.pool)]
            self._cursor += 1
            if inst.schema.name in self._bad:
                continue
            try:
                template = self._template(inst.schema)
            except Exception:
                template = None
            if template is None or template.is_error():   # llguidance refuses it, as the server would:
                self._bad.add(inst.schema.name)           # such schemas are not part of the replay
                continue
            sid = f"{self.tag}-{self._cursor}"
            self.client.open(sid, inst.schema.spec)
            return Slot(sid, inst, matcher=template.deep_copy(), digest=hashlib.blake2b(digest_size=16))

    def step(self) -> None:
        """One decode step for the whole batch, every row checked."""
        request = {s.sid: list(s.send) for s in self.slots}
        result = self.client.step(request, timeout=300)
        self.counts.steps += 1
        checked: list[tuple[int, Slot, np.ndarray]] = []
        for i, s in enumerate(self.slots):
            r = result.seqs[s.sid]
            if r.status.name == "WAITING":
                self.counts.waiting += 1
                s.send = []
                continue
            if not r.has_rows:
                self.counts.failed += 1
                key = r.reason[:120]
                self.counts.reasons[key] = self.counts.reasons.get(key, 0) + 1
                self._finish(i, complete=False)
                continue
            for t in s.send:
                s.matcher.consume_token(t)
            s.applied += len(s.send)
            checked.append((i, s, result.bitmask[r.row]))
        if not checked:
            return
        want = np.zeros((len(checked), self.words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(s.matcher, k) for k, (_, s, _) in enumerate(checked)],
                                               want.ctypes.data, self.words * 4, len(checked))
        for k, (i, s, row) in enumerate(checked):
            self.counts.rows_checked += 1
            if not np.array_equal(row, want[k]):
                self.counts.rows_differing += 1
            s.digest.update(row.tobytes())
            nxt = s.inst.tokens[s.applied] if s.applied < len(s.inst.tokens) else self.eos
            allowed = bool((int(row[nxt >> 5]) >> (nxt & 31)) & 1)
            if not allowed:
                self.counts.token_violations += 1
            if s.applied >= len(s.inst.tokens) or not allowed:
                self._finish(i, complete=allowed)
            else:
                s.send = [nxt]

    def _finish(self, i: int, complete: bool) -> None:
        s = self.slots[i]
        self.digests[s.sid] = s.digest.hexdigest()
        if complete:
            self.counts.completed += 1
        self.client.close(s.sid)
        self.slots[i] = self._new_slot()
