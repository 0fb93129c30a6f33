"""The engine core: maskd's requests in vLLM's ``StructuredOutputManager``. Each request's grammar
(``VllmMaskdGrammar``, vLLM's StructuredOutputGrammar) is one maskd sequence; the batch's rows come
from one maskd step (``MaskdStructuredOutputs``), sent ahead as soon as vLLM accepts a step's tokens,
and are laid out in vLLM's bitmask beside the rows of vLLM's own backend."""
from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from maskd.specs import GrammarSpec
from maskd_client.engine_env import EngineConfigError, EngineSettings, deliver_answers, eos_row, register_compiled
from maskd_client.types import MaskClientError, SeqResult, SeqStatus, StepInput, StepResult, describe, reply_within
from maskd_client.vllm.common import REGISTERED_KEY, SPEC_KEY, KnownSpecs, _is_maskd, _wait_seconds, log, spec_of
from maskd_client.vllm.drafts import _grammar_drafts

STEP_DEADLINE_ENV = "MASKD_STEP_DEADLINE_S"   # how long a step's rows may be late before maskd's requests sit out
DEFAULT_STEP_DEADLINE_S = 0.05                 # 0: off (the engine's step waits for maskd as long as the client may)


class VllmMaskdGrammar:
    """One request's maskd sequence, as vLLM's StructuredOutputGrammar (registered as its subclass).

    Tokens vLLM accepts are kept until the next step sends them; the server's verdict on them
    comes with that step's rows. A sequence the server failed refuses every later token, which
    makes vLLM end the request with an error."""

    def __init__(self, owner: MaskdStructuredOutputs, seq_id: str, spec: GrammarSpec, grammar_id: str = "") -> None:
        self.owner = owner
        self.seq_id = seq_id
        self.spec = spec
        self.grammar_id = grammar_id      # the open names it ("": the open carries the spec)
        self.pending: list[int] = []
        self.sent: list[int] = []         # the tokens of its last step (sent again where its open was refused)
        self.prepared: tuple[list[int], np.ndarray, int] | None = None   # (drafts, rows, valid) for the next pass
        self.opened = False
        self.closed = False
        self.terminated = False
        self.failure: str | None = None
        self.retryable = False
        self.advanced = False             # it has accepted tokens (the grammar has left its first state)
        self.first_row: np.ndarray | None = None   # its row before any token (while not advanced)

    # StructuredOutputGrammar
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self.failure is not None or self.terminated:
            return False
        self.prepared = None
        if tokens:
            self.advanced, self.first_row = True, None
        eos = self.owner.eos_ids
        for k, t in enumerate(tokens):
            if t in eos:
                self.terminated = True
                self.pending.extend(tokens[:k])
                return True
        self.pending.extend(tokens)
        self.owner.accepted.append(self)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The prefix of these drafts the grammar accepts, as the server answered when they arrived;
        drafts the server has not seen are dropped (an unchecked draft never reaches verification).
        One token before the grammar has advanced (vLLM 0.33 asks it of every token that ends
        reasoning implicitly, ``_masked_reasoning_ends``) is answered by the grammar's first row."""
        prepared = self.prepared
        if self.failure is not None:
            return []
        if prepared is not None and list(tokens) == prepared[0]:
            return list(tokens[:prepared[2]])
        if len(tokens) == 1 and not self.advanced and self.first_row is not None:
            t = int(tokens[0])
            allowed = 0 <= t < 32 * len(self.first_row) and (int(self.first_row[t >> 5]) >> (t & 31)) & 1
            return [t] if allowed else []
        return []

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self.pending):
            raise RuntimeError(f"maskd sequence {self.seq_id}: cannot roll back {num_tokens} tokens the server "
                               "has seen already")
        del self.pending[len(self.pending) - num_tokens:]

    def fill_bitmask(self, bitmask: Any, batch_index: int) -> None:
        raise RuntimeError("maskd's rows are filled for the whole batch by StructuredOutputManager.grammar_bitmask")

    def is_terminated(self) -> bool:
        return self.terminated or self.failure is not None

    def reset(self) -> None:
        raise RuntimeError("a maskd sequence is not reset; its request gets a new one")

    # maskd
    def fail(self, reason: str, retryable: bool = False) -> None:
        """The sequence ends: it refuses every later token, so vLLM ends the request with finish
        reason error; where vLLM carries a RequestError (0.33) the client gets the reason
        (``_request_errors``), retryable where maskd could not answer (not a verdict on the output)."""
        if self.failure is None:
            self.failure = reason
            self.retryable = retryable
            log.error("maskd sequence %s failed: %s; vLLM ends its request with an error", self.seq_id, reason)
        self.close()

    def close(self) -> None:
        if self.opened and not self.closed:
            self.closed = True
            try:
                self.owner.client.close(self.seq_id)
            except MaskClientError as exc:
                log.debug("closing %s: %s", self.seq_id, exc)


