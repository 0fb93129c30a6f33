"""A writer that only ever takes tokens its rows allow, for the no-dead-end tests of complete mode.

Each sequence follows a guide (a valid document's tokens) while the guide's next token is allowed
and a coin says so; otherwise it leaves the guide for good, wanders for a few random allowed
tokens (short ones, half of them structural: quotes, brackets, commas, colons, digits), then heads
for the way out (mostly tokens with a quote or a closing bracket), and takes EOS as soon as EOS is
allowed: it tries to close things where a model that went astray would. A sequence the server
fails is a dead end: the writer did nothing its rows forbade.
Bounded: at most ``max_tokens`` tokens per sequence.

Styles (``style``): ``"guide"`` as above; ``"invent"`` leaves the guide at a random point (at once,
a third of the time) and writes keys and values of its own for longer (3 to 24 tokens: openers
``{`` ``[`` ``"``, letters, structural tokens) before it heads for the way out, so it opens objects
and arrays the guide never has, under keys the schema may not name, and closes them early.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np

from maskd_client import MaskClient, SeqStatus


@dataclasses.dataclass
class Outcome:
    name: str
    status: str            # "finished", "capped" or "dead end"
    text: str
    reason: str = ""
    strayed: bool = False   # the writer left its guide (what it wrote is its own)


class TokenTable:
    """Per tokenizer: which ids are short, and which of those are structural."""

    def __init__(self, tok) -> None:
        n = tok.vocab_size
        short = np.zeros(n, dtype=bool)
        structural = np.zeros(n, dtype=bool)
        closing = np.zeros(n, dtype=bool)
        for t in range(n):
            if tok.ll.is_special_token(t):
                continue
            data = tok.ll.decode_bytes([t])
            if 0 < len(data) <= 3:
                short[t] = True
                structural[t] = any(c in data for c in b'"{}[],:0123456789')
                closing[t] = any(c in data for c in b'"}]')
        opening = np.zeros(n, dtype=bool)
        word = np.zeros(n, dtype=bool)
        for t in np.flatnonzero(short):
            data = tok.ll.decode_bytes([int(t)])
            opening[t] = any(c in data for c in b'{["')
            word[t] = data.strip().isalpha()
        self.short = np.flatnonzero(short)
        self.opening = np.flatnonzero(opening)
        self.words = np.flatnonzero(word)
        self.structural = np.flatnonzero(structural)
        self.closing = np.flatnonzero(closing)


def _allowed(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    words = row.view(np.uint32)
    ids = ids[(ids >> 5) < words.shape[0]]
    return ids[((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)]


def write(address: str, tok, table: TokenTable, jobs: list[tuple[str, dict, str]], *, seed: int = 0,
          follow: float = 0.85, max_tokens: int = 160, batch: int = 64, style: str = "guide") -> list[Outcome]:
    """Runs every (name, schema, guide text) job to EOS, a dead end or the token cap."""
    assert style in ("guide", "invent"), style
    eos = int(tok.eos_token_ids[0])
    outcomes: list[Outcome] = []
    pending = list(enumerate(jobs))
    with MaskClient(address, want_forced_tokens=False) as mc:
        active: dict[str, dict] = {}
        while pending or active:
            while pending and len(active) < batch:
                i, (name, schema, guide) = pending.pop(0)
                sid = f"w{seed}-{i}"
                mc.open(sid, {"json_schema": schema})
                # one generator per sequence: what it writes does not depend on how steps interleave
                rng = random.Random(seed * 1_000_003 + i)
                ids = tok.encode(guide)
                # "invent": the guide up to a random point (none, a third of the time), then its own
                leave = len(ids) + 1 if style == "guide" else 0 if rng.random() < 1 / 3 else rng.randrange(len(ids) + 1)
                active[sid] = {"name": name, "guide": ids, "out": [], "on_guide": True, "next": [], "rng": rng,
                               "leave": leave}
            r = mc.step({sid: s["next"] for sid, s in active.items()})
            for sid, s in list(active.items()):
                res = r.seqs[sid]
                s["out"] += s["next"]
                s["next"] = []
                if res.status is SeqStatus.WAITING:
                    continue
                done = None
                if res.status in (SeqStatus.FAILED, SeqStatus.ERROR):
                    done = Outcome(s["name"], "dead end", tok.decode(s["out"]), res.reason, not s["on_guide"])
                elif s["out"] and s["out"][-1] == eos:
                    done = Outcome(s["name"], "finished", tok.decode(s["out"][:-1]), "", not s["on_guide"])
                elif len(s["out"]) >= max_tokens:
                    done = Outcome(s["name"], "capped", tok.decode(s["out"]), "", not s["on_guide"])
                if done is not None:
                    outcomes.append(done)
                    mc.close(sid)
                    del active[sid]
                    continue
                row = r.bitmask[res.row]
                rng = s["rng"]
                pos = len(s["out"])
                if s["on_guide"] and pos < min(len(s["guide"]), s["leave"]) and rng.random() < follow \
                        and _allowed(row, np.array([s["guide"][pos]], dtype=np.int64)).size:
                    s["next"] = [s["guide"][pos]]
                    continue
                if s["on_guide"]:
                    s["on_guide"] = False
                    s["wander"] = rng.randint(1, 6) if style == "guide" else rng.randint(3, 24)
                if _allowed(row, np.array([eos], dtype=np.int64)).size:
                    s["next"] = [eos]
                    continue
                s["wander"] -= 1
                if s["wander"] < 0 and rng.random() < 0.7:   # done wandering: head for the way out
                    pool = _allowed(row, table.closing)
                elif style == "invent" and rng.random() < 0.6:   # keys and values of its own
                    pool = _allowed(row, table.opening if rng.random() < 0.4 else table.words)
                else:
                    pool = _allowed(row, table.structural if rng.random() < 0.5 else table.short)
                if pool.size == 0:
                    pool = _allowed(row, np.arange(row.shape[0] * 32, dtype=np.int64))
                if pool.size == 0:
                    outcomes.append(Outcome(s["name"], "dead end", tok.decode(s["out"]), "an empty row", True))
                    mc.close(sid)
                    del active[sid]
                    continue
                s["next"] = [int(pool[rng.randrange(pool.size)])]
    return outcomes
