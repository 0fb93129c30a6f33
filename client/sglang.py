"""SGLang grammar backend over maskd: ``--grammar-backend maskd``.

Importing this module registers a backend named ``maskd`` through SGLang's own registry
(``register_grammar_backend``) and adds the name to ``--grammar-backend``'s choices; the
``sglang.srt.plugins`` entry point of this package does the same in every SGLang process, so
``sglang serve --grammar-backend maskd`` works once ``MASKD_TARGET`` is set (see
``maskd_client.engine_env`` for TLS, auth and the session key).

What SGLang calls, and what happens:

* ``dispatch_json`` / ``_regex`` / ``_ebnf`` / ``_structural_tag`` run on SGLang's compile executor
  (its grammar queue polls the future): the grammar is registered with maskd (``RegisterGrammar``,
  waiting for the compile, which every rank asks for and the server runs once). A grammar that does
  not compile comes back as SGLang's ``InvalidGrammarObject`` with the engine's message.
* ``copy()`` is a new sequence on the cached grammar; it is opened on the server by its first fill,
  naming the grammar id the register gave (the server reads no spec on its step path). An id the
  server no longer holds (evicted) is refused and the open goes again at once with the spec.
* ``accept_token`` only records the token (and checks it against the row this grammar was last
  given, so a token outside the grammar raises ValueError at once, as SGLang's own backends do);
  ``rollback`` takes back recorded tokens, or rolls back the server's on the next step.
* ``fill_vocab_mask_batched`` (called once per scheduler step by ``update_regex_vocab_mask``) is one
  maskd step for the whole batch: the recorded tokens go out and the rows come back into SGLang's
  mask, every answered sequence's at once (one gather from the step's rows, one scatter into the
  mask; no per-sequence result objects). A sequence whose grammar is still compiling (evicted
  from the server's cache meanwhile) is polled until it has rows; it never gets an all-allowed row.
* ``is_terminated`` is true once EOS was accepted; ``try_jump_forward`` returns maskd's forced
  tokens for the current position.
* A sequence the server failed (a token the grammar rejects, a compile that failed after all) gets
  an EOS-only row, so its request ends at once; the reason is logged.

Reasoning (``--reasoning-parser``): SGLang wraps its own backends in its ``ReasonerGrammarBackend``
but returns a custom backend before it gets there; ``create_backend`` wraps maskd's the same way
(``MaskdReasonerBackend``), so the grammar starts after the reasoning ends, exactly as SGLang
decides it (``maybe_init_reasoning`` on each request, its reasoning end ids, budgets and strict
thinking). Tokens of the reasoning never reach maskd; the batch's active grammars are still one
maskd step (``MaskdReasonerGrammar.fill_vocab_mask_batched``).

Tensor parallelism: every rank's scheduler has its own backend and client on one maskd session
(``MASKD_SESSION``, or a key derived from the launch's ``nccl_port``). Sequences are numbered in
the order they first reach a fill, which is the same on every rank; the server answers each
(sequence, step) once, so every rank gets identical rows, and compiles each grammar once.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import grpc
import numpy as np
import torch
from sglang.srt.constrained.base_grammar_backend import (
    GRAMMAR_BACKEND_REGISTRY,
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarRow,
    InvalidGrammarObject,
    register_grammar_backend,
)
from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarBackend, ReasonerGrammarObject
from sglang.srt.parser.reasoning_parser import ReasoningParser

from maskd.specs import GrammarSpec, SpecError
from maskd_client.apply import apply_token_bitmask_inplace
from maskd_client.engine_env import EngineSettings, deliver_answers, eos_row, register_compiled
from maskd_client.types import MaskClientError, SeqResult, SeqStatus, StepInput, StepResult, reply_within

__all__ = ["BACKEND_NAME", "MaskdGrammarBackend", "MaskdReasonerBackend", "SglangMaskdGrammar", "register"]

BACKEND_NAME = "maskd"
log = logging.getLogger("maskd_client.sglang")


class SglangMaskdGrammar(BaseGrammarObject):
    """One request's grammar: a maskd sequence (opened on its first fill)."""

    def __init__(self, backend: MaskdGrammarBackend, spec: GrammarSpec, grammar_id: str) -> None:
        super().__init__()
        self.backend = backend
        self.spec = spec
        self.grammar_id = grammar_id
        self.seq_id: str | None = None
        self.pending: list[int] = []     # tokens accepted since the last step
        self.rollback_due = 0            # tokens to roll back on the server with the next step
        self.terminated = False          # EOS accepted
        self.failed = ""                 # the server's reason, once the sequence failed
        self.forced: list[int] = []      # forced tokens at the position of the last row
        self.row: np.ndarray | None = None   # the last row this grammar was given (for accept checks)

    # -- tokens --------------------------------------------------------------------------------------
    def accept_token(self, token: int) -> None:
        if self.finished or self.terminated:
            return
        token = int(token)
        if self.row is not None and not self.pending and not self.rollback_due and not _allowed(self.row, token):
            raise ValueError(f"token {token} is not allowed by the grammar at this position "
                             f"(maskd sequence {self.seq_id})")
        if token in self.backend.eos_ids:
            self.terminated = True       # the grammar allowed EOS here; nothing follows it
            return
        self.pending.append(token)

    def rollback(self, k: int) -> None:
        if k <= 0:
            return
        if self.terminated:
            self.terminated = False
            k -= 1
        take = min(k, len(self.pending))
        if take:
            del self.pending[len(self.pending) - take:]
        self.rollback_due += k - take
        self.row = None                  # the position moved: no local check until the next row

    def is_terminated(self) -> bool:
        return self.terminated

    @property
    def finished(self) -> bool:
        return self._finished

    @finished.setter
    def finished(self, finished: bool) -> None:
        self._finished = finished
        if finished and self.seq_id is not None:
            self.backend.close_later(self.seq_id)

    # -- masks ---------------------------------------------------------------------------------------
    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        return self.backend.allocate_vocab_mask(vocab_size, batch_size, device)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.backend.fill([GrammarRow(row=idx, grammar=self)], vocab_mask)

    @staticmethod
    def fill_vocab_mask_batched(entries: list[GrammarRow], vocab_mask: torch.Tensor) -> None:
        by_backend: dict[int, tuple[MaskdGrammarBackend, list[GrammarRow]]] = {}
        for entry in entries:
            grammar = entry.grammar
            if not isinstance(grammar, SglangMaskdGrammar):   # another backend's object in a maskd batch
                grammar.fill_vocab_mask(vocab_mask, entry.row)
                continue
            by_backend.setdefault(id(grammar.backend), (grammar.backend, []))[1].append(entry)
        for backend, rows in by_backend.values():
            backend.fill(rows, vocab_mask)

    @staticmethod
    def reset_vocab_mask(vocab_mask: torch.Tensor) -> None:
        vocab_mask.fill_(-1)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        apply_token_bitmask_inplace(logits, vocab_mask)

    # -- requests ------------------------------------------------------------------------------------
    def copy(self) -> SglangMaskdGrammar:
        return SglangMaskdGrammar(self.backend, self.spec, self.grammar_id)

    def try_jump_forward(self, tokenizer) -> tuple[list[int], str] | None:
        if self.pending or self.rollback_due or self.terminated or not self.forced:
            return None
        return list(self.forced), ""

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        return "", -1

    def jump_and_retokenize(self, old_output_ids: list[int], new_output_ids: list[int], next_state: int) -> None:
        pass