class _Entry:
    """One request's part of a step: which positions its rows go to."""
    __slots__ = ("count", "drafts", "first", "grammar", "positions", "propose", "start")

    def __init__(self, grammar: VllmMaskdGrammar, start: int, count: int, positions: range, first: int,
                 drafts: list[int], propose: int = 0) -> None:
        self.grammar = grammar
        self.start = start          # its first row in the batch's bitmask
        self.count = count          # its rows: 1 + scheduled drafts
        self.positions = positions  # positions (0 = the first scheduled token) that take maskd's rows
        self.first = first          # the position of maskd's row 0 (where the grammar starts)
        self.drafts = drafts
        self.propose = propose      # drafts the server is asked to propose (then ``drafts`` are those)


class MaskdStructuredOutputs:
    """The engine core's side: one client on one session, compiles, and the batch's step."""

    def __init__(self, vllm_config: Any) -> None:
        self.settings = EngineSettings.from_env()
        instance = getattr(vllm_config, "instance_id", "") or "engine"
        dp = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)
        self.client = self.settings.client(f"vllm-{instance}-dp{dp}")
        info = self.client.info()
        self.words = int(info.words_per_row)
        vocab = int(vllm_config.model_config.get_vocab_size())
        if self.words != -(-vocab // 32):
            raise EngineConfigError(f"the maskd server at {self.settings.target} serves rows of {self.words} words "
                                    f"but the model's vocabulary has {vocab} ids")
        self.eos_ids = frozenset(int(t) for t in info.eos_token_ids)
        self.eos_row = eos_row(self.eos_ids, self.words)
        self.propose = _grammar_drafts(vllm_config)   # drafts asked of the server per request and step (0: none)
        if self.propose > int(info.max_draft_tokens):
            raise EngineConfigError(f"num_speculative_tokens {self.propose} is more than the maskd server at "
                                    f"{self.settings.target} proposes ({info.max_draft_tokens}, --max-draft-tokens)")
        self.compiles = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="maskd-compile")
        self.known = KnownSpecs()     # compiled: a request's grammar is ready at once, no round trip
        self.steps = 0
        self.polls = 0
        # Steps sent ahead: the tokens of a decode step go to the server as soon as vLLM accepts them,
        # and the rows they get wait for the next grammar_bitmask. Not with speculative decoding: its
        # drafts come after the tokens and go in one step with them (check_drafts).
        self.step_ahead_on = getattr(vllm_config, "speculative_config", None) is None
        self.accepted: list[VllmMaskdGrammar] = []     # grammars that accepted tokens since the last step ahead
        self.failed: dict[str, VllmMaskdGrammar] = {}  # failed requests vLLM freed in this update (their reasons)
        # (the step's reply, its grammars, when it was sent)
        self.ahead: tuple[concurrent.futures.Future, list[VllmMaskdGrammar], float] | None = None
        # How late (from its send) the step sent ahead may answer: grammar_bitmask waits for it that
        # long, beside the forward pass; past it, the maskd requests of that step are taken out of it
        # (``dropped``: preempted, their token dropped) and maskd's requests sit out the steps that
        # follow (``_schedule``) until the answer comes, while the others decode. The schedule itself
        # never waits. None (0): off, the rows are waited for as long as the client may take.
        self.deadline_s = _wait_seconds(STEP_DEADLINE_ENV, DEFAULT_STEP_DEADLINE_S) or None
        self.holding_since: float | None = None      # when a late answer first held maskd's requests
        self.holds = 0                               # schedules that held maskd's requests out
        self.dropped: dict[str, VllmMaskdGrammar] = {}   # request id -> grammar: this step's late rows
        self.preempted = 0                           # requests taken out of a step they were scheduled in

    # -- compiles -------------------------------------------------------------------------------
    def grammar(self, request: Any) -> concurrent.futures.Future:
        """A future of the request's VllmMaskdGrammar, done when the server has compiled its grammar."""
        marks = request.sampling_params.extra_args or {}
        admitted = marks.get(SPEC_KEY)     # admission's spec: nothing of the request is parsed again
        spec = GrammarSpec.from_plain(admitted) if admitted is not None else spec_of(request.sampling_params)
        assert spec is not None
        # the spec stays here (the grammar holds it); the scheduler sends the request's params on to
        # the worker, which needs none of it
        marks.pop(SPEC_KEY, None)
        registered = marks.get(REGISTERED_KEY)
        if registered:
            self.known.add(spec, registered if isinstance(registered, str) else "")
        grammar_id = self.known.grammar_id(spec)
        if grammar_id is not None:
            ready: concurrent.futures.Future = concurrent.futures.Future()
            ready.set_result(_grammar_class()(self, request.request_id, spec, grammar_id))
            return ready
        return self.compiles.submit(self._compile, request.request_id, spec)

    def _compile(self, seq_id: str, spec: GrammarSpec) -> VllmMaskdGrammar:
        """(a compile thread) The request's grammar once the server has compiled it: vLLM holds the
        request (WAITING_FOR_FSM) until then, and the engine core's step never waits on a compile."""
        try:
            grammar_id = register_compiled(self.client, spec, self.settings.wait_timeout_s, self.settings.timeout_s)
        except MaskClientError as exc:
            log.error("maskd grammar for request %s: %s", seq_id, exc)
            raise
        self.known.add(spec, grammar_id)
        return _grammar_class()(self, seq_id, spec, grammar_id)

    # -- the step -------------------------------------------------------------------------------
    def rows(self, manager: Any, requests: dict, req_ids: Sequence[str],
             spec_tokens: dict[str, list[int]]) -> np.ndarray:
        """The bitmask rows of ``req_ids`` (1 + scheduled drafts each, in order), from one step, laid
        out as the installed vLLM's grammar_bitmask lays them out (``_bitmask_layout``); rows no
        grammar constrains, and a strided layout's rows past a request's positions, allow every token."""
        from vllm.v1.structured_output.utils import strip_speculative_padding

        late = self.await_ahead()
        starts, total = _bitmask_layout(manager, req_ids, spec_tokens)
        out = np.full((total, self.words), -1, dtype=np.int32)
        entries: list[_Entry] = []
        # vLLM 0.33 masks, in the rows of a request still reasoning, the tokens that end reasoning
        # implicitly and that its grammar refuses as its first token (``_masked_reasoning_ends``)
        masks_ends = hasattr(manager, "_masked_reasoning_ends")
        reasoning: list[tuple[Any, int, int]] = []     # (request, its first row, its rows still reasoning)
        for req_id, start in zip(req_ids, starts):
            request = requests[req_id]
            grammar = request.structured_output_request.grammar
            raw = spec_tokens.get(req_id, ())
            n = 1 + len(raw)
            if grammar.failure is not None or grammar.terminated or request.status == _preempted():
                out[start:start + n] = self.eos_row     # (preempted: a stale placeholder, its output dropped)
            else:
                drafts = strip_speculative_padding(list(raw))
                begin, constrain = manager._get_constraint_bounds(request, drafts)
                thinking = min(constrain, len(drafts) + 1)    # rows before the grammar's (past a -1: none)
                if thinking and masks_ends:
                    reasoning.append((request, start, thinking))
                if constrain <= len(drafts):   # some position is constrained: maskd's rows from `begin` on
                    e = _Entry(grammar, start, n, range(constrain, len(drafts) + 1), begin, drafts[begin:])
                    prepared = grammar.prepared
                    if prepared is not None and not grammar.pending and e.drafts == prepared[0][:len(e.drafts)]:
                        self._place(e, prepared[1], prepared[2], out)   # asked when the drafts arrived
                    else:
                        entries.append(e)
                    grammar.prepared = None
                elif thinking and masks_ends and self._needs_first_row(manager, request, grammar):
                    entries.append(_Entry(grammar, start, n, range(0), 0, []))   # its first row, no row placed
        if entries and late:
            # maskd has not answered the step sent ahead: asking it more would wait inside vLLM's step.
            # These requests sit this step out: their rows are EOS rows whose sample update_from_output
            # drops (``_drop_late``), never given to the request
            for e in entries:
                if e.positions:     # (one only asked for its first row while reasoning: asked later)
                    out[e.start:e.start + e.count] = self.eos_row
                    self.dropped[e.grammar.seq_id] = e.grammar     # (a sequence's id is its request's)
            entries = []
        if entries:
            self._step(entries, out)
        for request, start, thinking in reasoning:
            if request.structured_output_request.grammar.failure is None:
                masked = manager._masked_reasoning_ends(request)     # asks the grammar: validate_tokens
                block = out[start:start + thinking].view(np.uint32)
                for t in masked:
                    block[:, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        return out

    @staticmethod
    def _needs_first_row(manager: Any, request: Any, grammar: VllmMaskdGrammar) -> bool:
        """Whether vLLM will ask this grammar, still reasoning, which implicit reasoning ends it
        refuses first, and its first row (which answers that) is not known yet."""
        if request.structured_output_request.masked_reasoning_end_ids is not None:
            return False                            # vLLM asked once; the answer holds while it reasons
        if grammar.first_row is not None or grammar.advanced:
            return False
        reasoner = manager._get_reasoner(request)
        return bool(getattr(reasoner, "implicit_reasoning_end_token_ids", ()))

    def check_drafts(self, manager: Any, requests: dict, draft_token_ids: Any,
                     scheduled: dict[str, list[int]] | None = None) -> None:
        """One step for the new drafts of every maskd request (with its accepted tokens): each
        grammar keeps the answer, so vLLM's validate_tokens cuts the drafts to the valid prefix and
        the next grammar_bitmask has its rows. With grammar drafts (``GrammarDrafts``) the step asks
        the server for them, and they replace the worker's (empty) drafts of the request.
        ``scheduled``: the placeholders of the step the drafts fill (async scheduling): a request
        without any is skipped, and its drafts are cut to their count, as vLLM cuts them."""
        from vllm.v1.structured_output.utils import strip_speculative_padding

        if self.deadline_s is not None and self.ahead is not None and not self.ahead[0].done():
            # maskd has not answered a step (held past the deadline): its requests sit out the steps
            # until it does, and these drafts go unchecked, so validate_tokens drops them
            return
        self.collect_ahead()
        entries: list[_Entry] = []
        where: dict[str, int] = {}
        for i, (req_id, raw) in enumerate(zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)):
            request = requests.get(req_id)
            if request is None or request.is_finished() or request.is_prefill_chunk or not _is_maskd(request):
                continue
            so = request.structured_output_request
            grammar = so.grammar if so is not None and so.is_grammar_ready else None
            if not isinstance(grammar, VllmMaskdGrammar) or grammar.is_terminated():
                continue
            limit = None if scheduled is None else len(scheduled.get(req_id) or ())
            if limit == 0:
                continue
            if self.propose:
                # The grammar constrains the next token (not inside reasoning): the server proposes.
                if manager._get_constraint_bounds(request, [])[0] == 0:
                    propose = self.propose if limit is None else min(self.propose, limit)
                    where[grammar.seq_id] = i
                    entries.append(_Entry(grammar, 0, 1 + propose, range(0, propose + 1), 0, [], propose))
                continue
            drafts = strip_speculative_padding(list(raw)[:limit])
            begin, _ = manager._get_constraint_bounds(request, drafts)
            if begin >= len(drafts):
                continue
            entries.append(_Entry(grammar, 0, 1 + len(drafts) - begin, range(0, len(drafts) - begin + 1), 0,
                                  drafts[begin:]))
        if not entries:
            return
        scratch = np.empty((sum(e.count for e in entries), self.words), dtype=np.int32)
        at = 0
        for e in entries:
            e.start, at = at, at + e.count
        answers = self._step(entries, scratch, sits_out=False)
        for e in entries:
            sid = e.grammar.seq_id
            if sid in answers:
                e.grammar.prepared = (e.drafts, scratch[e.start:e.start + 1 + len(e.drafts)].copy(), answers[sid])
                if sid in where:
                    draft_token_ids.draft_token_ids[where[sid]] = list(e.drafts)

    def step_ahead(self) -> None:
        """(after vLLM's update_from_output) One step now for every maskd sequence that accepted tokens:
        its rows come back while vLLM schedules and runs the next forward pass, and wait in the
        grammar (``prepared``) for grammar_bitmask. Nothing changes for a vLLM user but when the
        step is sent."""
        accepted, self.accepted = self.accepted, []
        if not self.step_ahead_on or not accepted:
            return
        if self.ahead is not None and not self.ahead[0].done() and self.deadline_s is not None:
            self.accepted = accepted      # the step before is late: their tokens go with a later step
            return
        self.collect_ahead()
        request: dict[str, list[int]] = {}
        grammars: list[VllmMaskdGrammar] = []
        for g in accepted:
            if g.opened and not g.closed and not g.is_terminated() and g.pending and g.seq_id not in request:
                request[g.seq_id] = g.sent = g.pending
                g.pending = []
                grammars.append(g)
        if not request:
            return
        try:
            future = self.client.step_async(request)
        except MaskClientError as exc:    # nothing was sent: each sequence fails, none goes unconstrained
            for g in grammars:
                g.fail(f"maskd step failed: {describe(exc)}", retryable=True)
            return
        self.steps += 1
        self.ahead = (future, grammars, time.monotonic())

    @property
    def reply_bound_s(self) -> float:
        """How long a step's answer is waited for (EngineSettings.reply_bound_s): with the hold on, as
        long as the client may take; with it off, the engine's step waits, MASKD_TIMEOUT_S + 5 s."""
        return self.settings.reply_bound_s(held=self.deadline_s is not None)

    def answered(self) -> bool:
        """(before vLLM schedules a step; never waits) Whether maskd's requests may be scheduled: no
        step is in flight, or its answer is in (collected: the rows wait in the grammars), or it is
        younger than ``deadline_s`` (grammar_bitmask waits the rest, beside the forward pass), or it
        is past the long bound (``reply_bound_s``: its grammars fail, and are scheduled to end with
        that error). False: the answer is late, and maskd's requests are held out of this step."""
        if self.ahead is None:
            return True
        future, _, sent = self.ahead
        now = time.monotonic()
        if future.done() or self.deadline_s is None or now < sent + self.deadline_s:
            if future.done():
                self.collect_ahead()
            return True
        if now < sent + self.reply_bound_s:
            self._late(now - sent)
            self.holds += 1
            return False
        self.collect_ahead()
        return True

    def await_ahead(self) -> bool:
        """(grammar_bitmask, beside the forward pass) The step sent ahead's answer, waited for up to
        ``deadline_s`` from its send (with the deadline off, as long as the client may take) and
        given to its grammars. True: it is late, still in flight: nothing more may be asked of maskd
        in this step."""
        if self.ahead is None:
            return False
        future, _, sent = self.ahead
        if self.deadline_s is not None and not future.done():
            left = sent + self.deadline_s - time.monotonic()
            if left > 0:
                concurrent.futures.wait([future], timeout=left)
            now = time.monotonic()
            if not future.done() and now < sent + self.reply_bound_s:
                self._late(now - sent)
                return True
        self.collect_ahead()
        return False

    def _late(self, waited: float) -> None:
        if self.holding_since is None:
            assert self.ahead is not None
            self.holding_since = self.ahead[2]
            log.warning("maskd at %s has not answered a step in %.2f s (%s=%g): maskd's requests sit out vLLM's "
                        "steps until it answers (those scheduled already are preempted, their token dropped), "
                        "the others go on", self.settings.target, waited, STEP_DEADLINE_ENV, self.deadline_s)

    def collect_ahead(self) -> None:
        """Waits for the step sent ahead (up to ``reply_bound_s`` from its send) and gives each
        grammar its rows (or its failure); a grammar still compiling is asked again by grammar_bitmask.
        Ends a hold (``answered``), whichever of vLLM's calls collects the answer that ends it."""
        if self.ahead is None:
            return
        future, grammars, sent = self.ahead
        self.ahead = None
        if self.holding_since is not None:
            if future.done():
                log.warning("maskd at %s answered %.2f s after the step was sent: its requests are scheduled again",
                            self.settings.target, time.monotonic() - self.holding_since)
            else:
                log.error("maskd at %s did not answer a step within %g s: the requests it held end with a "
                          "retryable error", self.settings.target, self.reply_bound_s)
            self.holding_since = None
        bound = self.reply_bound_s
        try:
            result = reply_within(future, max(0.0, sent + bound - time.monotonic()), self.settings.target)
        except (MaskClientError, concurrent.futures.TimeoutError) as exc:
            # the whole bound, not what was left of it when collected
            error: Exception = exc if future.done() else concurrent.futures.TimeoutError(
                f"no reply from maskd at {self.settings.target} within {bound:g} s")
            for g in grammars:
                g.fail(f"maskd step failed: {describe(error)}", retryable=True)
            return
        if result.ids != [g.seq_id for g in grammars]:
            for g in grammars:
                g.fail("maskd step answered other sequences than it was asked for")
            return
        rows, bitmask = result.row.tolist(), result.bitmask   # the arrays: no per-sequence objects
        for g, status, row in zip(grammars, result.status.tolist(), rows):
            if row >= 0:
                g.prepared = ([], bitmask[row:row + 1], 0)
            elif status != SeqStatus.WAITING:
                res = result.seqs[g.seq_id]
                if res.code is grpc.StatusCode.NOT_FOUND and g.grammar_id:
                    # (a first step that came late) its open named an id the server no longer holds:
                    # the client took the open back; the next step sends it again, with the spec
                    g.grammar_id = ""
                    g.pending[:0] = g.sent
                else:
                    g.fail(res.reason or res.status.name)

    def _step(self, entries: list[_Entry], out: np.ndarray, sits_out: bool = True) -> dict[str, int]:
        """Sends the entries' tokens and drafts, places their rows in ``out``; returns how many
        drafts the grammar accepts, per sequence that got rows. Where maskd does not answer within
        the deadline (``_may_hold``), the step is kept as a late step ahead is and nothing is placed:
        ``sits_out``, the entries are scheduled in this step and sit it out (EOS rows, preempted:
        ``dropped``); not, they are not scheduled yet (drafts checked after a step: unchecked, dropped)."""
        request: dict[str, Any] = {}
        valid: dict[str, int] = {}
        first: set[str] = set()
        for e in entries:
            g = e.grammar
            if not g.opened:
                self.client.open(g.seq_id, g.spec, grammar_id=g.grammar_id)
                g.opened = True
            tokens = g.sent = g.pending
            g.pending = []
            if not tokens and not g.advanced and g.first_row is None:
                first.add(g.seq_id)         # its row 0 is the grammar's first row
            request[g.seq_id] = StepInput(tokens, e.drafts, propose=e.propose) if e.drafts or e.propose else tokens
        by_id = {e.grammar.seq_id: e for e in entries}
        answered: set[str] = set()

        def send(step: dict[str, Any]) -> StepResult:
            self.steps += 1
            # a wait inside vLLM's step (no step ahead: drafts, a new request's first step): not a hold
            return reply_within(self.client.step_async(step), self.settings.reply_bound_s(held=False),
                                self.settings.target)

        def ready(e: _Entry, res: SeqResult, result: StepResult) -> None:
            sid = e.grammar.seq_id
            answered.add(sid)
            if sid in first:
                e.grammar.first_row = result.bitmask[res.row].copy()
            if e.propose:
                e.drafts = res.proposed_drafts
            valid[sid] = self._place(e, result.bitmask[res.row:res.row + res.num_rows], res.drafts_valid, out)

        def give_up(e: _Entry, reason: str, res: SeqResult | None) -> None:
            answered.add(e.grammar.seq_id)
            self._give_up(e, reason, out, retryable=res is None)   # None: still compiling when the wait ran out

        def again(e: _Entry, res: SeqResult) -> Any:
            # an open naming an id the server no longer holds (evicted, or admission's register went to
            # another server): refused and taken back, it goes again at once with the spec (the client's
            # ledger sends it), which the server compiles
            if res.status is SeqStatus.ERROR and e.grammar.grammar_id and res.code is grpc.StatusCode.NOT_FOUND:
                e.grammar.grammar_id = ""
                return request[e.grammar.seq_id]
            return None

        try:
            future = self.client.step_async(request)
            self.steps += 1
            if self._may_hold():
                sent = time.monotonic()
                concurrent.futures.wait([future], timeout=self.deadline_s)
                if not future.done():
                    # maskd does not answer a step asked in vLLM's step (a new request's first, with
                    # no step sent ahead; drafts): it is kept as the step ahead is, its requests sit
                    # this step out (``dropped``) and the steps after until maskd answers
                    self.ahead = (future, [e.grammar for e in entries], sent)
                    self._late(time.monotonic() - sent)
                    for e in entries:
                        if e.positions and sits_out:
                            out[e.start:e.start + e.count] = self.eos_row
                            self.dropped[e.grammar.seq_id] = e.grammar
                    return valid
            self.polls += deliver_answers(
                reply_within(future, self.settings.reply_bound_s(held=False), self.settings.target), by_id, send,
                self.settings.wait_timeout_s, ready, give_up, again,
                poll=lambda e: StepInput((), e.drafts, propose=e.propose))
        except (MaskClientError, concurrent.futures.TimeoutError) as exc:
            for sid, e in by_id.items():   # no row may go out unconstrained: these requests end here
                if sid not in answered:
                    self._give_up(e, f"maskd step failed: {describe(exc)}", out, retryable=True)
        return valid

    def _may_hold(self) -> bool:
        """Whether a step asked inside vLLM's step (a new request's first; under speculative
        decoding every step, its drafts' check included) may be held as a late step ahead is: the
        deadline is on and no step is in flight. The answer then gives each grammar its next row
        (``collect_ahead``); drafts it checked or proposed are not used."""
        return self.deadline_s is not None and self.ahead is None

    def _place(self, e: _Entry, rows: np.ndarray, drafts_valid: int, out: np.ndarray) -> int:
        """Rows for the entry's positions; returns the drafts the grammar accepts (up to the first
        draft after which the grammar has ended: its rows are all-zero, nothing may follow)."""
        last = min(drafts_valid, len(rows) - 1)
        for k in range(1, last + 1):
            if not rows[k].any():       # the grammar ended at the draft before (EOS): no row past it
                last = k - 1
                break
        for p in e.positions:
            k = p - e.first
            out[e.start + p] = rows[min(k, last)]   # past a refused draft: its row again (never all-zero)
        return last

    def _give_up(self, e: _Entry, reason: str, out: np.ndarray, retryable: bool = False) -> None:
        e.grammar.fail(reason, retryable)
        out[e.start:e.start + e.count] = self.eos_row   # it samples EOS, vLLM sees the refusal: an error

    def shutdown(self) -> None:
        self.ahead = None
        self.compiles.shutdown(wait=False, cancel_futures=True)
        self.client.shutdown()


