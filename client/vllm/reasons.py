"""A failed maskd request's reason, on its way from the engine core to the client.

vLLM 0.33 carries a reason on the request's last output (``EngineCoreOutput.error``, a
``RequestError``): ``scheduler._request_errors`` sets it and vLLM's API server raises it to the
client (HTTP 500 with the reason; 503 where retryable). vLLM 0.32 has no such field: a request that
ends with finish reason error reaches the client as HTTP 500 "Internal server error". There the
engine core writes the reason into the output's ``stop_reason`` (which vLLM reads only for a
request that stopped, never for one that ended with an error), the API server's output processor
keeps it by request id as the output arrives (``OutputProcessor.process_outputs``), and the one
place vLLM's API turns finish reason error into an HTTP error (``_raise_if_error``) raises maskd's
reason instead: ``GenerationError`` (500), or ``RetryableRequestError`` (503) where maskd did not
answer.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

PREFIX = "maskd: "
RETRYABLE_PREFIX = "maskd (retryable): "
KEPT = 1024      # reasons kept for requests whose error the API server has not raised yet

_reasons: collections.OrderedDict[str, str] = collections.OrderedDict()
_lock = threading.Lock()


def as_stop_reason(failure: str, retryable: bool) -> str:
    """(the engine core, vLLM without RequestError) The text a failed request's output carries."""
    return (RETRYABLE_PREFIX if retryable else PREFIX) + failure


def _process_outputs(original: Callable, processor: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
    """(the API server) The reasons maskd's failed requests carry, kept by their request ids."""
    for out in engine_core_outputs:
        reason = out.stop_reason
        if isinstance(reason, str) and reason.startswith((PREFIX, RETRYABLE_PREFIX)) \
                and getattr(out.finish_reason, "name", None) == "ERROR":
            with _lock:
                _reasons[out.request_id] = reason
                while len(_reasons) > KEPT:
                    _reasons.popitem(last=False)
    return original(processor, engine_core_outputs, *args, **kwargs)


def _take(request_id: str) -> str | None:
    """The reason kept for the API's request id: vLLM's engine requests are named after it (its id,
    a choice's index, a suffix of its own, joined by '-')."""
    with _lock:
        for key in (request_id, *(k for k in _reasons if k.startswith(request_id + "-"))):
            if key in _reasons:
                return _reasons.pop(key)
    return None


def _raise_if_error(original: Callable, serving: Any, finish_reason: str | None, request_id: str) -> None:
    """(the API server) A maskd request that ended with an error: its reason to the client."""
    if finish_reason == "error":
        reason = _take(request_id)
        if reason is not None:
            from vllm.exceptions import GenerationError, RetryableRequestError

            if reason.startswith(RETRYABLE_PREFIX):
                raise RetryableRequestError(PREFIX + reason[len(RETRYABLE_PREFIX):])
            raise GenerationError(reason)
    return original(serving, finish_reason, request_id)
