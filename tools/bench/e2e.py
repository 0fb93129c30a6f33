"""``maskd bench e2e``: tokens/s of a simulated engine's decode loop, with and without structure.

One loop, four ways to get the masks. B slots replay MaskBench valid instances (the same
instances in the same order in every mode); a slot whose instance ends (EOS sampled) is refilled
with the next one, so the batch stays full. Every decode step of every mode does:

- the **forward pass**: ``time.sleep(forward_ms)``, which releases the GIL as a GPU kernel
  launch and wait would;
- **sampling**: each slot's next token is its instance's next token (EOS at the end); in the
  structured modes it is checked against the slot's mask row first (a violation is counted, and
  must stay 0), after the rows were materialized into a preallocated int32 tensor as a GPU worker
  does before its host-to-device copy;
- **host work** that holds the GIL, equal in every mode: incremental detokenization of each
  slot's output (``LLTokenizer.decode_bytes`` over a window of its last tokens, then UTF-8 decode
  and a stop-string check) and scheduling (the slots ordered by arrival, the next step's input ids
  and positions built as arrays).

The modes differ only in where the masks come from:

``unstructured``
    no masks: the ceiling.
``inprocess-critical``
    llguidance in the worker's process, in the critical path: consume the sampled tokens (one
    ``LLMatcher`` per sequence), then fill the batch's masks (``LLExecutor``, the worker's cores),
    then the forward pass.
``inprocess-overlapped``
    the same, but the fill runs in a thread during the forward pass and is joined before sampling
    (what vLLM does since PR #26866); the consume stays in the critical path.
``maskd``
    the sampled tokens go out with ``step_async`` right after sampling; the reply is taken after
    the next forward pass (its wait is measured: zero when the reply was already there).
``maskd-drafts``
    grammar drafts (speculative decoding): the sampled tokens go out asking the server for up to
    ``--drafts`` K draft tokens per slot; the reply (in the critical path: the drafts are the next
    forward pass's input) has them with a row for every draft position. The forward pass verifies
    them: a slot keeps the drafts its instance's next tokens agree with, plus one token of its own
    (the bonus, or the correction), each checked against its position's row. **Cost model of the
    verification pass** (an estimate for a GPU, not a measurement): a forward pass over B + D tokens
    (D drafts in the batch) costs ``forward_ms * max(1, (B + D) / max(B, S))``, S =
    ``--saturation-tokens`` (256): decoding is memory bound, so a pass costs about one decode step
    until the batch reaches S tokens, then grows with them. The instance's tokens stand in for a
    model that writes the tokenizer's own tokenization; a real model's acceptance is measured in
    a real engine (``maskd bench vllm``, tests/vllm_engine/test_real_model.py).
``maskd-opportunistic``
    opportunistic masking (DOMINO §3.5): the loop samples first, from unmasked logits, and sends
    the token for the server to check (``StepInput(sampled_unmasked=True)``) while the next forward
    pass runs on it; the verdict is taken after that pass. Allowed: no row was filled or sent.
    Refused: the reply has the row, the slot samples again with it and the pass that ran on the
    refused token is lost for that slot (its new token goes in with the next pass). The model's
    unmasked token is its instance's next token, or with probability ``--off-grammar`` (0.05) a
    token no JSON grammar allows anywhere (a raw control byte): the share of steps that needed a
    row is reported. Every step of this mode goes as SeqStep entries (the columnar form has no
    place for the flag yet).

With ``--pin S+W`` (default 1+1) the maskd server runs as a child process on S cores of its own
and this process (the worker: its loop, the client, and the in-process modes' llguidance) on the
next W; the in-process modes fill with W threads, the server with S.
"""
from __future__ import annotations

import dataclasses
import gc
import threading
import time

import numpy as np

from maskd_tools.bench import common
from maskd_tools.progress import bar

QUICK_LIMIT = 48
MODES = ("unstructured", "inprocess-critical", "inprocess-overlapped", "maskd", "maskd-drafts", "maskd-opportunistic")
STRUCTURED = MODES[1:]
DETOKENIZE_WINDOW = 6          # tokens decoded per slot and step (incremental detokenization)
STOP_STRING = "<|stop|>"       # a stop string that never occurs: the check runs, never ends a slot


@dataclasses.dataclass
class _DecodeSlot:
    """A batch position of the simulated decode loop: its instance, how far it is sampled, its output."""
    sid: str
    inst: common.Instance
    arrival: int
    pos: int = 0                                   # tokens of the instance sampled so far
    output: list[int] = dataclasses.field(default_factory=list)
    text: str = ""


