"""Drafts: maskd's grammar drafts (``GrammarDrafts``, vLLM's ``custom_class`` proposer; the server
proposes them) and the check of every draft maskd's requests get, as they reach vLLM's scheduler."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
            or getattr(spec, "model", None) not in (GRAMMAR_DRAFTS, f"{__name__}.GrammarDrafts"):
        return 0
    return int(spec.num_speculative_tokens)


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
