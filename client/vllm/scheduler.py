"""The engine core's scheduler: maskd's requests in vLLM's ``Scheduler``. The step of the tokens a
step accepted is sent ahead after ``update_from_output`` (and a failed request's reason rides on its
output, and the requests whose rows came too late for the step they were in are preempted, their
token dropped); ``schedule`` holds maskd's requests out of a step while maskd's answer is late
(``MASKD_STEP_DEADLINE_S``); ``_free_request`` closes the request's maskd sequence."""
from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from typing import Any

from maskd_client.vllm import reasons
from maskd_client.vllm.common import _is_maskd, log
from maskd_client.vllm.engine_core import STEP_DEADLINE_ENV, MaskdStructuredOutputs, VllmMaskdGrammar


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
    if maskd is not None and maskd.dropped:
        _drop_late(scheduler, maskd)
    if maskd is not None and maskd.ahead is not None and (maskd.deadline_s is None or maskd.ahead[0].done()):
        maskd.collect_ahead()      # with a step deadline never waits here: a late answer holds maskd's requests
    outputs = original(scheduler, *args, **kwargs)
    if maskd is not None:
        _request_errors(maskd, outputs)
        maskd.step_ahead()
    return outputs


def _drop_late(scheduler: Any, maskd: MaskdStructuredOutputs) -> None:
    """(before vLLM's update_from_output) The maskd requests whose rows were late in this step
    (``MaskdStructuredOutputs.dropped``: they sampled under an EOS row) are preempted as vLLM preempts
    a running request, their in-flight output dropped (``drop_stale_output``, as vLLM's
    reset_prefix_cache drops it): vLLM's update_from_output skips their token, so the grammar never
    sees it, and the worker realigns when they are scheduled again (recomputed from their tokens,
    the prefix cache's blocks where still there) with the rows maskd's late answer brings. One that
    cannot be preempted ends: its grammar fails (retryable, naming maskd), never an unconstrained token."""
    dropped, maskd.dropped = maskd.dropped, {}
    from vllm.v1.request import RequestStatus

    now = time.monotonic()
    preempted: list[str] = []
    for req_id, grammar in dropped.items():
        request = scheduler.requests.get(req_id)
        if request is None or request.is_finished():
            continue
        if request.status == RequestStatus.RUNNING and request in scheduler.running:
            scheduler.running.remove(request)
            scheduler._preempt_request(request, now, drop_stale_output=True)
            # as reset_prefix_cache: a request scheduled the step before and resumed is sent whole
            getattr(scheduler, "prev_step_scheduled_req_ids", set()).discard(req_id)
            preempted.append(req_id)
        else:
            grammar.fail(f"maskd at {maskd.settings.target} did not answer within {STEP_DEADLINE_ENV}="
                         f"{maskd.deadline_s:g} s and the request could not sit the step out "
                         f"({request.status.name})", retryable=True)
    maskd.preempted += len(preempted)
    if preempted:
        log.warning("maskd's rows were late for %d requests in this step: preempted, their tokens dropped; "
                    "they wait in vLLM's queue until maskd answers", len(preempted))


@functools.cache
def _request_error_class() -> type | None:
    """vLLM's RequestError where EngineCoreOutput carries one to the client (0.33), else None (0.32:
    the reason goes as the output's stop_reason, reasons.py)."""
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
    the API server raises it to the client (HTTP 500 with the reason; 503 where retryable). A vLLM
    without RequestError (0.32): the reason rides in the output's stop_reason (reasons.py)."""
    failed, maskd.failed = maskd.failed, {}
    if not failed:
        return
    cls = _request_error_class()
    from vllm.v1.engine import FinishReason

    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            grammar = failed.get(out.request_id)
            if grammar is None or out.finish_reason != FinishReason.ERROR or grammar.failure is None:
                continue
            if cls is None:
                out.stop_reason = reasons.as_stop_reason(grammar.failure, grammar.retryable)
            elif out.error is None:
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
