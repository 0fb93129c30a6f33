"""Admission (the API server process): a maskd request's spec parsed and registered with the maskd
server before vLLM accepts it (HTTP 400 with the reason where maskd cannot serve it), on a thread
of its own so that the API server's event loop goes on serving every other stream."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import grpc

from maskd.specs import GrammarSpec
from maskd_client.engine_env import EngineConfigError, EngineSettings
from maskd_client.types import MaskClientError
from maskd_client.vllm.common import (
    ADMISSION_KEYS,
    BACKEND,
    EXTRA_ARGS_KEY,
    REGISTERED_KEY,
    SPEC_KEY,
    STAND_IN,
    KnownSpecs,
    _configured,
    _serves_all,
    _wait_seconds,
    spec_of,
)

ADMISSION_THREADS = 16                # admissions at once per API server (each mostly waits on its register)
ADMISSION_WAIT_ENV = "MASKD_ADMISSION_WAIT_S"


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


def _validate_structured_outputs(original: Callable, params: Any, model_config: Any, structured_outputs_config: Any,
                                 tokenizer: Any) -> None:
    """SamplingParams._validate_structured_outputs with maskd's requests taken out of it."""
    if not _admit(params, model_config, structured_outputs_config, tokenizer):
        return original(params, model_config, structured_outputs_config, tokenizer)


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
            spec = spec_of(params)
            params.structured_outputs = so = StructuredOutputsParams(grammar=STAND_IN)
        else:
            # the engine's --structured-outputs-config options hold for maskd's requests too
            so.disable_any_whitespace |= bool(getattr(so_config, "disable_any_whitespace", False))
            so.disable_additional_properties |= bool(getattr(so_config, "disable_additional_properties", False))
            so._backend = BACKEND
            spec = spec_of(params)
        assert spec is not None
        so._backend = BACKEND
        # What the engine core gets: the spec once, as plain data (it parses nothing again), and
        # the constraint's text nowhere else (``STAND_IN``; vllm_xargs' text dropped)
        for field in ("json", "regex", "grammar", "structural_tag"):
            if getattr(so, field, None) is not None:
                setattr(so, field, STAND_IN)
        marks: dict[str, Any] = {SPEC_KEY: spec.to_plain()}
        grammar_id = _admission().check(spec, model_config.get_vocab_size())
        if grammar_id:
            marks[REGISTERED_KEY] = grammar_id
        kept = {k: v for k, v in (params.extra_args or {}).items() if k != EXTRA_ARGS_KEY}
        params.extra_args = {**kept, **marks}
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