class _Replay:
    """B slots over the instance pool, the same sequence of instances in every mode."""

    def __init__(self, pool: list[common.Instance], batch: int, eos: int, tag: str, start: int = 0) -> None:
        self.pool, self.eos, self.tag = pool, eos, tag
        self.cursor = start
        self.slots = [self._fresh() for _ in range(batch)]

    def _fresh(self) -> _DecodeSlot:
        inst = self.pool[self.cursor % len(self.pool)]
        self.cursor += 1
        return _DecodeSlot(f"{self.tag}-{self.cursor}", inst, self.cursor)

    def next_token(self, s: _DecodeSlot) -> int:
        return s.inst.tokens[s.pos] if s.pos < len(s.inst.tokens) else self.eos

    def refill(self, i: int) -> _DecodeSlot:
        self.slots[i] = self._fresh()
        return self.slots[i]


class _HostWork:
    """Detokenization and scheduling as a serving engine's host loop does them (real Python)."""

    def __init__(self, tok) -> None:
        self.decode = tok.ll.decode_bytes

    def __call__(self, slots: list[_DecodeSlot], sampled: list[int | None]) -> None:
        for s, t in zip(slots, sampled):
            if t is None:
                continue
            s.output.append(t)
            piece = self.decode(s.output[-DETOKENIZE_WINDOW:]).decode("utf-8", errors="replace")
            s.text = (s.text + piece)[-64:]
            if STOP_STRING in s.text:     # pragma: no cover - never in MaskBench
                s.pos = len(s.inst.tokens)
        order = sorted(range(len(slots)), key=lambda i: slots[i].arrival)
        np.fromiter((slots[i].output[-1] if slots[i].output else 0 for i in order), np.int64, len(order))
        np.fromiter((len(slots[i].output) for i in order), np.int64, len(order))


@dataclasses.dataclass
class _LoopStats:
    """What one mode's decode loop counted and timed (tokens, mask checks, waits, host work)."""
    tokens: int = 0
    masks_checked: int = 0
    violations: int = 0
    completed: int = 0
    waiting: int = 0
    failed: int = 0
    waited_steps: int = 0
    periods: list = dataclasses.field(default_factory=list)
    mask_wait: list = dataclasses.field(default_factory=list)
    critical: list = dataclasses.field(default_factory=list)   # mask work in the critical path, s
    drafts: int = 0                                              # maskd-drafts: drafts verified
    slot_steps: int = 0                                          # maskd-drafts: (slot, step)s with rows
    repeated: int = 0          # maskd-drafts: instances its server had seen before (the pool came round)
    checked: int = 0           # maskd-opportunistic: tokens the server checked
    resampled: int = 0         # maskd-opportunistic: of them, refused (a row came back to sample again with)
    off_grammar_allowed: int = 0   # maskd-opportunistic: off-grammar tokens the server let through (must be 0)
    host: list = dataclasses.field(default_factory=list)

    def pipelined_step(self, done: bool, t0: float, t1: float, t2: float, t3: float, t: float,
                       t_prev: float) -> None:
        """A step whose reply was taken after the forward pass (t0 -> t1; ``done``: it was there
        already) and whose next step went out at t2 -> t3, then host work to t."""
        self.mask_wait.append(0.0 if done else t1 - t0)
        self.waited_steps += 0 if done else 1
        self.critical.append((t1 - t0) + (t3 - t2))
        self.host.append(t - t3)
        self.periods.append(t - t_prev)


def _sample(replay: _Replay, rows: np.ndarray | None, row_of: list[int] | None, tally: _LoopStats,
            measured: bool) -> tuple[list[int | None], list[tuple[int, int]], list[int]]:
    """Each slot's next token, checked against its row when there are rows. Returns (sampled per
    slot, [(slot, token)] to consume next step, slots refilled)."""
    sampled: list[int | None] = []
    consumed, refilled = [], []
    slots = replay.slots
    tokens = [replay.next_token(s) for s in slots]
    if rows is not None:
        idx = [k for k, r in enumerate(row_of) if r >= 0]
        ok = common.allowed(rows, np.asarray([row_of[k] for k in idx]), np.asarray([tokens[k] for k in idx]))
        good = dict(zip(idx, ok.tolist()))
        if measured:
            tally.masks_checked += len(idx)
            tally.violations += len(idx) - int(ok.sum())
    for i, s in enumerate(slots):
        if rows is not None and row_of[i] < 0:      # no row this step (maskd: WAITING)
            sampled.append(None)
            continue
        t = tokens[i]
        sampled.append(t)
        if measured:
            tally.tokens += 1
        if rows is not None and not good[i]:
            refilled.append(i)                       # counted as a violation; the slot starts over
            continue
        if s.pos >= len(s.inst.tokens):              # EOS sampled: the request ends
            if measured:
                tally.completed += 1
            refilled.append(i)
            continue
        s.pos += 1
        consumed.append((i, t))
    return sampled, consumed, refilled


