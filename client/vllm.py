"""maskd as a structured-output backend of vLLM (V1 engine), installed by a vLLM plugin.

    maskd serve --tokenizer hf:MODEL/tokenizer.json --port 50051 &
    MASKD_TARGET=127.0.0.1:50051 vllm serve MODEL            # requests as usual

The ``vllm.general_plugins`` entry point ``maskd`` runs :func:`register` in every vLLM process
(API server, engine core, workers). It changes nothing unless a request is maskd's:

* with ``MASKD_TARGET`` set, every structured-output request (OpenAI ``response_format``, vLLM's
  ``structured_outputs``: json, json_object, regex, choice, grammar, structural_tag) is served by
  maskd; ``MASKD_VLLM_REQUESTS=xargs`` keeps those on vLLM's own backend and gives maskd only the
  requests that name it (``vllm_xargs: {"maskd": SPEC}``, SPEC in any shape
  ``GrammarSpec.from_request`` takes, as JSON text);
* without ``MASKD_TARGET`` the engine runs exactly as without maskd, and a request naming maskd is
  refused with HTTP 400 that says why.

Where vLLM's structured-output machinery calls a backend, maskd's parts take over for maskd's
requests and leave every other request to vLLM:

* admission (API server, ``SamplingParams`` validation): the spec is parsed and registered with
  the maskd server, waiting up to ``MASKD_ADMISSION_WAIT_S`` (2 s) for its compile: a malformed
  spec, a grammar that does not compile, a server that cannot be reached or serves another
  vocabulary width is HTTP 400 with the reason. A compile still running then is left to the engine.
  vLLM validates on the API server's event loop (every stream it serves); a maskd request is
  admitted before that on a thread of its own (``AsyncLLM.add_request``), so its register's wait
  leaves the loop to the other requests, and a spec the server compiled before for this process is
  admitted without a round trip (``KnownSpecs``).
  A request whose grammar the server holds compiled is marked with its grammar id
  (``extra_args["maskd_registered"]``);
* the engine core's ``StructuredOutputManager``: ``grammar_init`` of a request admission marked
  registered (or of a spec compiled before) is ready at once, with no round trip from the engine
  core (whose busy loop, on a machine short of CPU, has held a register's send back for its whole
  deadline), and its open names the grammar id instead of carrying the spec (~110 KB for 200
  tools, read on the server's step path; an id the server no longer holds is refused and the open
  goes again with the spec); any other waits for the compile on a thread of its own, so only that
  request sits in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``;
  ``Scheduler.update_from_output`` (where vLLM hands each grammar the tokens it sampled) is followed
  by one maskd step for every maskd request that accepted tokens: it is on the wire while vLLM
  sends its outputs, schedules the next step and runs the forward pass; ``grammar_bitmask`` (which
  vLLM runs while the forward pass is on the device) waits for that step's rows and places them in
  vLLM's bitmask beside the rows of vLLM's own backend. Requests the step ahead did not cover (a
  first step, a grammar that was compiling) and every step under speculative decoding (the
  scheduled draft tokens, one row per draft position plus the bonus one) get one step there;
* ``Scheduler.schedule``, opt-in (``MASKD_STEP_DEADLINE_S`` set, e.g. 0.1): a slow or stopped
  maskd holds only maskd's requests. It costs the overlap above: the schedule waits for the answer
  to the step sent ahead, before the forward pass instead of beside it (on a GPU, maskd's step
  time is then added to every step; off by default for that reason). The schedule waits at most
  ``MASKD_STEP_DEADLINE_S`` (maskd normally answers in 3-5 ms here) from its send; past it,
  maskd's requests (running and waiting) are taken out of ``running`` / ``waiting`` for that one
  call and put back where they were: the step schedules
  every other request and asks no maskd row (none is ever given an unconstrained one), and they
  keep their KV blocks and state (to vLLM, running requests it did not schedule; the running slots
  they hold are not given to others). They are scheduled again at the first schedule after maskd
  answers; a step not answered within ``MASKD_TIMEOUT_S`` + 5 s of its send fails its sequences
  (retryable). Not covered: async scheduling (a step's rows are asked after the next step is
  scheduled), speculative decoding (no step ahead) and a first step while none is in flight still
  wait for maskd in the step;
* the request's grammar object records accepted tokens for the next step and reports a sequence
  the server failed (a rejected token, a document that cannot pass its schema): vLLM then ends
  that request with finish reason ``error``, never a cut-short "stop"; the reason is logged and,
  on vLLM 0.33, rides on the output as a ``RequestError`` to the client (HTTP 500 with maskd's
  reason; 503, retryable, where maskd did not answer); 0.32 has no such channel (HTTP 500
  "Internal server error");
* ``Scheduler._free_request`` closes the request's maskd sequence.

Reasoning parsers keep working as with vLLM's backends: vLLM decides where the grammar starts
(``_get_constraint_bounds``); rows before it are all-allowed and no tokens reach maskd, except
(vLLM 0.33, ``_masked_reasoning_ends``) the tokens that end reasoning implicitly and that the
grammar refuses as its first token, which the grammar's first row tells.

Speculative decoding: vLLM verifies only drafts its structured-output backend validated. When the
drafter's tokens arrive (``Scheduler.update_draft_token_ids``, or under async scheduling
``update_draft_token_ids_in_output``), one maskd step for all maskd
requests carries their accepted tokens and drafts; the server answers how many drafts the grammar
accepts and a row for every draft position. Drafts are cut to that valid prefix, and the step's
rows are the rows of the next forward pass (``grammar_bitmask`` asks again only for requests
whose drafts or tokens changed since). That step is not hidden behind the forward pass, the plain
decode step is.

Grammar drafts (the server proposes the drafts: the tokens the grammar forces, then what this
grammar's sequences wrote next in the same context; contract revision 4)::

    vllm serve MODEL --speculative-config \
        '{"method": "custom_class", "model": "maskd_client.vllm.GrammarDrafts", "num_speculative_tokens": 4}'

vLLM's worker loads ``GrammarDrafts`` as its proposer; it proposes nothing itself (no draft model,
no forward pass): the drafts of maskd's requests are made where their grammar state is. When the
worker's (empty) drafts arrive in the engine core, the one maskd step that carries every maskd
request's accepted tokens asks the server for ``num_speculative_tokens`` drafts each; the server
answers the drafts with a row for every draft position plus the bonus one, and they become the
request's drafts. vLLM verifies them in the next forward pass like any drafts, applying the exact
row at each position; requests that are not maskd's get no drafts under this config.

Tested against vLLM 0.32.0 (the CPU build, a real engine in tests/engines/real) and 0.33.0
(interfaces). What it patches: ``AsyncLLM.add_request``, ``SamplingParams._validate_structured_outputs``,
``StructuredOutputManager.grammar_init`` / ``grammar_bitmask``, ``Scheduler.schedule`` / ``_free_request``,
``Scheduler.update_from_output`` / ``get_grammar_bitmask`` / ``update_draft_token_ids`` /
``update_draft_token_ids_in_output`` and, in the worker, ``apply_grammar_bitmask``: a batch whose
rows are all maskd's is applied with maskd's kernel, on CPU and on CUDA (the same logits; any other
batch keeps vLLM's function), with the stride the engine core laid them out by (``mask_stride``).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from maskd.specs import GrammarSpec, SpecError
from maskd_client.engine_env import EngineConfigError, EngineSettings, register_compiled
from maskd_client.types import MaskClientError, SeqStatus, StepInput, describe, reply_within

__all__ = ["BACKEND", "EXTRA_ARGS_KEY", "GrammarDrafts", "MaskdStructuredOutputs", "VllmMaskdGrammar", "register",
           "spec_of"]

EXTRA_ARGS_KEY = "maskd"
ADMISSION_THREADS = 16                # admissions at once per API server (each mostly waits on its register)
REGISTERED_KEY = "maskd_registered"   # set by admission: the id of this request's grammar, which the server holds
SPEC_KEY = "maskd_spec"               # set by admission: the spec it admitted, as plain data
ADMISSION_KEYS = (REGISTERED_KEY, SPEC_KEY)   # admission's words, never a client's
BACKEND = "maskd"       # StructuredOutputsParams._backend of maskd's requests
REQUESTS_ENV = "MASKD_VLLM_REQUESTS"
ADMISSION_WAIT_ENV = "MASKD_ADMISSION_WAIT_S"
STEP_DEADLINE_ENV = "MASKD_STEP_DEADLINE_S"   # opt-in: how long vLLM's schedule waits for maskd's answers
log = logging.getLogger("maskd_client.vllm")


# -- which requests are maskd's ------------------------------------------------------------------
def spec_of(sampling_params: Any) -> GrammarSpec | None:
    """The grammar a request asks maskd for: ``extra_args["maskd"]`` (a spec or its JSON text),
    else its ``structured_outputs`` when they are maskd's. None: not a maskd request."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    value = extra.get(EXTRA_ARGS_KEY)
    try:
        if value is not None:
            if isinstance(value, str):   # over HTTP (vllm_xargs take no objects): the spec's JSON text
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise SpecError(f"a string is the JSON text of a spec: {exc}") from None
            spec = GrammarSpec.from_request(value)
            if spec is None:
                raise SpecError("it asks for no constraint")
            return spec
        so = getattr(sampling_params, "structured_outputs", None)
        if so is not None and getattr(so, "_backend", None) == BACKEND:
            return GrammarSpec.from_request(so)
    except SpecError as exc:
        where = f'vllm_xargs["{EXTRA_ARGS_KEY}"]' if value is not None else "structured_outputs"
        raise ValueError(f"{where}: {exc}") from None
    return None


