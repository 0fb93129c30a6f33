"""The table of what maskd's vLLM plugin patches (``maskd_client.vllm.compat.POINTS``) against vLLM
0.33's own classes: every point there with the parameters maskd relies on, every wrapper maskd
installs in the table, each hook written for its point; and ``register()`` refusing, naming the
vLLM version and the point, a signature that changed (a vLLM method replaced within the test), a
missing required point or a subclass that bypasses a wrapper; a missing optional point loads, and
so does an untested version whose points all match (with a warning). vLLM 0.32 (the real engine's)
is checked in tests/vllm_engine/test_compat.py."""
import inspect
import logging
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

import pytest
import vllm.v1.structured_output.utils as utils
from vllm.entrypoints.generate.base.serving import GenerateBaseServing
from vllm.parser.abstract_parser import DelegatingParser
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import SchedulerInterface
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.structured_output import StructuredOutputManager
from vllm.version import __version__ as VLLM_VERSION

from maskd_client import vllm as plugin
from maskd_client.vllm import compat
from maskd_client.vllm.compat import POINTS, VllmCompatError

OWNERS = [SamplingParams, AsyncLLM, StructuredOutputManager, Scheduler, utils, DelegatingParser, OutputProcessor,
          GenerateBaseServing]


@pytest.fixture(scope="module", autouse=True)
def installed():
    plugin.register()


def _point(name: str) -> compat.PatchPoint:
    (point,) = [p for p in POINTS if p.name == name]
    return point


def test_the_table_matches_vllm_0_33():
    assert VLLM_VERSION == "0.33.0"
    assert compat.check() == []                       # every point there, the optional ones too
    for point in POINTS:
        owner = compat._owner(point)
        fn = getattr(owner, point.name)
        if point.hook is not None:
            assert fn.__maskd__, point.where
        params = list(inspect.signature(inspect.unwrap(fn)).parameters)
        if point.hook is not None and point.exact:
            assert params == list(point.params), point.where
        else:
            assert params[:len(point.params)] == list(point.params), point.where
        assert inspect.iscoroutinefunction(inspect.unwrap(fn)) == point.coroutine, point.where
        assert VLLM_VERSION in point.tested or not point.required, point.where
    # nothing maskd wraps is missing from the table
    wrapped = {(owner, name) for owner in OWNERS for name, value in vars(owner).items()
               if inspect.isfunction(value) and getattr(value, "__maskd__", False)}
    listed = {(compat._owner(p), p.name) for p in POINTS if p.hook is not None}
    assert wrapped == listed


def test_each_hook_takes_the_parameters_its_point_lists():
    # the table's parameters are the wrapper's own (after vLLM's original; a method's self under its name)
    for point in POINTS:
        if point.hook is None:
            continue
        sig = list(inspect.signature(point.hook).parameters.values())[1:]      # past `original`
        named = [p.name for p in sig if p.kind is p.POSITIONAL_OR_KEYWORD]
        expected = list(point.params[1:]) if point.owner else list(point.params)
        taken = named[1:] if point.owner else named
        passes_on = any(p.kind is p.VAR_POSITIONAL for p in sig)
        assert passes_on != point.exact, point.where
        if point.exact:
            assert taken == expected, point.where
        else:      # the rest it passes on (one hook for both drafts doors reads scheduler_output from them)
            assert taken == expected[:len(taken)], point.where


def test_a_changed_signature_is_refused_naming_the_version_and_the_point(monkeypatch):
    def get_grammar_bitmask(self, scheduler_output, num_lookahead_tokens):
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "get_grammar_bitmask", get_grammar_bitmask)
    with pytest.raises(VllmCompatError) as refused:
        plugin.register()
    message = str(refused.value)
    assert f"cannot load on vLLM {VLLM_VERSION}" in message
    assert "vllm.v1.core.sched.scheduler.Scheduler.get_grammar_bitmask: expected parameters (self, " \
           "scheduler_output), found (self, scheduler_output, num_lookahead_tokens)" in message
    assert "tested on vLLM 0.32.0, 0.33.0" in message
    assert Scheduler.get_grammar_bitmask is get_grammar_bitmask      # refused before anything was wrapped


def test_every_mismatch_is_named_at_once(monkeypatch):
    def free_request(self, req, delay_free_blocks=False):    # maskd passes the request first, by position
        raise AssertionError("never called")

    def add_request(self, request_id, prompt, params):       # no longer a coroutine: maskd's wrapper awaits it
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "_free_request", free_request)
    monkeypatch.setattr(AsyncLLM, "add_request", add_request)
    with pytest.raises(VllmCompatError) as refused:
        plugin.register()
    message = str(refused.value)
    assert "Scheduler._free_request: expected parameters (self, request, ...), found (self, req, " \
           "delay_free_blocks=...)" in message
    assert "AsyncLLM.add_request: expected an async def, found a plain def" in message


def test_a_missing_optional_point_loads_a_missing_required_one_is_refused(monkeypatch):
    monkeypatch.delattr(Scheduler, "update_draft_token_ids_in_output")
    monkeypatch.delattr(SchedulerInterface, "update_draft_token_ids_in_output")    # its abstract one
    assert compat.check() == [_point("update_draft_token_ids_in_output")]
    plugin.register()                                   # loads without it

    monkeypatch.delattr(StructuredOutputManager, "grammar_init")
    with pytest.raises(VllmCompatError, match=r"StructuredOutputManager\.grammar_init: missing"):
        plugin.register()


def test_a_point_required_with_another_is_refused_only_beside_it(monkeypatch):
    monkeypatch.delattr(StructuredOutputManager, "_get_reasoner")
    with pytest.raises(VllmCompatError, match=r"StructuredOutputManager\._get_reasoner: missing"):
        compat.check()
    monkeypatch.delattr(StructuredOutputManager, "_masked_reasoning_ends")      # as on 0.32: neither is needed
    assert {p.name for p in compat.check()} == {"_get_reasoner", "_masked_reasoning_ends"}


def test_a_subclass_that_would_bypass_a_wrapper_is_refused(monkeypatch):
    monkeypatch.setattr(AsyncScheduler, "schedule", lambda self, throttle_prefills=False: None, raising=False)
    with pytest.raises(VllmCompatError, match=r"Scheduler\.schedule: vllm\.v1\.core\.sched\.async_scheduler\."
                                              r"AsyncScheduler overrides it"):
        plugin.register()


def test_an_untested_version_whose_points_match_loads_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(compat, "vllm_version", lambda: ("0.35.1", (0, 35, 1)))
    caplog.set_level(logging.WARNING, logger="maskd_client.vllm")
    plugin.register()
    (record,) = [r for r in caplog.records if r.name == "maskd_client.vllm"]
    assert "vLLM 0.35.1 is not a version maskd was tested on (0.32.0, 0.33.0)" in record.getMessage()

    caplog.clear()
    monkeypatch.setattr(compat, "vllm_version", lambda: ("0.33.2", (0, 33, 2)))   # a patch release of a tested one
    plugin.register()
    assert not [r for r in caplog.records if r.name == "maskd_client.vllm"]
