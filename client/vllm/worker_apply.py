"""(vLLM worker) A step's maskd rows applied to vLLM's logits with maskd's kernel.

vLLM's engine core sends the worker one bitmask per step (``GrammarOutput.grammar_bitmask``, a
numpy int32 array) with the ids of the structured-output requests it holds rows for. Request
``k`` has ``1 + d`` rows (``d``: its drafts scheduled this step): vLLM 0.33 starts request ``k``'s at
``k * stride`` (``stride``: 1 + the most drafts a step may have), vLLM 0.32 packs them one request
after another (stride 0). The engine core decides the stride once, from vLLM's config
(``engine_core.mask_stride``), and sends it with the marked GrammarOutput (``MaskdGrammarOutput``,
made by :func:`_get_grammar_bitmask` where every structured-output row of the step is maskd's). The logits row of a
request's first row is its place in the worker's batch plus the drafts scheduled before it.

:func:`place_rows` maps bitmask rows to logits rows (what vLLM's ``apply_grammar_bitmask``
computes); :func:`apply_rows` applies them with ``maskd_client.apply``: on CPU the kernel that
skips words of 32 allowed tokens (vLLM expands every row, via float32 for other dtypes); on CUDA
the Triton kernel, fed only the structured rows (vLLM builds and copies a full-batch bitmask of
all-allowed rows around them), copied from pinned memory on the current stream without waiting
for the device. A batch whose every logits row has a row gets them in the logits' order and
needs no row index. Any other batch goes to vLLM's own function (:func:`_apply_grammar_bitmask`).
The rows' placing and apply import nothing of vLLM.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from maskd_client.vllm.common import _is_maskd
from maskd_client.vllm.engine_core import mask_stride

__all__ = ["applies_to", "apply_rows", "place_rows"]


def applies_to(logits: Any) -> bool:
    """Whether maskd's kernel applies to these logits: on CPU always, on CUDA where Triton loads
    (without it vLLM's own function, whose CUDA kernel needs Triton too, is as good)."""
    if logits.is_cpu:
        return True
    if logits.device.type != "cuda":
        return False
    from maskd_client.apply import triton_available

    return triton_available()


def place_rows(batch_req_ids: Sequence[str], ids: Sequence[str], spec_tokens: Mapping[str, Sequence[int]],
               stride: int) -> tuple[list[int], list[int]]:
    """(bitmask rows, logits rows): bitmask row ``rows[i]`` masks logits row ``logits_rows[i]``.

    batch_req_ids: the worker's batch in logits order (``InputBatch.req_ids``); ids: the requests
    the bitmask holds rows for, in its order; spec_tokens: the drafts scheduled per request;
    stride: the rows each request owns (0: packed, 1 + its drafts each). A request not in the
    batch has rows that are skipped.
    """
    wanted = set(ids)
    first_logit: dict[str, int] = {}
    offset = 0
    for batch_index, req_id in enumerate(batch_req_ids):
        if req_id in wanted:
            first_logit[req_id] = batch_index + offset
        offset += len(spec_tokens.get(req_id, ()))
    counts = [1 + len(spec_tokens.get(req_id, ())) for req_id in ids]
    rows: list[int] = []
    logits_rows: list[int] = []
    at = 0
    for k, (req_id, n) in enumerate(zip(ids, counts)):
        first = first_logit.get(req_id)
        start = k * stride if stride else at
        if first is not None:
            rows.extend(range(start, start + n))
            logits_rows.extend(range(first, first + n))
        at += n
    return rows, logits_rows


def apply_rows(bitmask: np.ndarray, ids: Sequence[str], spec_tokens: Mapping[str, Sequence[int]],
               batch_req_ids: Sequence[str], logits: Any, stride: int) -> None:
    """Set the logits each request's rows disallow to -inf, in place (CPU or CUDA logits; see
    :func:`applies_to`). Logits rows of requests without rows are left as they are. ``stride``: as
    :func:`place_rows`."""
    import torch

    from maskd_client.apply import apply_packed_token_bitmask_inplace, apply_token_bitmask_inplace

    rows, logits_rows = place_rows(batch_req_ids, ids, spec_tokens, stride)
    if not rows:
        return
    # Every logits row has a row (logits rows are unique): in the logits' order, the kernel needs no index.
    whole_batch = len(logits_rows) == len(logits)
    if whole_batch and logits_rows != sorted(logits_rows):
        order = sorted(range(len(rows)), key=logits_rows.__getitem__)
        rows = [rows[i] for i in order]
        logits_rows = [logits_rows[i] for i in order]
    every_row = rows == list(range(len(bitmask)))
    if logits.is_cpu:
        picked = torch.from_numpy(bitmask if every_row else bitmask[rows])
    else:
        # Pinned, so the copy is queued on the current stream (after the forward pass that wrote
        # the logits) and the host goes on; torch's pinned allocator reuses the block only after
        # that copy is done.
        staged = torch.empty((len(rows), bitmask.shape[1]), dtype=torch.int32, pin_memory=True)
        if every_row:
            np.copyto(staged.numpy(), bitmask.view(np.int32), casting="no")
        else:
            # rows are in range (place_rows); "clip" skips numpy's buffered copy that "raise" makes
            np.take(bitmask.view(np.int32), rows, axis=0, out=staged.numpy(), mode="clip")
        picked = staged.to(logits.device, non_blocking=True)
    if whole_batch:
        apply_token_bitmask_inplace(logits, picked)
    else:
        apply_packed_token_bitmask_inplace(logits, picked, logits_rows)


# -- the marked batch (engine core) and vLLM's apply (worker) ---------------------------------------
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
    maskd's (the same logits; :func:`apply_rows`): on CPU, and on CUDA where Triton loads. Any other
    batch, and other devices, go to vLLM's function."""
    marked = MaskdGrammarOutput is not None and type(grammar_output) is MaskdGrammarOutput
    if not marked or not applies_to(logits):
        return original(scheduler_output, grammar_output, input_batch, logits)
    apply_rows(grammar_output.grammar_bitmask, grammar_output.structured_output_request_ids,
               scheduler_output.scheduled_spec_decode_tokens, input_batch.req_ids, logits, grammar_output.mask_stride)