@functools.cache
def _preempted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.PREEMPTED


@functools.cache
def _grammar_class() -> type:
    """VllmMaskdGrammar as a subclass of vLLM's StructuredOutputGrammar (vLLM imported only here)."""
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    return type("MaskdStructuredOutputGrammar", (VllmMaskdGrammar, StructuredOutputGrammar), {})



# -- the manager's patches ----------------------------------------------------------------------
def _manager_grammar_init(original: Callable, manager: Any, request: Any) -> None:
    if request.structured_output_request is None or not _is_maskd(request):
        return original(manager, request)
    try:
        maskd = _maskd_of(manager)
        future = maskd.grammar(request)
    except Exception as exc:       # this request fails, the engine goes on
        log.error("maskd cannot serve request %s: %s", request.request_id, exc)
        future = concurrent.futures.Future()
        future.set_exception(exc)
    request.structured_output_request.grammar = future


def _maskd_of(manager: Any) -> MaskdStructuredOutputs:
    maskd = getattr(manager, "_maskd", None)
    if maskd is None:
        maskd = manager._maskd = MaskdStructuredOutputs(manager.vllm_config)
    return maskd


def _manager_grammar_bitmask(original: Callable, manager: Any, requests: dict, structured_output_request_ids: list[str],
                             scheduled_spec_decode_tokens: dict[str, list[int]]) -> Any:
    req_ids, spec_tokens = structured_output_request_ids, scheduled_spec_decode_tokens
    ours = [r for r in req_ids if _is_maskd(requests[r])]
    if not ours:
        return original(manager, requests, req_ids, spec_tokens)
    rows = _maskd_of(manager).rows(manager, requests, ours, spec_tokens)
    if len(ours) == len(req_ids):
        return rows
    theirs = [r for r in req_ids if not _is_maskd(requests[r])]
    their_rows = original(manager, requests, theirs, spec_tokens)
    their_starts, their_total = _bitmask_layout(manager, theirs, spec_tokens)
    if their_rows.shape[0] != their_total:     # vLLM's own rows are not where this layout puts them
        raise RuntimeError(f"vLLM's grammar_bitmask gave {their_rows.shape[0]} rows for {len(theirs)} requests "
                           f"where maskd's layout has {their_total}: this vLLM's bitmask layout is not one "
                           "maskd knows")
    starts, total = _bitmask_layout(manager, req_ids, spec_tokens)
    our_starts, _ = _bitmask_layout(manager, ours, spec_tokens)
    source = {r: (rows, at) for r, at in zip(ours, our_starts)}
    source.update((r, (their_rows, at)) for r, at in zip(theirs, their_starts))
    merged = np.full((total, rows.shape[1]), -1, dtype=np.int32)   # a strided layout's spare rows: all allowed
    for r, at in zip(req_ids, starts):
        n = 1 + len(spec_tokens.get(r, ()))
        src, src_at = source[r]
        merged[at:at + n] = src[src_at:src_at + n]
    return merged


