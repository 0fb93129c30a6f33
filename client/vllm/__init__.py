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

What a maskd request meets (docs/engines.md tells each in full):

* admission, on the API server: a malformed spec, a grammar that does not compile, a maskd server
  that cannot be reached or serves another vocabulary width is HTTP 400 with the reason (the
  compile is waited for up to ``MASKD_ADMISSION_WAIT_S``, 2 s, on a thread of maskd's own);
* each engine step: one maskd step for every maskd request, sent as soon as vLLM accepts the
  tokens and answered beside the forward pass; maskd's rows sit in vLLM's bitmask beside those of
  vLLM's own backend, and a batch whose rows are all maskd's is applied with maskd's kernel (CPU
  and CUDA). A slow or stopped maskd holds only maskd's requests out of the steps while every
  other request decodes: rows later than ``MASKD_STEP_DEADLINE_S`` (0.05 s; 0: off) after the step's
  send take maskd's requests out of that step (preempted, their token dropped, never an
  unconstrained one) and out of the steps after, until maskd answers;
* a sequence the server fails (a rejected token, a document that cannot pass its schema, no
  answer) ends that request with finish reason ``error``, never a cut-short "stop"; the client
  gets maskd's reason (HTTP 500; 503, retryable, where maskd did not answer);
* reasoning parsers work as with vLLM's own backends: the grammar starts where vLLM says the
  reasoning ends;
* speculative decoding: the drafts of maskd's requests are checked by the server as they arrive
  and cut to the prefix the grammar accepts; vLLM verifies only those.

Grammar drafts (the server proposes the drafts: the tokens the grammar forces, then what this
grammar's sequences wrote next in the same context; no draft model)::

    vllm serve MODEL --speculative-config \\
        '{"method": "custom_class", "model": "maskd_client.vllm.GrammarDrafts", "num_speculative_tokens": 4}'

Versions: tested on vLLM 0.32.0 (the CPU build, real engines) and 0.33.0 (its classes). vLLM has
no registry for structured-output backends, so the plugin wraps vLLM methods; every one of them is
listed once, with the versions it was tested on, in :mod:`maskd_client.vllm.compat`
(``POINTS``). ``register`` checks them first: a vLLM that lacks one maskd needs, or has one with
another signature, stops with :class:`VllmCompatError` naming the vLLM version and the method; a
version maskd was not tested on whose methods all match loads with a warning.

The parts: :mod:`~maskd_client.vllm.admission` (the API server), :mod:`~maskd_client.vllm.engine_core`
(``StructuredOutputManager``: the grammars and the step), :mod:`~maskd_client.vllm.scheduler`
(``Scheduler``: the step sent ahead, the hold, the request's end), :mod:`~maskd_client.vllm.drafts`,
:mod:`~maskd_client.vllm.worker_apply` (the worker's apply), :mod:`~maskd_client.vllm.reasons` (a failed
request's reason to the client), :mod:`~maskd_client.vllm.compat`.
"""
from __future__ import annotations

import os

from maskd_client.engine_env import EngineConfigError
from maskd_client.vllm import common, compat, worker_apply
from maskd_client.vllm.common import BACKEND, EXTRA_ARGS_KEY, REGISTERED_KEY, SPEC_KEY, STAND_IN, KnownSpecs, spec_of
from maskd_client.vllm.compat import VllmCompatError
from maskd_client.vllm.drafts import GrammarDrafts
from maskd_client.vllm.engine_core import STEP_DEADLINE_ENV, MaskdStructuredOutputs, VllmMaskdGrammar, mask_stride

__all__ = ["BACKEND", "EXTRA_ARGS_KEY", "REGISTERED_KEY", "SPEC_KEY", "STAND_IN", "STEP_DEADLINE_ENV", "GrammarDrafts",
           "KnownSpecs", "MaskdStructuredOutputs", "VllmCompatError", "VllmMaskdGrammar", "mask_stride", "register",
           "spec_of"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: checks the installed vLLM against the table of the
    points maskd patches (``compat.POINTS``; VllmCompatError, nothing wrapped, where one does not
    match) and installs maskd's parts (idempotent)."""
    missing = compat.check()
    compat.install()
    worker_apply._grammar_output_class()
    for point in missing:
        common.log.debug("maskd: this vLLM has no %s (optional: %s)", point.where, point.why)
    if common._configured():
        try:
            which = "all" if common._serves_all() else "vllm_xargs maskd"
        except EngineConfigError as exc:     # each structured request is refused with this reason
            common.log.error("maskd: %s", exc)
            return
        common.log.info("maskd serves %s structured-output requests (MASKD_TARGET=%s)", which,
                        os.environ["MASKD_TARGET"])