def _loop_unstructured(ctx, batch: int, forward_s: float, steps: int, warmup: int) -> _LoopStats:
    replay = _Replay(ctx.pool, batch, ctx.eos, "u")
    tally = _LoopStats()
    t_prev = time.perf_counter()
    for k in bar(range(warmup + steps), desc=f"unstructured B={batch}", unit="step"):
        measured = k >= warmup
        time.sleep(forward_s)
        sampled, _, refilled = _sample(replay, None, None, tally, measured)
        th = time.perf_counter()
        ctx.host(replay.slots, sampled)
        for i in refilled:
            replay.refill(i)
        t = time.perf_counter()
        if measured:
            tally.host.append(t - th)
            tally.periods.append(t - t_prev)
        t_prev = t
    return tally


def _loop_inprocess(ctx, batch: int, forward_s: float, steps: int, warmup: int, overlapped: bool) -> _LoopStats:
    replay = _Replay(ctx.pool, batch, ctx.eos, "o" if overlapped else "c")
    engine = common.InProcessEngine(ctx.tok, ctx.worker_threads, batch)
    for s in ctx.pool:
        engine.template(s.schema)            # compiled ahead, like grammars registered with a server
    for i, s in enumerate(replay.slots):
        engine.open(i, s.inst.schema)
    tally = _LoopStats()
    consumed: list[tuple[int, int]] = []
    row_of = list(range(batch))
    t_prev = time.perf_counter()
    for k in bar(range(warmup + steps), desc=f"{'overlapped' if overlapped else 'critical'} B={batch}",
                 unit="step"):
        measured = k >= warmup
        t0 = time.perf_counter()
        engine.consume(consumed)
        if overlapped:
            filler = threading.Thread(target=engine.fill)
            filler.start()
            t1 = time.perf_counter()
            time.sleep(forward_s)
            tw = time.perf_counter()
            filler.join()
            t2 = time.perf_counter()
            critical = (t1 - t0) + (t2 - tw)
        else:
            engine.fill()
            critical = time.perf_counter() - t0
            time.sleep(forward_s)
        rows = ctx.materialize(engine.bm)
        sampled, consumed, refilled = _sample(replay, rows, row_of, tally, measured)
        th = time.perf_counter()
        ctx.host(replay.slots, sampled)
        t3 = time.perf_counter()
        for i in refilled:
            engine.open(i, replay.refill(i).inst.schema)
        t = time.perf_counter()
        if measured:
            tally.critical.append(critical)
            tally.host.append(t3 - th)
            tally.periods.append(t - t_prev)
        t_prev = t
    return tally


def _send_then_host(ctx, mc, request, replay: _Replay, sampled: list, tally: _LoopStats | None, done: bool,
                    t0: float, t1: float, t_prev: float):
    """The next step goes out (before the host work, as a worker sends it right after sampling);
    the step's times are tallied when ``tally`` is given. Returns (its future, the step's end)."""
    t2 = time.perf_counter()
    fut = mc.step_async(request)
    t3 = time.perf_counter()
    ctx.host(replay.slots, sampled)
    t = time.perf_counter()
    if tally is not None:
        tally.pipelined_step(done, t0, t1, t2, t3, t, t_prev)
    return fut, t


def _loop_maskd(ctx, batch: int, forward_s: float, steps: int, warmup: int) -> _LoopStats:
    from maskd_client import MaskClient, SeqStatus

    replay = _Replay(ctx.pool, batch, ctx.eos, f"m{batch}-{int(forward_s * 1e3)}")
    tally = _LoopStats()
    with MaskClient(ctx.address, want_forced_tokens=False, timeout_s=600) as mc:
        for s in replay.slots:
            mc.open(s.sid, s.inst.spec_pb)
        fut = mc.step_async({s.sid: [] for s in replay.slots})
        t_prev = time.perf_counter()
        for k in bar(range(warmup + steps), desc=f"maskd B={batch}", unit="step"):
            measured = k >= warmup
            time.sleep(forward_s)
            done = fut.done()
            t0 = time.perf_counter()
            res = fut.result()
            t1 = time.perf_counter()
            rows = ctx.materialize(res.bitmask)
            status = res.status
            ready = (status == SeqStatus.READY) | (status == SeqStatus.FINISHED)
            row_of = np.where(ready, res.row, -1).tolist()
            if measured:
                tally.waiting += int((status == SeqStatus.WAITING).sum())
                tally.failed += int((~ready & (status != SeqStatus.WAITING)).sum())
            sampled, consumed, refilled = _sample(replay, rows, row_of, tally, measured)
            failed = [i for i, (r, st) in enumerate(zip(row_of, status.tolist()))
                      if r < 0 and st != SeqStatus.WAITING]
            for i in refilled + failed:
                mc.close(replay.slots[i].sid)
                new = replay.refill(i)
                mc.open(new.sid, new.inst.spec_pb)
            send = dict(consumed)
            # in slot order: the reply's arrays follow the request's order
            request = {s.sid: ([send[i]] if i in send else []) for i, s in enumerate(replay.slots)}
            fut, t_prev = _send_then_host(ctx, mc, request, replay, sampled, tally if measured else None,
                                          done, t0, t1, t_prev)
        fut.result()
    return tally