class MaskdGrammarBackend(BaseGrammarBackend):
    """SGLang's grammar backend for one scheduler (one rank): one maskd client and session."""

    def __init__(self, settings: EngineSettings, session: str, *, vocab_size: int | None = None,
                 eos_token_ids: Any = None) -> None:
        super().__init__()
        self.settings = settings
        self.client = settings.client(session)
        self.info = self.client.info()
        self.width = self.info.logits_width
        self.words = self.info.words_per_row
        eos = set(int(t) for t in (eos_token_ids or ())) | set(self.info.eos_token_ids)
        self.eos_ids = frozenset(eos)
        if vocab_size is not None and vocab_size < self.info.vocab_size:
            log.warning("the model's vocabulary has %d ids but the maskd server's tokenizer %s has %d: tokens "
                        "past the model's are never sampled", vocab_size, self.info.tokenizer, self.info.vocab_size)
        self._ids = itertools.count()
        self._prefix = f"sg{session[-12:]}-"
        self._lock = threading.Lock()        # the scheduler's thread steps; the finalizers only queue
        self._closing: collections.deque[str] = collections.deque()
        self._eos_row = eos_row(self.info.eos_token_ids, self.words)
        self.steps = 0                       # maskd steps sent (one per fill, plus polls)
        self.polls = 0
        self.reopen_steps = 0                # steps sending again opens by an id the server did not hold
        self._reopened_after = -1

    # -- compiles (on SGLang's executor; the grammar queue polls the future) ---------------------------
    def _register(self, request: dict) -> BaseGrammarObject:
        try:
            spec = GrammarSpec.from_request(request)
            assert spec is not None
            grammar_id = register_compiled(self.client, spec, self.settings.wait_timeout_s, self.settings.timeout_s)
        except (SpecError, MaskClientError) as exc:
            return InvalidGrammarObject(str(exc))
        return SglangMaskdGrammar(self, spec, grammar_id)

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        return self._register({"json_schema": key_string})

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return self._register({"regex": key_string})

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self._register({"ebnf": key_string})

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self._register({"structural_tag": key_string})

    # -- steps --------------------------------------------------------------------------------------
    # The mask calls of SGLang's backends, for objects that hold no maskd grammar (SGLang's
    # reasoning wrapper calls these while a request reasons under strict thinking).
    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        words = (max(int(vocab_size), self.width) + 31) // 32
        return torch.full((batch_size, words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return SglangMaskdGrammar.move_vocab_mask(vocab_mask, device)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        SglangMaskdGrammar.apply_vocab_mask(logits, vocab_mask)

    def close_later(self, seq_id: str) -> None:
        self._closing.append(seq_id)

    def fill(self, entries: list[GrammarRow], vocab_mask: torch.Tensor) -> None:
        """One maskd step for these rows of the batch; their rows of ``vocab_mask`` are filled."""
        with self._lock:
            while self._closing:
                self._close(self._closing.popleft())
            request: dict[str, Any] = {}
            rows: dict[str, tuple[int, SglangMaskdGrammar]] = {}
            for entry in entries:
                g: SglangMaskdGrammar = entry.grammar
                if g.seq_id is None:
                    g.seq_id = f"{self._prefix}{next(self._ids)}"
                    self.client.open(g.seq_id, g.spec, grammar_id=g.grammar_id)   # the id register gave
                    weakref.finalize(g, self._closing.append, g.seq_id)
                if g.failed:
                    self._set_row(vocab_mask, entry.row, self._eos_row)
                    continue
                request[g.seq_id] = StepInput(tokens=g.pending, rollback=g.rollback_due) \
                    if g.rollback_due else list(g.pending)
                g.pending, g.rollback_due = [], 0
                rows[g.seq_id] = (entry.row, g)
            if not request:
                return
            result = self._step(request)
            rest = self._take_rows(vocab_mask, rows, result)
            if rest:     # still compiling, refused or failed: one at a time
                self.polls += deliver_answers(result, rest, self._step, self.settings.wait_timeout_s,
                                              lambda key, res, result: self._take_row(vocab_mask, key, res, result),
                                              lambda key, reason, res: self._give_up(vocab_mask, key, reason),
                                              lambda key, res: self._open_with_spec(key, res, request))

    def _take_rows(self, vocab_mask: torch.Tensor, rows: dict[str, tuple[int, SglangMaskdGrammar]],
                   result: StepResult) -> dict[str, tuple[int, SglangMaskdGrammar]]:
        """The rows of every sequence the step answered with one, into SGLang's mask at once (one
        gather from the step's rows, one scatter into the mask); returns the other sequences."""
        ids = result.ids
        have = result.with_rows()
        answered = [ids[i] for i in have.tolist()]
        if len(answered) < len(rows):
            with_rows = set(answered)
            rest = {sid: key for sid, key in rows.items() if sid not in with_rows}
        else:
            rest = {}
        if not answered:
            return rest
        block = result.bitmask[result.row[have]]       # a copy: each grammar keeps its row for accept_token
        dest = np.fromiter((rows[sid][0] for sid in answered), dtype=np.intp, count=len(answered))
        target = vocab_mask.numpy()
        n = min(block.shape[1], target.shape[1])
        target[dest, :n] = block[:, :n]
        if n < target.shape[1]:
            target[dest, n:] = 0       # ids past the server's width are not in the grammar
        for k, sid in enumerate(answered):
            g = rows[sid][1]
            g.row = block[k]
            g.forced = result.forced_tokens(sid)
        return rest

    def _take_row(self, vocab_mask: torch.Tensor, key: tuple[int, SglangMaskdGrammar], res: SeqResult,
                  result: StepResult) -> None:
        row, g = key
        g.row = result.bitmask[res.row].copy()
        g.forced = list(res.forced_tokens)
        self._set_row(vocab_mask, row, g.row)

    def _open_with_spec(self, key: tuple[int, SglangMaskdGrammar], res: SeqResult, request: dict[str, Any]) -> Any:
        """An open that named the grammar id the server no longer holds (evicted, or registered on
        another server): refused (NOT_FOUND) and taken back by the client, it goes again at once
        and carries the spec, which the server compiles (under the same id: later copies of this
        grammar open by it again). Any other refusal: None (given up)."""
        _, g = key
        if res.status is SeqStatus.ERROR and g.grammar_id and res.code is grpc.StatusCode.NOT_FOUND:
            g.grammar_id = ""
            if self._reopened_after != self.steps:   # the first of this step's answers sent again
                self._reopened_after = self.steps
                self.reopen_steps += 1
            return request[str(g.seq_id)]
        return None

    def _give_up(self, vocab_mask: torch.Tensor, key: tuple[int, SglangMaskdGrammar], reason: str) -> None:
        row, g = key
        g.failed = reason
        log.error("maskd sequence %s failed: %s; its request ends here (EOS-only row)", g.seq_id, g.failed)
        self._set_row(vocab_mask, row, self._eos_row)

    def _step(self, request: dict) -> StepResult:
        self.steps += 1
        fut: Future = self.client.step_async(request)
        return reply_within(fut, self.settings.reply_bound_s(held=False), self.settings.target)

    def _set_row(self, vocab_mask: torch.Tensor, row: int, words: np.ndarray) -> None:
        target = vocab_mask[row].numpy()
        n = min(len(words), len(target))
        target[:n] = words[:n]
        target[n:] = 0          # ids past the server's width are not in the grammar

    def _close(self, seq_id: str) -> None:
        try:
            self.client.close(seq_id)
        except MaskClientError as exc:
            log.debug("closing %s: %s", seq_id, exc)

    def shutdown(self) -> None:
        self.client.shutdown()


def _allowed(row: np.ndarray, token: int) -> bool:
    word = token >> 5
    return 0 <= word < len(row) and bool((int(row[word]) >> (token & 31)) & 1)


def _default_session(server_args: Any) -> str:
    """A key every rank of one SGLang launch computes alike (the launch picks nccl_port once)."""
    parts = [str(getattr(server_args, name, "")) for name in ("host", "port", "nccl_port", "dist_init_addr")]
    try:
        from sglang.srt.runtime_context import get_parallel
        parts.append(f"dp{get_parallel().dp_rank}")
    except Exception:   # older layouts: the launch's ports alone
        pass
    return "sglang-" + "-".join(p for p in parts if p and p != "None")


class MaskdReasonerGrammar(ReasonerGrammarObject):
    """SGLang's own reasoning wrapper (``ReasonerGrammarObject``: the grammar starts after the
    reasoning ends, budgets and strict thinking as configured) around a maskd grammar, whose batched
    fill stays one maskd step: the rows of every wrapper whose grammar is active go to maskd
    together, the others (still reasoning) are filled by the wrapper as SGLang fills them."""

    @staticmethod
    def fill_vocab_mask_batched(entries: list[GrammarRow], vocab_mask: torch.Tensor) -> None:
        rows: list[GrammarRow] = []
        active: list[GrammarRow] = []
        for entry in entries:
            g = entry.grammar
            inner = getattr(g, "grammar", None)
            if isinstance(g, ReasonerGrammarObject) and isinstance(inner, SglangMaskdGrammar) and g._grammar_active():
                rows.append(GrammarRow(row=entry.row, grammar=inner))
                active.append(entry)
            else:
                rows.append(entry)      # reasoning (all allowed, or SGLang's strict-thinking filter), or not maskd's
        SglangMaskdGrammar.fill_vocab_mask_batched(rows, vocab_mask)
        for entry in active:            # what ReasonerGrammarObject.fill_vocab_mask adds after its grammar's fill
            g = entry.grammar
            if g.reasoning_in_grammar and g._is_thinking() and g.enable_token_filter and g._reasoning_opened():
                g._filter_reasoning_in_grammar(vocab_mask, entry.row)

    def copy(self) -> MaskdReasonerGrammar:
        new = super().copy()
        new.__class__ = MaskdReasonerGrammar
        return new


class MaskdReasonerBackend(ReasonerGrammarBackend):
    """SGLang's ``ReasonerGrammarBackend`` around maskd's backend, as ``create_grammar_backend``
    wraps SGLang's own backends under ``--reasoning-parser`` (it returns a custom backend before it
    gets there); its grammar objects are ``MaskdReasonerGrammar``."""

    def _make_grammar_object(self, grammar: BaseGrammarObject | None, reasoning: bool) -> ReasonerGrammarObject:
        obj = super()._make_grammar_object(grammar, reasoning)
        obj.__class__ = MaskdReasonerGrammar
        return obj

    def shutdown(self) -> None:
        self.grammar_backend.shutdown()


def _serving(server_args: Any, name: str) -> Any:
    """A serving setting as SGLang's own backends read it (its published config), else from the
    server args."""
    try:
        from sglang.srt.runtime_context import get_serving
        return getattr(get_serving(), name)
    except Exception:   # not published in this process (a test, an older layout)
        return getattr(server_args, name, None)


def create_backend(server_args: Any, tokenizer: Any, vocab_size: int,
                   eos_token_ids: Any) -> MaskdGrammarBackend | MaskdReasonerBackend:
    """SGLang's init_func: ``(server_args, tokenizer, vocab_size, eos_token_ids)``. Under
    ``--reasoning-parser`` (a parser whose reasoning end the tokenizer encodes) the backend is
    wrapped in SGLang's reasoning backend, so the grammar stays off the thinking."""
    backend = MaskdGrammarBackend(EngineSettings.from_env(), _default_session(server_args), vocab_size=vocab_size,
                                  eos_token_ids=eos_token_ids)
    parser_name = _serving(server_args, "reasoning_parser")
    if not parser_name or tokenizer is None:
        return backend
    parser = ReasoningParser(model_type=parser_name, stream_reasoning=False, tokenizer=tokenizer)
    if not parser.detector.get_think_end_token_ids(tokenizer):   # as create_grammar_backend: no end, no wrapper
        log.warning("reasoning parser %r: its reasoning end does not encode with this tokenizer; "
                    "the grammar applies from the first token", parser_name)
        return backend
    try:
        return MaskdReasonerBackend(backend, parser, tokenizer,
                                    enable_strict_thinking=bool(_serving(server_args, "enable_strict_thinking")))
    except BaseException:
        backend.shutdown()
        raise


def register() -> None:
    """Registers ``maskd`` in SGLang's grammar backend registry and ``--grammar-backend`` choices
    (idempotent; the ``sglang.srt.plugins`` entry point calls it in every SGLang process)."""
    register_grammar_backend(BACKEND_NAME, create_backend)
    try:
        from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES
        if BACKEND_NAME not in GRAMMAR_BACKEND_CHOICES:
            GRAMMAR_BACKEND_CHOICES.append(BACKEND_NAME)
    except ImportError:    # an SGLang without a choices list accepts any name
        pass


register()
assert GRAMMAR_BACKEND_REGISTRY[BACKEND_NAME] is create_backend
