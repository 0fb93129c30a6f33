"""What every part of maskd's vLLM plugin reads: which requests are maskd's, the marks admission
leaves on a request for the engine core, the settings of the environment, and the specs the
server compiled for this process."""
from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any

from maskd.specs import GrammarSpec, SpecError, read_json
from maskd.text_memo import TextMemo
from maskd_client.engine_env import EngineConfigError

EXTRA_ARGS_KEY = "maskd"
REGISTERED_KEY = "maskd_registered"   # set by admission: the id of this request's grammar, which the server holds
SPEC_KEY = "maskd_spec"               # set by admission: the spec it admitted, as plain data
ADMISSION_KEYS = (REGISTERED_KEY, SPEC_KEY)   # admission's words, never a client's
# What an admitted request's structured_outputs say in place of its constraint's text: the spec
# travels once, as SPEC_KEY (a 200-tool array's text is 141 KB, which vLLM's IPC carried to the
# engine core three times, and its scheduler on to the worker). Not a constraint any backend
# takes: anything that compiled it would fail, never run unconstrained.
STAND_IN = "maskd: the constraint is this request's extra_args maskd_spec"
BACKEND = "maskd"       # StructuredOutputsParams._backend of maskd's requests
REQUESTS_ENV = "MASKD_VLLM_REQUESTS"
log = logging.getLogger("maskd_client.vllm")


# The specs of the last spec texts admission read, by text (bounded by their characters): a request
# sends its constraint's JSON text again and again (a tool set, a response format), and reading a
# 200-tool array's 141 KB again is 1.4 ms (json.loads 0.85, GrammarSpec.from_request 0.54) on the
# API server's CPU, where a lookup is the string's hash, 0.03 ms.
_SPECS_BY_TEXT: TextMemo[GrammarSpec] = TextMemo(32 << 20)


def _read_spec_text(text: str) -> GrammarSpec:
    return _read_spec(read_json(text, "the spec's JSON text"))


def _read_spec(value: Any) -> GrammarSpec:
    spec = GrammarSpec.from_request(value)     # (says itself when a schema is nested too deeply)
    if spec is None:
        raise SpecError("it asks for no constraint")
    return spec


def spec_of(sampling_params: Any) -> GrammarSpec | None:
    """The grammar a request asks maskd for: the spec admission admitted (``SPEC_KEY``), else
    ``extra_args["maskd"]`` (a spec or its JSON text), else its ``structured_outputs`` when they
    are maskd's. None: not a maskd request."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    admitted = extra.get(SPEC_KEY)
    if admitted is not None:
        return GrammarSpec.from_plain(admitted)
    value = extra.get(EXTRA_ARGS_KEY)
    try:
        if value is not None:
            if isinstance(value, str):   # over HTTP (vllm_xargs take no objects): the spec's JSON text
                return _SPECS_BY_TEXT.get_or_make(value, _read_spec_text)
            return _read_spec(value)
        so = getattr(sampling_params, "structured_outputs", None)
        if so is not None and getattr(so, "_backend", None) == BACKEND:
            if STAND_IN in (so.json, so.regex, so.grammar, so.structural_tag):
                raise SpecError("the request was admitted, but its spec (extra_args maskd_spec) is gone: "
                                "it is read once, where the engine core takes the request in")
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

