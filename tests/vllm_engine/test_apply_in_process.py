"""The worker's side of the plugin against vLLM 0.32's own apply_grammar_bitmask (its layout: each
request's rows, 1 + its scheduled drafts, one after another), in this process: no engine."""
import inspect
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

import numpy as np
import pytest
import torch
from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.structured_output import utils

from maskd_client import vllm as plugin
from maskd_client.vllm import worker_apply


class Scheduled:
    """The two fields of vLLM's SchedulerOutput / InputBatch that apply_grammar_bitmask reads."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_maskds_rows_are_applied_to_the_logits_vllms_apply_gives(dtype):
    plugin.register()
    assert utils.apply_grammar_bitmask.__maskd__
    vllms = inspect.unwrap(utils.apply_grammar_bitmask)
    rng = np.random.default_rng(11)
    words, vocab = 40, 1270
    batch = ["d", "x", "a", "b"]                 # x has no grammar; c has rows but is not in the batch
    spec = {"d": [5, 6], "b": [9]}
    ids = ["a", "b", "c", "d"]
    bitmask = rng.integers(-2**31, 2**31, size=(1 + 2 + 1 + 3, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1
    bitmask[4, :7] = 0
    logits = torch.from_numpy(rng.standard_normal((7, vocab)).astype(np.float32)).to(getattr(torch, dtype))
    ours, theirs = logits.clone(), logits.clone()
    scheduled, input_batch = Scheduled(scheduled_spec_decode_tokens=spec), Scheduled(req_ids=batch)
    marked = worker_apply._grammar_output_class()(ids, bitmask)
    marked.mask_stride = 0                       # as the engine core marks it on 0.32 (plugin.mask_stride)
    utils.apply_grammar_bitmask(scheduled, marked, input_batch, ours)
    vllms(scheduled, GrammarOutput(ids, bitmask), input_batch, theirs)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours).any() and torch.equal(ours[3], logits[3])