def _serves_all() -> bool:
    mode = os.environ.get(REQUESTS_ENV, "all").strip().lower() or "all"
    if mode not in ("all", "xargs"):
        raise EngineConfigError(f"{REQUESTS_ENV}={mode!r}: use 'all' (every structured-output request) or "
                                "'xargs' (only requests with vllm_xargs maskd)")
    return mode == "all"


def _is_maskd(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    so = getattr(params, "structured_outputs", None)
    return so is not None and getattr(so, "_backend", None) == BACKEND


def _configured() -> bool:
    return bool(os.environ.get("MASKD_TARGET", "").strip())


def _wait_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise EngineConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise EngineConfigError(f"{name}={raw!r} must not be negative")
    return value


class KnownSpecs:
    """The specs the maskd server compiled for this process and their grammar ids, most recent last
    (bounded): a request whose spec is among them needs no register round trip (its open names the
    id; a server that has since evicted it refuses that open, and the open goes again with the
    spec, which it compiles again)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._specs: collections.OrderedDict[GrammarSpec, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, spec: GrammarSpec) -> bool:
        return self.grammar_id(spec) is not None

    def grammar_id(self, spec: GrammarSpec) -> str | None:
        """The spec's grammar id ("" where it is known without one), None where it is not known."""
        with self._lock:
            found = self._specs.get(spec)
            if found is not None:
                self._specs.move_to_end(spec)
            return found

    def add(self, spec: GrammarSpec, grammar_id: str = "") -> None:
        with self._lock:
            self._specs[spec] = grammar_id or self._specs.get(spec) or ""
            self._specs.move_to_end(spec)
            while len(self._specs) > self.limit:
                self._specs.popitem(last=False)


# -- admission (the API server process) ----------------------------------------------------------
class _Admission:
    """The API server's view of maskd: settings, one client for registers, the width check."""

    def __init__(self) -> None:
        self.settings = EngineSettings.from_env()
        self.wait_s = _wait_seconds(ADMISSION_WAIT_ENV, 2.0)
        # admission runs on the API server's event loop: an unreachable server costs seconds, not 30
        quick = dataclasses.replace(self.settings, timeout_s=min(self.settings.timeout_s, max(self.wait_s, 2.0)))
        self.client = quick.client(f"vllm-admission-{os.getpid()}")
        self.checked_width: int | None = None
        # admission blocks the event loop (every stream of the API server) for its round trip: a spec
        # the server compiled before is admitted without one
        self.known = KnownSpecs()

    def check(self, spec: GrammarSpec, vocab_size: int) -> str | None:
        """Raises ValueError (HTTP 400) with the reason where maskd cannot serve this request; the
        grammar id where the server holds its grammar compiled, None where the compile outlasted
        the wait (the server answered it still compiling, or the wait's deadline came first) or
        was not waited for. Only a compiled grammar is marked: the engine core takes a marked
        request's grammar as ready and schedules it, and a grammar still compiling there would
        hold the engine core's step (and every other request) until its compile ends."""
        try:
            if self.checked_width != vocab_size:
                info = self.client.info()
                if info.words_per_row != -(-vocab_size // 32):
                    raise ValueError(
                        f"the maskd server at {self.settings.target} serves rows of {info.words_per_row} words "
                        f"(tokenizer {info.tokenizer}, width {info.logits_width}) but this model's vocabulary "
                        f"has {vocab_size} ids ({-(-vocab_size // 32)} words): start maskd with this model's "
                        "tokenizer and --logits-width")
                self.checked_width = vocab_size
            known = self.known.grammar_id(spec)
            if known:
                return known
            if self.wait_s > 0:
                grammar_id = self.client.register(spec, wait=True, timeout_s=self.wait_s, require_ready=True)
                self.known.add(spec, grammar_id)
                return grammar_id
            self.client.register(spec, wait=False)
            return None
        except MaskClientError as exc:
            code = exc.code
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                return None                  # still compiling: the engine holds the request until it is done
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.PERMISSION_DENIED):
                raise ValueError(f"maskd at {self.settings.target} cannot serve this request: {exc}") from None
            raise ValueError(f"maskd refused the grammar: {exc}") from None


@functools.cache
def _admission() -> _Admission:
    return _Admission()


def _validate_structured_outputs(original: Callable, params: Any, model_config: Any, so_config: Any,
                                 tokenizer: Any) -> None:
    """SamplingParams._validate_structured_outputs with maskd's requests taken out of it."""
    if not _admit(params, model_config, so_config, tokenizer):
        return original(params, model_config, so_config, tokenizer)


def _admit(params: Any, model_config: Any, so_config: Any, tokenizer: Any) -> bool:
    """Admits a request that is maskd's (True): its spec parsed, registered and marked on
    ``params``; VLLMValidationError (HTTP 400) with the reason where maskd cannot serve it. False
    where the request is not maskd's (vLLM validates it)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    so = params.structured_outputs
    if so is not None and getattr(so, "_backend", None) == BACKEND:
        return True                                     # admitted already (a copy validated again)
    if params.extra_args and any(k in params.extra_args for k in ADMISSION_KEYS):   # a client's: dropped
        params.extra_args = {k: v for k, v in params.extra_args.items() if k not in ADMISSION_KEYS}
    xargs = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
    has_so = so is not None and not so.all_constraints_none()
    if xargs is None and not (has_so and _configured() and _serves_all_or_400()):
        return False
    if xargs is not None and has_so:
        raise VLLMValidationError(f'the request names its constraint twice (vllm_xargs["{EXTRA_ARGS_KEY}"] and '
                                  "structured outputs / response_format); send one")
    if not _configured():
        raise VLLMValidationError(f'vllm_xargs["{EXTRA_ARGS_KEY}"] asks for maskd, but maskd is not configured on '
                                  "this engine: start it with MASKD_TARGET=HOST:PORT of a maskd server")
    if tokenizer is None:
        raise VLLMValidationError("structured outputs need a tokenizer (skip_tokenizer_init is set)")
    try:
        if xargs is not None:
            params.structured_outputs = so = StructuredOutputsParams(
                grammar=xargs if isinstance(xargs, str) else json.dumps(xargs))
            so._backend = BACKEND
            spec = spec_of(params)
        else:
            # the engine's --structured-outputs-config options hold for maskd's requests too
            so.disable_any_whitespace |= bool(getattr(so_config, "disable_any_whitespace", False))
            so.disable_additional_properties |= bool(getattr(so_config, "disable_additional_properties", False))
            so._backend = BACKEND
            spec = spec_of(params)
        assert spec is not None
        if spec.kind == "json_schema" and isinstance(so.json, dict):
            # what the engine core gets: one string, not a tree of objects to decode (vLLM's IPC),
            # and the spec itself (below): it parses nothing of the request again
            so.json = spec.text
        marks: dict[str, Any] = {SPEC_KEY: spec.to_plain()}
        grammar_id = _admission().check(spec, model_config.get_vocab_size())
        if grammar_id:
            marks[REGISTERED_KEY] = grammar_id
        params.extra_args = {**(params.extra_args or {}), **marks}
    except (ValueError, EngineConfigError) as exc:
        if so is not None:
            so._backend = None
        raise VLLMValidationError(str(exc)) from None
    return True


async def _add_request(original: Callable, engine: Any, request_id: str, prompt: Any, params: Any,
                       *args: Any, **kwargs: Any) -> Any:
    """AsyncLLM.add_request, where a maskd request is admitted first on a thread of its own.
    vLLM validates a request's SamplingParams on the API server's event loop, and admission waits
    there for the server's register (the spec's compile: milliseconds for a 200-tool array, up to
    ``MASKD_ADMISSION_WAIT_S``): every other request's admission, stream and response waited behind
    it. Admitted here, the wait leaves the loop free; vLLM's own validation then finds the request
    admitted. The same errors come from the same call (``add_request``)."""
    if _may_be_maskds(params) and isinstance(prompt, (dict, str)):
        processor = engine.input_processor
        await asyncio.get_running_loop().run_in_executor(
            _admission_threads(), _admit, params, processor.model_config, processor.structured_outputs_config,
            processor.tokenizer)
    return await original(engine, request_id, prompt, params, *args, **kwargs)


@functools.cache
def _admission_threads() -> concurrent.futures.ThreadPoolExecutor:
    """Admission's own threads, not the loop's default executor (a few threads on a small machine,
    which other parts of vLLM share): registers waiting on slow compiles hold only admissions."""
    return concurrent.futures.ThreadPoolExecutor(ADMISSION_THREADS, thread_name_prefix="maskd-admission")


def _may_be_maskds(params: Any) -> bool:
    """A cheap look: SamplingParams that ``_admit`` would take (or refuse), not admitted yet."""
    so = getattr(params, "structured_outputs", None)
    if so is not None and getattr(so, "_backend", None) == BACKEND:
        return False
    extra = getattr(params, "extra_args", None)
    if extra and EXTRA_ARGS_KEY in extra:
        return True
    if so is None or not _configured() or so.all_constraints_none():
        return False
    try:
        return _serves_all()
    except EngineConfigError:
        return True          # _admit refuses it with the reason


def _serves_all_or_400() -> bool:
    try:
        return _serves_all()
    except EngineConfigError as exc:
        from vllm.exceptions import VLLMValidationError
        raise VLLMValidationError(str(exc)) from None


# -- the engine core -----------------------------------------------------------------------------
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
        self.eos_row = np.zeros(self.words, dtype=np.uint32)
        for t in self.eos_ids:
            self.eos_row[t >> 5] |= np.uint32(1) << np.uint32(t & 31)
        self.eos_row = self.eos_row.view(np.int32)
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
        # Opt-in: vLLM's schedule waits this long (from the send) for the step sent ahead; past it,
        # maskd's requests are held out of that step (``_schedule``), the others decode. None (unset
        # or 0): the step's rows are waited for beside the forward pass (grammar_bitmask), as always.
        self.deadline_s = _wait_seconds(STEP_DEADLINE_ENV, 0.0) or None
        self.holding_since: float | None = None      # when a late answer first held maskd's requests
        self.holds = 0                               # schedules that held maskd's requests out

    # -- compiles -------------------------------------------------------------------------------
    def grammar(self, request: Any) -> concurrent.futures.Future:
        """A future of the request's VllmMaskdGrammar, done when the server has compiled its grammar."""
        marks = request.sampling_params.extra_args or {}
        spec = GrammarSpec.from_plain(marks[SPEC_KEY]) if SPEC_KEY in marks else spec_of(request.sampling_params)
        assert spec is not None
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

        self.collect_ahead()
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
            if grammar.failure is not None or grammar.terminated:
                out[start:start + n] = self.eos_row
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
        answers = self._step(entries, scratch)
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
        self.collect_ahead()
        request: dict[str, list[int]] = {}
        grammars: list[VllmMaskdGrammar] = []
        for g in accepted:
            if g.opened and not g.closed and not g.is_terminated() and g.pending and g.seq_id not in request:
                request[g.seq_id], g.pending = g.pending, []
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

    def answered(self) -> bool:
        """(before vLLM schedules a step) Whether maskd's requests may be scheduled: no step is in
        flight, or its answer came within ``deadline_s`` of its send (it is collected: the rows wait
        in the grammars), or it is past the long bound (``timeout_s`` + 5 s: its grammars fail, and
        are scheduled to end with that error). False: the answer is late, and maskd's requests are
        held out of this step; waits at most what is left of ``deadline_s``."""
        if self.ahead is None:
            return True
        future, _, sent = self.ahead
        assert self.deadline_s is not None
        left = sent + self.deadline_s - time.monotonic()
        if left > 0 and not future.done():
            concurrent.futures.wait([future], timeout=left)
        now = time.monotonic()
        if not future.done() and now < sent + self.settings.timeout_s + 5:
            if self.holding_since is None:
                self.holding_since = sent
                log.warning("maskd at %s has not answered a step in %.2f s (%s=%g): maskd's requests are held "
                            "out of vLLM's steps until it answers, the others go on", self.settings.target,
                            now - sent, STEP_DEADLINE_ENV, self.deadline_s)
            self.holds += 1
            return False
        came = future.done()
        self.collect_ahead()
        if self.holding_since is not None:
            if came:
                log.warning("maskd at %s answered %.2f s after the step was sent: its requests are scheduled again",
                            self.settings.target, now - self.holding_since)
            else:
                log.error("maskd at %s did not answer a step within %g s: the requests it held end with a "
                          "retryable error", self.settings.target, self.settings.timeout_s + 5)
            self.holding_since = None
        return True

    def collect_ahead(self) -> None:
        """Waits for the step sent ahead (up to ``timeout_s`` + 5 s from its send) and gives each
        grammar its rows (or its failure); a grammar still compiling is asked again by grammar_bitmask."""
        if self.ahead is None:
            return
        future, grammars, sent = self.ahead
        self.ahead = None
        bound = self.settings.timeout_s + 5
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
                g.fail(res.reason or res.status.name)

    def _step(self, entries: list[_Entry], out: np.ndarray) -> dict[str, int]:
        """Sends the entries' tokens and drafts, places their rows in ``out``; returns how many
        drafts the grammar accepts, per sequence that got rows."""
        request: dict[str, Any] = {}
        valid: dict[str, int] = {}
        first: set[str] = set()
        for e in entries:
            g = e.grammar
            if not g.opened:
                self.client.open(g.seq_id, g.spec, grammar_id=g.grammar_id)
                g.opened = True
            tokens, g.pending = g.pending, []
            if not tokens and not g.advanced and g.first_row is None:
                first.add(g.seq_id)         # its row 0 is the grammar's first row
            request[g.seq_id] = StepInput(tokens, e.drafts, propose=e.propose) if e.drafts or e.propose else tokens
        by_id = {e.grammar.seq_id: e for e in entries}
        answered: set[str] = set()
        waited, attempt = 0.0, 0
        try:
            while request:
                self.steps += 1
                result = reply_within(self.client.step_async(request), self.settings.timeout_s + 5,
                                      self.settings.target)
                waiting: dict[str, Any] = {}
                again: dict[str, Any] = {}
                for sid, res in result.seqs.items():
                    e = by_id[sid]
                    if res.status is SeqStatus.ERROR and e.grammar.grammar_id and \
                            res.code is grpc.StatusCode.NOT_FOUND:
                        # an open naming an id the server no longer holds (evicted, or admission's
                        # register went to another server): refused and taken back, it goes again
                        # at once with the spec (the client's ledger sends it), which the server compiles
                        e.grammar.grammar_id = ""
                        again[sid] = request[sid]
                        continue
                    if res.status is not SeqStatus.WAITING:
                        answered.add(sid)
                    if res.has_rows:
                        if sid in first:
                            e.grammar.first_row = result.bitmask[res.row].copy()
                        if e.propose:
                            e.drafts = res.proposed_drafts
                        valid[sid] = self._place(e, result.bitmask[res.row:res.row + res.num_rows],
                                                 res.drafts_valid, out)
                    elif res.status is SeqStatus.WAITING:
                        waiting[sid] = StepInput((), e.drafts, propose=e.propose)
                    else:
                        self._give_up(e, res.reason or res.status.name, out)
                if waiting and waited > self.settings.wait_timeout_s:
                    for sid in waiting:
                        self._give_up(by_id[sid], f"grammar still compiling after {self.settings.wait_timeout_s:g} s",
                                      out, retryable=True)
                    return valid
                if waiting and not again:
                    pause = min(0.05, 0.001 * 2 ** attempt)
                    time.sleep(pause)
                    waited += pause
                    attempt += 1
                    self.polls += 1
                request = {**waiting, **again}
        except (MaskClientError, concurrent.futures.TimeoutError) as exc:
            for sid, e in by_id.items():   # no row may go out unconstrained: these requests end here
                if sid not in answered:
                    self._give_up(e, f"maskd step failed: {describe(exc)}", out, retryable=True)
        return valid

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