def mask_stride(vllm_config: Any) -> int:
    """The rows each request owns in a step's bitmask, decided once for the engine core (where
    maskd's rows are laid out, ``_bitmask_layout``) and the worker (where they are applied: the
    marked GrammarOutput carries it, ``vllm_apply.place_rows``): vLLM's own formula,
    ``num_speculative_tokens + 1`` (0.33's ``grammar_bitmask`` ``mask_stride``, Model Runner V2's
    ``decode_query_len``), read from vLLM's config. 0 where the installed vLLM packs each request's
    1 + scheduled drafts rows after the one before (0.32): the one thing its config does not say,
    so read from its version (a source tree without one is vLLM's main, which strides)."""
    from vllm.version import __version_tuple__ as version

    major, minor = version[0], version[1]
    packs = isinstance(major, int) and isinstance(minor, int) and (major, minor) != (0, 0) and (major, minor) < (0, 33)
    return 0 if packs else 1 + int(vllm_config.num_speculative_tokens)


def _bitmask_layout(manager: Any, req_ids: Sequence[str],
                    spec_tokens: dict[str, list[int]]) -> tuple[list[int], int]:
    """Where each request's rows start in the step's bitmask, and the bitmask's row count, as vLLM's own
    grammar_bitmask lays them out: request k's from row k * ``mask_stride`` (rows past a request's
    1 + scheduled drafts are never read), or one after another, 1 + its scheduled drafts each (0.32)."""
    stride = mask_stride(manager.vllm_config)
    if stride:
        return [k * stride for k in range(len(req_ids))], len(req_ids) * stride
    starts, at = [], 0
    for r in req_ids:
        starts.append(at)
        at += 1 + len(spec_tokens.get(r, ()))
    return starts, at