def _loop_maskd_drafts(ctx, batch: int, forward_s: float, steps: int, warmup: int) -> _LoopStats:
    from maskd_client import MaskClient, SeqStatus, StepInput

    # Its own server, and instances that server has not seen while the pool lasts (a run goes on
    # where the one before stopped): learned drafts come only from other documents of the grammar.
    replay = _Replay(ctx.pool, batch, ctx.eos, f"d{batch}-{int(forward_s * 1e3)}", start=ctx.drafts_cursor)
    tally = _LoopStats()
    k, saturation = ctx.drafts, ctx.saturation_tokens
    materialize = common.Materializer(batch * (1 + k), (ctx.tok.logits_width + 31) // 32)
    with MaskClient(ctx.drafts_address, want_forced_tokens=False, timeout_s=600) as mc:
        for s in replay.slots:
            mc.open(s.sid, s.inst.spec_pb)
        send: dict[str, list[int]] = {s.sid: [] for s in replay.slots}
        t_prev = time.perf_counter()
        for step in bar(range(warmup + steps), desc=f"maskd-drafts B={batch}", unit="step"):
            measured = step >= warmup
            t0 = time.perf_counter()
            res = mc.step({s.sid: StepInput(send[s.sid], propose=k) for s in replay.slots})
            t1 = time.perf_counter()
            rows = materialize(res.bitmask)
            seqs = res.seqs
            plans: list[tuple[int, list[int]] | None] = []
            for s in replay.slots:
                r = seqs[s.sid]
                if r.has_rows:
                    plans.append((r.row, list(r.proposed_drafts)))
                else:
                    plans.append(None)
                    if measured:
                        tally.waiting += r.status is SeqStatus.WAITING
                        tally.failed += r.status is not SeqStatus.WAITING
            drafted = sum(len(p[1]) for p in plans if p is not None)
            time.sleep(forward_s * max(1.0, (batch + drafted) / max(batch, saturation)))   # the verification pass
            # Each slot's tokens: the drafts its instance agrees with, then one of its own.
            took: list[list[int]] = []
            check_rows, check_tokens = [], []
            for s, plan in zip(replay.slots, plans):
                mine: list[int] = []
                if plan is not None:
                    row, drafts = plan
                    at = s.pos
                    for j in range(len(drafts) + 1):
                        t = s.inst.tokens[at + j] if at + j < len(s.inst.tokens) else replay.eos
                        mine.append(t)
                        check_rows.append(row + j)
                        check_tokens.append(t)
                        if t == replay.eos or j == len(drafts) or drafts[j] != t:
                            break
                took.append(mine)
            ok = common.allowed(rows, np.asarray(check_rows), np.asarray(check_tokens)).tolist()
            at = 0
            sampled: list[int | None] = []
            refilled = []
            send = {}
            for i, (s, mine) in enumerate(zip(replay.slots, took)):
                if not mine:
                    sampled.append(None)
                    send[s.sid] = []
                    continue
                good = all(ok[at:at + len(mine)])
                at += len(mine)
                if measured:
                    tally.masks_checked += len(mine)
                    tally.violations += 0 if good else 1
                    tally.tokens += len(mine)
                sampled.append(mine[-1])
                s.output.extend(mine[:-1])
                if not good or mine[-1] == replay.eos:     # a violation starts the slot over; EOS ends it
                    if measured and good:
                        tally.completed += 1
                    refilled.append(i)
                    continue
                s.pos += len(mine)
                send[s.sid] = mine
            for i in refilled:
                mc.close(replay.slots[i].sid)
                new = replay.refill(i)
                mc.open(new.sid, new.inst.spec_pb)
                send[new.sid] = []
            ctx.host(replay.slots, sampled)
            t = time.perf_counter()
            if measured:
                tally.critical.append(t1 - t0)
                tally.mask_wait.append(t1 - t0)
                tally.periods.append(t - t_prev)
                tally.drafts += drafted
                tally.slot_steps += sum(1 for mine in took if mine)
            t_prev = t
    ctx.drafts_cursor = replay.cursor
    tally.repeated = max(0, replay.cursor - len(ctx.pool))
    return tally


def _loop_maskd_opportunistic(ctx, batch: int, forward_s: float, steps: int, warmup: int) -> _LoopStats:
    from maskd_client import MaskClient, SeqStatus, StepInput

    replay = _Replay(ctx.pool, batch, ctx.eos, f"p{batch}-{int(forward_s * 1e3)}")
    rng = np.random.default_rng(batch)
    tally = _LoopStats()
    nothing = StepInput((), sampled_unmasked=True)      # an open, or a slot with nothing to check

    def sample_unmasked(s: _DecodeSlot) -> tuple[int, bool]:
        """The model's token from unmasked logits: (token, whether it is off the grammar)."""
        if rng.random() < ctx.off_grammar:
            return ctx.off_grammar_token, True
        return replay.next_token(s), False

    with MaskClient(ctx.address, want_forced_tokens=False, timeout_s=600) as mc:
        for s in replay.slots:
            mc.open(s.sid, s.inst.spec_pb)
        sent: list[tuple[int, bool] | None] = [None] * batch      # the token each slot has out for checking
        fut = mc.step_async({s.sid: nothing for s in replay.slots})
        t_prev = time.perf_counter()
        for k in bar(range(warmup + steps), desc=f"maskd-opportunistic B={batch}", unit="step"):
            measured = k >= warmup
            time.sleep(forward_s)            # the pass runs on the tokens out for checking
            done = fut.done()
            t0 = time.perf_counter()
            res = fut.result()
            t1 = time.perf_counter()
            rows = ctx.materialize(res.bitmask) if len(res.bitmask) else None
            seqs = res.seqs
            request: dict[str, StepInput] = {}
            sampled: list[int | None] = []
            for i, s in enumerate(replay.slots):
                r, out = seqs[s.sid], sent[i]
                sent[i] = None
                if not r.has_rows:            # WAITING (nothing sampled yet) or failed (starts over)
                    sampled.append(None)
                    if r.status is not SeqStatus.WAITING:
                        if measured:
                            tally.failed += 1
                        mc.close(s.sid)
                        s = replay.refill(i)
                        mc.open(s.sid, s.inst.spec_pb)
                    request[s.sid] = nothing
                    continue
                if out is not None and measured:
                    tally.checked += 1
                if r.resample:                # the pass ran on a refused token: sample again with the row
                    t = replay.next_token(s)
                    ok = rows is not None and bool(common.allowed(rows, np.asarray([r.row]), np.asarray([t]))[0])
                    if measured:
                        tally.resampled += 1
                        tally.masks_checked += 1
                        tally.violations += not ok
                    sent[i] = (t, False)
                    request[s.sid] = StepInput([t], sampled_unmasked=True)
                    sampled.append(None)
                    continue
                new = None
                if out is not None:           # the token stands: it is output, the pass's logits are good
                    t, off = out
                    new = t
                    if measured:
                        tally.tokens += 1
                    if off:                   # the server let a token through that no JSON grammar allows
                        if measured:
                            tally.off_grammar_allowed += 1
                        t = ctx.eos
                    elif t != ctx.eos:
                        s.pos += 1
                    if t == ctx.eos:          # the request ends (EOS was checked like any token)
                        if measured and not off:
                            tally.completed += 1
                        sampled.append(new)
                        mc.close(s.sid)
                        s = replay.refill(i)
                        mc.open(s.sid, s.inst.spec_pb)
                        request[s.sid] = nothing
                        continue
                sampled.append(new)
                sent[i] = sample_unmasked(s)
                request[s.sid] = StepInput([sent[i][0]], sampled_unmasked=True)
            fut, t_prev = _send_then_host(ctx, mc, request, replay, sampled, tally if measured else None,
                                          done, t0, t1, t_prev)
        fut.result()
    return tally


@dataclasses.dataclass
class _Context:
    tok: object
    pool: list[common.Instance]
    eos: int
    address: str
    worker_threads: int
    host: _HostWork
    materialize: common.Materializer
    drafts: int = 4
    saturation_tokens: int = 256
    drafts_address: str = ""      # the maskd-drafts mode's own server
    drafts_cursor: int = 0
    off_grammar: float = 0.05     # maskd-opportunistic: share of unmasked samples off the grammar
    off_grammar_token: int = 0    # a token no JSON grammar allows anywhere (a raw control byte)


def _summary(mode: str, tally: _LoopStats) -> dict:
    seconds = float(np.sum(tally.periods))
    out = {
        "mode": mode,
        "steps": len(tally.periods),
        "tokens": tally.tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tally.tokens / seconds, 1) if seconds else None,
        "step_period_ms": common.summarize(tally.periods),
        "host_work_ms": common.summarize(tally.host),
        "instances_completed": tally.completed,
    }
    if mode in STRUCTURED:
        out.update({"masks_checked": tally.masks_checked, "token_violations": tally.violations,
                    "critical_path_mask_ms": common.summarize(tally.critical)})
    if mode == "maskd":
        out.update({"mask_wait_ms": common.summarize(tally.mask_wait), "waited_steps": tally.waited_steps,
                    "waiting_rows": tally.waiting, "failed_rows": tally.failed})
    if mode == "maskd-drafts":
        out.update({"round_trip_ms": common.summarize(tally.mask_wait), "drafts": tally.drafts,
                    "tokens_per_slot_step": round(tally.tokens / max(1, tally.slot_steps), 3),
                    "instances_seen_before": tally.repeated,
                    "waiting_rows": tally.waiting, "failed_rows": tally.failed})
    if mode == "maskd-opportunistic":
        out.update({"mask_wait_ms": common.summarize(tally.mask_wait), "waited_steps": tally.waited_steps,
                    "tokens_checked": tally.checked, "resampled": tally.resampled,
                    "share_needing_a_row": round(tally.resampled / tally.checked, 4) if tally.checked else None,
                    "off_grammar_allowed": tally.off_grammar_allowed,
                    "waiting_rows": tally.waiting, "failed_rows": tally.failed})
    return out