# -- grammar drafts (the worker's proposer) ----------------------------------------------------------
GRAMMAR_DRAFTS = "maskd_client.vllm.GrammarDrafts"


class GrammarDrafts:
    """vLLM's speculative proposer for maskd's grammar drafts (``--speculative-config
    '{"method": "custom_class", "model": "maskd_client.vllm.GrammarDrafts", "num_speculative_tokens": K}'``).

    It runs in vLLM's worker and proposes no tokens itself: the drafts of maskd's requests are made
    by the maskd server, which holds their grammar state, and take the place of these empty ones in
    the engine core (``MaskdStructuredOutputs.check_drafts``). No draft model is loaded."""

    def __init__(self, vllm_config: Any) -> None:
        """vLLM constructs its proposer with its config; the drafts' count is read in the engine core."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafts come from the grammar."""

    def propose(self, sampled_token_ids: list, *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


def _grammar_drafts(vllm_config: Any) -> int:
    """The drafts the server proposes per request and step: num_speculative_tokens when vLLM's
    speculative config names GrammarDrafts, else 0 (drafts, if any, come from vLLM's drafter)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "custom_class" \
            or getattr(spec, "model", None) != GRAMMAR_DRAFTS:
        return 0
    return int(spec.num_speculative_tokens)


@functools.cache
def _grammar_class() -> type:
    """VllmMaskdGrammar as a subclass of vLLM's StructuredOutputGrammar (vLLM imported only here)."""
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    return type("MaskdStructuredOutputGrammar", (VllmMaskdGrammar, StructuredOutputGrammar), {})


# -- applying the rows (the worker) ---------------------------------------------------------------
MaskdGrammarOutput: type | None = None   # vLLM's GrammarOutput of a batch whose rows are all maskd's


def _grammar_output_class() -> type:
    """GrammarOutput's subclass that marks a batch whose structured-output rows are all maskd's. A
    module attribute, made in every vLLM process by ``register`` (the worker unpickles it by name)."""
    global MaskdGrammarOutput
    if MaskdGrammarOutput is None:
        from vllm.v1.core.sched.output import GrammarOutput

        MaskdGrammarOutput = type("MaskdGrammarOutput", (GrammarOutput,), {"__module__": __name__})
    return MaskdGrammarOutput


def _get_grammar_bitmask(original: Callable, scheduler: Any, scheduler_output: Any) -> Any:
    """(engine core) vLLM's GrammarOutput, marked when every structured-output row in it is maskd's,
    with the stride its rows were laid out by (``mask_stride``) for the worker."""
    output = original(scheduler, scheduler_output)
    if output is not None and output.structured_output_request_ids:
        requests = scheduler.requests
        if all(_is_maskd(requests[r]) for r in output.structured_output_request_ids if r in requests):
            output.__class__ = _grammar_output_class()
            output.mask_stride = mask_stride(scheduler.vllm_config)
    return output


def _apply_grammar_bitmask(original: Callable, scheduler_output: Any, grammar_output: Any, input_batch: Any,
                           logits: Any) -> None:
    """(worker) vLLM's apply_grammar_bitmask, with maskd's kernel for a batch whose rows are all
    maskd's (the same logits; ``maskd_client.vllm_apply``): on CPU, and on CUDA where Triton loads.
    Any other batch, and other devices, go to vLLM's function."""
    from maskd_client import vllm_apply

    marked = MaskdGrammarOutput is not None and type(grammar_output) is MaskdGrammarOutput
    if not marked or not vllm_apply.applies_to(logits):
        return original(scheduler_output, grammar_output, input_batch, logits)
    vllm_apply.apply_rows(grammar_output.grammar_bitmask, grammar_output.structured_output_request_ids,
                          scheduler_output.scheduled_spec_decode_tokens, input_batch.req_ids, logits,
                          grammar_output.mask_stride)


def _patch_apply(hook: Callable) -> None:
    """vLLM's apply_grammar_bitmask wrapped where the model runner calls it (it binds the name)."""
    import sys

    import vllm.v1.structured_output.utils as utils

    modules: list[Any] = [utils, sys.modules.get("vllm.v1.worker.gpu_model_runner")]
    for module in modules:
        if module is not None and not getattr(module.apply_grammar_bitmask, "__maskd__", False):
            module.apply_grammar_bitmask = _hooked(module.apply_grammar_bitmask, hook)


def _hooked(original: Callable, hook: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    wrapper.__maskd__ = True    # type: ignore[attr-defined]
    return wrapper


# -- the patches -----------------------------------------------------------------------------------
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


def _manager_grammar_bitmask(original: Callable, manager: Any, requests: dict, req_ids: list[str],
                             spec_tokens: dict[str, list[int]]) -> Any:
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


def _free_request(original: Callable, scheduler: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    so = getattr(request, "structured_output_request", None)
    if so is not None and _is_maskd(request):
        grammar = so.grammar if so.is_grammar_ready else None
        if isinstance(grammar, VllmMaskdGrammar):
            grammar.close()
            if grammar.failure is not None:
                grammar.owner.failed[request.request_id] = grammar
    return original(scheduler, request, *args, **kwargs)


def _update_from_output(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    maskd = getattr(scheduler.structured_output_manager, "_maskd", None)
    if maskd is not None and maskd.ahead is not None and (maskd.deadline_s is None or maskd.ahead[0].done()):
        maskd.collect_ahead()      # with a step deadline never waits here: a late answer holds maskd's requests
    outputs = original(scheduler, *args, **kwargs)
    if maskd is not None:
        _request_errors(maskd, outputs)
        maskd.step_ahead()
    return outputs


@functools.cache
def _request_error_class() -> type | None:
    """vLLM's RequestError where EngineCoreOutput carries one to the client (0.33), else None (0.32:
    the request ends with finish reason error, HTTP 500 "Internal server error", the reason logged)."""
    try:
        from vllm.outputs import RequestError
        from vllm.v1.engine import EngineCoreOutput
    except ImportError:
        return None
    return RequestError if "error" in EngineCoreOutput.__struct_fields__ else None


def _request_errors(maskd: MaskdStructuredOutputs, outputs: dict) -> None:
    """(after vLLM's update_from_output) Each maskd request this step ended with finish reason error
    because its sequence failed gets the failure's reason as the output's RequestError (code
    ``structured_output_error``), as vLLM's scheduler gives the requests whose grammar did not compile:
    the API server raises it to the client (HTTP 500 with the reason; 503 where retryable)."""
    failed, maskd.failed = maskd.failed, {}
    cls = _request_error_class()
    if not failed or cls is None:
        return
    from vllm.v1.engine import FinishReason

    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            grammar = failed.get(out.request_id)
            if grammar is not None and out.finish_reason == FinishReason.ERROR and out.error is None:
                out.error = cls(code="structured_output_error", message=f"maskd: {grammar.failure}",
                                retryable=grammar.retryable)


def _schedule(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Scheduler.schedule, where maskd's requests sit this step out while maskd's answer to the step
    sent ahead is late (``MaskdStructuredOutputs.answered``: past ``MASKD_STEP_DEADLINE_S``): for
    this call they are taken out of ``running`` and ``waiting`` (keeping their KV blocks and state,
    not preempted; vLLM's running slots they hold are not given to others), so the step schedules
    every other request and asks no maskd rows, and they are put back where they were. vLLM treats
    them as running requests it did not schedule this step (as when its token budget runs out)."""
    maskd = getattr(scheduler.structured_output_manager, "_maskd", None)
    if maskd is None or maskd.deadline_s is None or maskd.answered():
        return original(scheduler, *args, **kwargs)
    running, waiting = scheduler.running, scheduler.waiting
    held_running = [r for r in running if _is_maskd(r)]
    held_waiting = [r for r in waiting if _is_maskd(r)]
    if not held_running and not held_waiting:
        return original(scheduler, *args, **kwargs)
    before_running, before_waiting = list(running), list(waiting)
    held = {id(r) for r in held_running}
    running[:] = [r for r in running if id(r) not in held]
    if held_waiting:
        waiting.remove_requests(held_waiting)
    slots = len(held_running)
    scheduler.max_num_running_reqs -= slots
    active = hasattr(scheduler, "max_num_active_reqs")
    if active:
        scheduler.max_num_active_reqs -= slots
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        scheduler.max_num_running_reqs += slots
        if active:
            scheduler.max_num_active_reqs += slots
        _put_back_running(scheduler, before_running, held)
        if held_waiting:
            _put_back_waiting(scheduler.waiting, before_waiting, held_waiting)


def _put_back_running(scheduler: Any, before: list, held: set[int]) -> None:
    """``running`` as it was, less those this schedule preempted, with those it admitted after."""
    after = scheduler.running
    present = {id(r) for r in after}
    was = {id(r) for r in before}
    after[:] = [r for r in before if id(r) in held or id(r) in present] + [r for r in after if id(r) not in was]


def _put_back_waiting(queue: Any, before: list, held: list) -> None:
    """The held requests back in vLLM's waiting queue: in an FCFS queue (a deque) each before the
    request that followed it (or at the end); a priority queue orders them itself."""
    if not isinstance(queue, collections.deque):
        for r in held:
            queue.add_request(r)
        return
    held_ids = {id(r) for r in held}
    present = {id(r) for r in queue}
    anchored: dict[int, list] = {}
    pending: list = []
    for r in before:
        if id(r) in held_ids:
            pending.append(r)
        elif id(r) in present and pending:
            anchored[id(r)], pending = pending, []
    rebuilt: list = []
    for r in queue:
        rebuilt.extend(anchored.pop(id(r), ()))
        rebuilt.append(r)
    rebuilt.extend(pending)
    queue.clear()
    queue.extend(rebuilt)


def _drafts_arrived(original: Callable, scheduler: Any, draft_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
    """Both doors by which the worker's drafts reach vLLM's scheduler: ``update_draft_token_ids``
    (synchronous scheduling, ``EngineCore.post_step``: drafts for the next schedule) and
    ``update_draft_token_ids_in_output(draft_token_ids, scheduler_output)`` (async scheduling,
    ``EngineCore.step_with_batch_queue``: drafts in place of the placeholders of a step already
    scheduled, cut to their count). maskd checks its requests' drafts first, then vLLM's own
    method cuts them with ``validate_tokens`` (and pads the second door's with -1)."""
    manager = scheduler.structured_output_manager
    maskd = getattr(manager, "_maskd", None)
    if maskd is not None:
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        scheduled = None if scheduler_output is None else scheduler_output.scheduled_spec_decode_tokens
        maskd.check_drafts(manager, scheduler.requests, draft_token_ids, scheduled)
    return original(scheduler, draft_token_ids, *args, **kwargs)


def _wrap(cls: type, name: str, hook: Callable) -> None:
    """``cls.name`` replaced by ``hook(original, self, ...)`` (awaited where the original is a
    coroutine function); idempotent."""
    original = getattr(cls, name)
    if getattr(original, "__maskd__", False):
        return
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await hook(original, self, *args, **kwargs)
    else:
        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return hook(original, self, *args, **kwargs)

    wrapper.__maskd__ = True    # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs maskd's parts (idempotent)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.structured_output import StructuredOutputManager

    _wrap(SamplingParams, "_validate_structured_outputs", _validate_structured_outputs)
    _wrap(AsyncLLM, "add_request", _add_request)
    _wrap(StructuredOutputManager, "grammar_init", _manager_grammar_init)
    _wrap(StructuredOutputManager, "grammar_bitmask", _manager_grammar_bitmask)
    _wrap(Scheduler, "_free_request", _free_request)
    _wrap(Scheduler, "update_draft_token_ids", _drafts_arrived)
    _wrap(Scheduler, "update_draft_token_ids_in_output", _drafts_arrived)
    _wrap(Scheduler, "update_from_output", _update_from_output)
    _wrap(Scheduler, "schedule", _schedule)
    _wrap(Scheduler, "get_grammar_bitmask", _get_grammar_bitmask)
    _grammar_output_class()
    _patch_apply(_apply_grammar_bitmask)
    if _configured():
        try:
            which = "all" if _serves_all() else "vllm_xargs maskd"
        except EngineConfigError as exc:     # each structured request is refused with this reason
            log.error("maskd: %s", exc)
            return
        log.info("maskd serves %s structured-output requests (MASKD_TARGET=%s)", which, os.environ["MASKD_TARGET"])
