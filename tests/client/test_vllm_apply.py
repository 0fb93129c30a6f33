"""maskd_client.vllm.worker_apply: a step's rows placed as vLLM places them and applied with maskd's
kernel, on CPU here and on CUDA where a GPU is present (the vLLM plugin's worker route; the plugin's
choice of it is tested against vLLM's own apply in tests/engines and tests/vllm_engine)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from maskd_client.apply import apply_token_bitmask_reference, triton_available
from maskd_client.vllm.worker_apply import applies_to, apply_rows, place_rows

CUDA = torch.cuda.is_available()
needs_cuda_triton = pytest.mark.skipif(not (CUDA and triton_available()), reason="needs a CUDA GPU with Triton")

# the batch: d (2 drafts), x (no grammar), a, b (1 draft); c has rows but is not in the batch
BATCH = ["d", "x", "a", "b"]
SPEC = {"d": [5, 6], "b": [9]}
IDS = ["a", "b", "c", "d"]
# logits rows: d 0-2, x 3, a 4, b 5-6
STRIDED = ([0, 3, 4, 9, 10, 11], [4, 5, 6, 0, 1, 2])     # vLLM 0.33, stride 3: a 0, b 3-4, d 9-11


def test_rows_packed_one_request_after_another_map_to_their_logits_rows():
    # vLLM 0.32: a 0, b 1-2, c 3, d 4-6
    assert place_rows(BATCH, IDS, SPEC, stride=0) == ([0, 1, 2, 4, 5, 6], [4, 5, 6, 0, 1, 2])


def test_rows_strided_per_request_map_to_their_logits_rows():
    assert place_rows(BATCH, IDS, SPEC, stride=3) == STRIDED


def test_no_structured_request_in_the_batch_places_no_row():
    assert place_rows(["x", "y"], ["a"], {}, stride=0) == ([], [])


def _case(dtype: torch.dtype, stride: int, seed: int = 7):
    rng = np.random.default_rng(seed)
    words, vocab = 40, 1270           # the last word half used, as a vocabulary rarely fills it
    total = len(IDS) * stride if stride else 7        # strided (0.33) or packed (0.32: a 1, b 2, c 1, d 3)
    bitmask = rng.integers(-2**31, 2**31, size=(total, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1                                     # all allowed
    bitmask[1, 3] = 0                                   # 32 disallowed in one word
    bitmask[2, :] = 0
    bitmask[2, 7] = 1 << 4                              # one token allowed
    logits = torch.from_numpy(rng.standard_normal((7, vocab)).astype(np.float32)).to(dtype)
    return bitmask, logits


def _expected(bitmask: np.ndarray, logits: torch.Tensor, stride: int) -> torch.Tensor:
    rows, logits_rows = place_rows(BATCH, IDS, SPEC, stride)
    out = logits.clone()
    for r, lr in zip(rows, logits_rows):
        row = out[lr:lr + 1]
        apply_token_bitmask_reference(row, torch.from_numpy(bitmask[r:r + 1].copy()))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stride", [0, 3])
def test_cpu_logits_get_each_requests_rows(dtype, stride):
    bitmask, logits = _case(dtype, stride)
    ours = logits.clone()
    apply_rows(bitmask, IDS, SPEC, BATCH, ours, stride)
    assert torch.equal(ours, _expected(bitmask, logits, stride))
    assert torch.equal(ours[3], logits[3])              # x: no grammar, untouched
    assert torch.isinf(ours).any()


def test_which_logits_maskds_kernel_takes():
    assert applies_to(torch.zeros(1, 4))
    assert not applies_to(torch.zeros(1, 4, device="meta"))


@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stride", [0, 3])
def test_cuda_logits_get_the_rows_cpu_logits_get(dtype, stride):
    assert applies_to(torch.zeros(1, 4, device="cuda"))
    bitmask, logits = _case(dtype, stride)
    on_gpu = logits.cuda()
    apply_rows(bitmask, IDS, SPEC, BATCH, on_gpu, stride)
    assert torch.equal(on_gpu.cpu(), _expected(bitmask, logits, stride))


@needs_cuda_triton
def test_cuda_apply_never_waits_for_the_gpu():
    """The rows and the logits rows are copied behind the work already queued on the stream; a
    synchronizing copy or call raises under sync debug mode."""
    bitmask, logits = _case(torch.bfloat16, 3)
    on_gpu = logits.cuda()
    apply_rows(bitmask, IDS, SPEC, BATCH, on_gpu.clone(), 3)  # Triton compiled, pinned pool warm
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)                             # the forward pass, still running
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            apply_rows(bitmask, IDS, SPEC, BATCH, on_gpu, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(on_gpu.cpu(), _expected(bitmask, logits, 3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda_triton)])
@pytest.mark.parametrize("order", ["batch", "reversed"])
def test_a_batch_whose_every_row_is_structured_gets_its_rows(device, order):
    """Every logits row has a row (the index-free case), whatever order the bitmask lists them in."""
    rng = np.random.default_rng(11)
    batch = [f"r{i}" for i in range(5)]
    ids = batch if order == "batch" else batch[::-1]
    bitmask = rng.integers(-2**31, 2**31, size=(5, 40), dtype=np.int64).astype(np.int32)
    logits = torch.from_numpy(rng.standard_normal((5, 1270)).astype(np.float32))
    expected = logits.clone()
    for k, req_id in enumerate(ids):
        i = batch.index(req_id)
        apply_token_bitmask_reference(expected[i:i + 1], torch.from_numpy(bitmask[k:k + 1].copy()))
    ours = logits.to(device)
    apply_rows(bitmask, ids, {}, batch, ours, 1)
    assert torch.equal(ours.cpu(), expected)