def run(args, log=print) -> dict:
    from maskd.server.tokenizers import load_tokenizer

    limit = args.limit if args.limit is not None else (QUICK_LIMIT if args.quick else None)
    steps = args.steps if args.steps is not None else (40 if args.quick else 150)
    warmup = args.warmup if args.warmup is not None else (5 if args.quick else 10)
    batches = common.positive_list(args.batch_sizes or "64,256", int, "--batch-sizes", "maskd bench e2e")
    forwards = common.positive_list(args.forward_ms or ("20" if args.quick else "10,20,40"), float, "--forward-ms",
                                    "maskd bench e2e")
    modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"maskd bench e2e: unknown mode(s) {unknown}; choose from {list(MODES)}")
    off_grammar = getattr(args, "off_grammar", 0.05)
    if not 0.0 <= off_grammar < 1.0:
        raise SystemExit(f"maskd bench e2e: --off-grammar is a share of samples, 0 <= p < 1, not {off_grammar}")
    out = common.Output(args.out, "e2e", args.json_out)
    t_start = time.perf_counter()

    tok = load_tokenizer(args.tokenizer)
    schemas = [s for s in common.load_schemas(args.data, tok, limit) if s.instances]
    placement = common.placement_from(args)
    server_threads = len(placement.server_cpus) if placement else args.threads
    worker_threads = len(placement.worker_cpus) if placement else args.threads
    srv = common.open_server(getattr(args, "server", "subprocess"), args.tokenizer, server_threads,
                             getattr(args, "target", None), log_path=common.pathlib.Path(args.out) / "server.log",
                             cpus=placement.server_cpus if placement else None)
    results: list[dict] = []
    drafts_srv = None
    try:
        from maskd_client import MaskClient
        with MaskClient(srv.address, timeout_s=600) as mc:
            info = mc.info()
            errors = common.register_all(mc, schemas)
        pool = common.instance_pool(schemas, errors, args.seed, "e2e")
        ctx = _Context(tok, pool, tok.eos_token_ids[0], srv.address, worker_threads, _HostWork(tok),
                       common.Materializer(max(batches), (tok.logits_width + 31) // 32),
                       getattr(args, "drafts", 4), getattr(args, "saturation_tokens", 256),
                       off_grammar=off_grammar, off_grammar_token=_off_grammar_token(tok))
        log(f"e2e: {len(pool)} instances of {len(schemas) - len(errors)} schemas, server {srv.kind} at "
            f"{srv.address} ({server_threads} fill threads), in-process modes {worker_threads} threads; "
            + (placement.describe() if placement else "not pinned")
            + f"; {steps} steps per run after {warmup}")
        if "maskd-drafts" in modes:     # its own server: what it learns comes only from its own sequences
            drafts_srv = common.open_server(getattr(args, "server", "subprocess"), args.tokenizer, server_threads,
                                            None, log_path=common.pathlib.Path(args.out) / "server-drafts.log",
                                            cpus=placement.server_cpus if placement else None)
            with MaskClient(drafts_srv.address, timeout_s=600) as mc:
                common.register_all(mc, [s for s in schemas if s.name not in errors])
            ctx.drafts_address = drafts_srv.address
        with common.pinned_here(placement.worker_cpus if placement else None):
            for batch in batches:
                for fwd in forwards:
                    runs = {}
                    for mode in modes:
                        gc.collect()
                        fs = fwd / 1e3
                        own = drafts_srv if mode == "maskd-drafts" else srv
                        cpu_before = _cpu_seconds(own) if mode.startswith("maskd") else None
                        if mode == "unstructured":
                            tally = _loop_unstructured(ctx, batch, fs, steps, warmup)
                        elif mode == "maskd":
                            tally = _loop_maskd(ctx, batch, fs, steps, warmup)
                        elif mode == "maskd-drafts":
                            tally = _loop_maskd_drafts(ctx, batch, fs, steps, warmup)
                        elif mode == "maskd-opportunistic":
                            tally = _loop_maskd_opportunistic(ctx, batch, fs, steps, warmup)
                        else:
                            tally = _loop_inprocess(ctx, batch, fs, steps, warmup,
                                                    overlapped=mode == "inprocess-overlapped")
                        runs[mode] = _summary(mode, tally)
                        if cpu_before is not None:     # the server's own process: its CPU per step
                            cpu = _cpu_seconds(own) - cpu_before
                            runs[mode]["server_cpu_ms_per_step"] = round(cpu * 1e3 / (steps + warmup), 3)
                    base = runs.get("unstructured", {}).get("tokens_per_s")
                    for r in runs.values():
                        r["ratio_to_unstructured"] = round(r["tokens_per_s"] / base, 4) if base else None
                    results.append({"batch": batch, "forward_ms": fwd, "runs": runs})
                    log(f"  B={batch:>4} forward {fwd:g} ms: " + ", ".join(
                        f"{m} {r['tokens_per_s']:,.0f} tok/s (x{r['ratio_to_unstructured']})" for m, r in runs.items()))
    finally:
        srv.close()
        if drafts_srv is not None:
            drafts_srv.close()

    violations = sum(r.get("token_violations", 0) for x in results for r in x["runs"].values())
    report = {
        "mode": "e2e",
        "args": common.args_dict(args, limit=limit, steps=steps, warmup=warmup),
        "machine": common.machine_info(),
        "data": str(args.data),
        "tokenizer": tok.spec,
        "vocab_size": tok.vocab_size,
        "server": {"kind": srv.kind, "threads": server_threads, "backend": info.backend,
                   "backend_version": info.backend_version},
        "worker_threads": worker_threads,
        "placement": placement.as_dict() if placement else None,
        "host_work": f"detokenize a window of {DETOKENIZE_WINDOW} tokens per slot + stop check + arrival-order "
                     "scheduling, every mode",
        "materialize": ctx.materialize.kind,
        "schemas": len(schemas),
        "schemas_not_compiling": len(errors),
        "instances": len(pool),
        "results": results,
        "violations": violations,
        "failed": bool(violations),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    report["targets"] = _targets(report)
    _plot(out, report)
    out.write(report, _markdown(report))
    return report


def _cpu_seconds(server) -> float | None:
    """CPU seconds (user + system) of a server in a process of its own, its threads and children
    (compile workers) included; None for a server in this process or elsewhere."""
    import psutil

    if server is None or server.kind != "subprocess" or server.pid is None:
        return None
    proc = psutil.Process(server.pid)
    total = proc.cpu_times()
    return total.user + total.system + total.children_user + total.children_system


def _off_grammar_token(tok) -> int:
    """A token that is one raw control byte (U+0001): JSON allows it nowhere, not even in a string."""
    ids = tok.encode("\x01")
    if len(ids) != 1:
        raise SystemExit(f"maskd bench e2e: the tokenizer has no single token for a raw control byte ({ids})")
    return int(ids[0])


def _targets(r: dict) -> dict:
    for x in r["results"]:
        if x["batch"] == 256 and abs(x["forward_ms"] - 20.0) < 1e-9 and "maskd" in x["runs"]:
            ratio = x["runs"]["maskd"]["ratio_to_unstructured"]
            return {"b256_f20_maskd_at_least_097_of_unstructured": {
                "ratio": ratio, "met": ratio is not None and ratio >= 0.97, "pinned": r["placement"] is not None}}
    return {}


def _plot(out: common.Output, r: dict) -> None:
    plt = common.pyplot()
    batches = sorted({x["batch"] for x in r["results"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), dpi=110, squeeze=False)
    for ax, b in zip(axes[0], batches):
        rows = [x for x in r["results"] if x["batch"] == b]
        fwd = [x["forward_ms"] for x in rows]
        modes = [m for m in MODES if m in rows[0]["runs"]]
        w = 0.8 / max(1, len(modes))
        xs = np.arange(len(fwd))
        for j, m in enumerate(modes):
            vals = [x["runs"][m]["ratio_to_unstructured"] or 0 for x in rows]
            ax.bar(xs + (j - (len(modes) - 1) / 2) * w, vals, w, label=m)
        ax.axhline(0.97, color="k", lw=0.8, ls="--")
        ax.set_xticks(xs, [f"{f:g} ms" for f in fwd])
        ax.set_xlabel("forward pass")
        ax.set_ylabel("tokens/s relative to unstructured")
        ax.set_ylim(0, 1.08)
        ax.set_title(f"batch {b}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out.path("e2e.png"))
    plt.close(fig)


def _markdown(r: dict) -> str:
    pl = r["placement"]
    lines = ["# maskd bench e2e\n",
             f"{r['instances']} valid instances of {r['schemas'] - r['schemas_not_compiling']} MaskBench schemas "
             f"from `{r['data']}`, tokenizer `{r['tokenizer']}` ({r['vocab_size']:,} tokens); "
             f"{r['args']['steps']} measured steps per run after {r['args']['warmup']}; host work: {r['host_work']}; "
             f"rows materialized with {r['materialize']}. Server {r['server']['kind']}, {r['server']['threads']} "
             f"fill threads; in-process modes {r['worker_threads']} threads; "
             + (f"pinned: server on CPUs {pl['server_cpus']}, worker on CPUs {pl['worker_cpus']}.\n" if pl
                else "not pinned.\n"),
             f"Machine: {common.machine_line(r['machine'])}.\n",
             "\n## Tokens/s and ratio to the unstructured run\n\n"]
    rows = []
    for x in r["results"]:
        runs = x["runs"]
        row = [x["batch"], x["forward_ms"]]
        for m in MODES:
            v = runs.get(m)
            row.append(f"{v['tokens_per_s']:,.0f} (x{v['ratio_to_unstructured']})" if v else "-")
        m = runs.get("maskd")
        row += [m["mask_wait_ms"]["p50"] if m else "-", m["mask_wait_ms"]["p100"] if m else "-",
                f"{m['waited_steps']}/{m['steps']}" if m else "-"]
        rows.append(row)
    lines.append(common.md_table(["batch", "forward ms", *MODES, "maskd wait p50 ms", "maskd wait max ms",
                                  "maskd steps that waited"], rows))
    lines.append("\n## Mask work in the critical path (ms per step, p50) and host work\n\n")
    rows = []
    for x in r["results"]:
        runs = x["runs"]
        rows.append([x["batch"], x["forward_ms"],
                     *[runs[m]["critical_path_mask_ms"].get("p50", "-") if m in runs else "-" for m in STRUCTURED],
                     runs[next(iter(runs))]["host_work_ms"].get("p50", "-")])
    lines.append(common.md_table(["batch", "forward ms", *STRUCTURED, "host work p50"], rows))
    drafted = [x for x in r["results"] if "maskd-drafts" in x["runs"]]
    if drafted:
        lines.append("\n## Grammar drafts (maskd-drafts)\n\nAn **estimate** for a GPU: the verification pass over "
                     "B + D tokens is charged `forward_ms * max(1, (B + D) / max(B, S))`, S = "
                     f"{r['args'].get('saturation_tokens', 256)} tokens; drafts asked per slot and step: "
                     f"{r['args'].get('drafts', 4)}; the server's round trip is in the critical path. The mode has a "
                     "server of its own and takes instances that server has not seen (until the pool comes "
                     "round: counted), so its learned drafts come from other documents of the same schemas.\n\n")
        rows = [[x["batch"], x["forward_ms"], x["runs"]["maskd-drafts"]["tokens_per_slot_step"],
                 x["runs"]["maskd-drafts"]["drafts"], x["runs"]["maskd-drafts"]["round_trip_ms"].get("p50", "-"),
                 x["runs"]["maskd-drafts"]["instances_seen_before"],
                 x["runs"]["maskd-drafts"]["ratio_to_unstructured"]] for x in drafted]
        lines.append(common.md_table(["batch", "forward ms", "tokens per slot and step", "drafts verified",
                                      "round trip p50 ms", "instances its server saw before",
                                      "tokens/s vs unstructured"], rows))
    sampled_first = [x for x in r["results"] if "maskd-opportunistic" in x["runs"]]
    if sampled_first:
        lines.append("\n## Opportunistic masking (maskd-opportunistic)\n\nSample first, the server checks the token "
                     "while the next pass runs on it; a refused token costs its slot that pass. Unmasked samples "
                     f"off the grammar: {r['args'].get('off_grammar', 0.05):.0%}.\n\n")
        rows = []
        for x in sampled_first:
            v = x["runs"]["maskd-opportunistic"]
            plain = x["runs"].get("maskd", {})
            rows.append([x["batch"], x["forward_ms"], v["tokens_checked"], v["resampled"], v["share_needing_a_row"],
                         v["off_grammar_allowed"], v["mask_wait_ms"].get("p50", "-"),
                         f"{v['waited_steps']}/{v['steps']}", v["ratio_to_unstructured"],
                         v.get("server_cpu_ms_per_step", "-"), plain.get("server_cpu_ms_per_step", "-")])
        lines.append(common.md_table(["batch", "forward ms", "tokens checked", "refused: a row sent",
                                      "share of steps needing a row", "off-grammar tokens let through",
                                      "wait p50 ms", "steps that waited", "tokens/s vs unstructured",
                                      "server CPU ms per step", "maskd's (rows every step)"], rows))
    checked = sum(v.get("masks_checked", 0) for x in r["results"] for v in x["runs"].values())
    lines.append(f"\nMasks checked: {checked:,}; violations: {r['violations']}.\n")
    lines += common.targets_markdown(r.get("targets"))
    return "\n".join(lines)
