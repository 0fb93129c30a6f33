"""vLLM logits processors over maskd.

    MASKD_TARGET=maskd:50051 vllm serve MODEL        # Model Runner V2 loads the entry point itself

A request asks for a grammar in ``extra_args["maskd"]``, in any shape ``GrammarSpec.from_request``
takes (maskd's dict, vLLM's ``structured_outputs`` keys, OpenAI's ``response_format``, SGLang's
keys), or that object's JSON text (the OpenAI server's ``vllm_xargs`` carry no objects).
``validate_params`` parses it at admission, so a malformed spec fails that request with HTTP 400
and the engine never sees it.

* :class:`MaskdLogitsProcessor` implements Model Runner V2's interface (vLLM's default) and is the
  ``vllm.logits_processors`` entry point of this package. Built V1-style (``vllm_config, device,
  is_pin_memory``) it returns a :class:`MaskdV1LogitsProcessor` instead, so the same entry point
  serves both runners; ``--logits-processors maskd_client.vllm:MaskdV1LogitsProcessor`` names the
  V1 class directly.
* V2: ``add_request`` records a request's grammar on its slot; ``apply_staged_writes`` (once per
  step, before the forward pass) enqueues, on the device's stream, a gather of the slots' newest
  tokens and lengths (the tokens sampled last step are written there by the model runner) and a
  non-blocking copy to pinned host memory; a helper thread waits for that copy's event (the
  engine's thread never waits for the device) and sends the maskd step at once, so the server
  works while the model runs; ``apply`` waits for the rows and masks the batch's logits rows.
* V1: ``update_state`` (before the forward pass) reads the new tokens from the host token lists
  vLLM shares with the processor and sends the step; ``apply`` waits and masks.

What the processor interfaces cannot express, and what this adapter does instead:

* A request whose grammar is still compiling cannot be kept out of the batch (SGLang and vLLM's
  own structured outputs can). ``apply`` polls the server until the row is ready
  (``MASKD_WAIT_TIMEOUT_S``): the whole batch waits, never an all-allowed row. Register grammars
  ahead (``maskd_client.MaskClient.register``) or use the llguidance backend (compiles in ms).
* One request cannot be failed. A sequence the server fails (a rejected token, a grammar that
  does not compile, the wait above running out) gets an EOS-only row from then on: its request
  ends at once with finish reason "stop" and an output that is cut short. The reason is logged at
  ERROR and counted in ``failed``.
* There is no removal hook (V2 slots are reused): a finished request's sequence is closed when its
  slot is reused or after it generated EOS.
* Speculative decoding is refused at start (the draft tokens of a step are not visible before the
  forward pass); tensor parallelism works: every rank's processor asks on one shared session.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate
from vllm.v1.sample.logits_processor.interface import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

from maskd.specs import GrammarSpec, SpecError
from maskd_client.apply import BitmaskBuffers, apply_token_bitmask_inplace
from maskd_client.engine_env import EngineSettings, settle
from maskd_client.types import MaskClientError, SeqResult, StepResult

__all__ = ["EXTRA_ARGS_KEY", "MaskdLogitsProcessor", "MaskdV1LogitsProcessor", "spec_of"]

EXTRA_ARGS_KEY = "maskd"
log = logging.getLogger("maskd_client.vllm")


def spec_of(sampling_params: Any) -> GrammarSpec | None:
    """The request's grammar from ``extra_args["maskd"]`` (None: not constrained by maskd)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    value = extra.get(EXTRA_ARGS_KEY)
    if value is None:
        return None
    try:
        if isinstance(value, str):   # over HTTP (vllm_xargs take no objects): the spec's JSON text
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise SpecError(f"a string is the JSON text of a spec: {exc}") from None
        return GrammarSpec.from_request(value)
    except SpecError as exc:
        raise ValueError(f'extra_args["{EXTRA_ARGS_KEY}"]: {exc}') from None


def _validate(sampling_params: Any) -> None:
    if spec_of(sampling_params) is not None:
        EngineSettings.from_env()      # a request for maskd on an engine that cannot reach it


class _Slot:
    __slots__ = ("done", "length", "seq_id", "spec")

    def __init__(self, seq_id: str, spec: GrammarSpec, length: int) -> None:
        self.seq_id = seq_id
        self.spec = spec
        self.length = length     # tokens of the request the server has seen (prompt included)
        self.done = False        # EOS generated, or failed: EOS-only rows, never sent again


class _MaskdBatch:
    """What both processor interfaces share: slots -> maskd sequences, the step, the rows."""

    def __init__(self, session: str, max_slots: int, device: torch.device) -> None:
        self.settings = EngineSettings.from_env()
        self.client = self.settings.client(session)
        info = self.client.info()
        self.words = info.words_per_row
        self.eos_ids = frozenset(info.eos_token_ids)
        self.eos_row = np.zeros(self.words, dtype=np.uint32)
        for t in info.eos_token_ids:
            self.eos_row[t >> 5] |= np.uint32(1) << np.uint32(t & 31)
        self.eos_row = self.eos_row.view(np.int32)
        self.rows = np.full((max_slots, self.words), -1, dtype=np.int32)   # each slot's current row
        self.slots: dict[int, _Slot] = {}
        self.generation = [0] * max_slots
        self.buffers = BitmaskBuffers(max_slots, self.words, device=device)
        self.failed: dict[str, str] = {}     # seq id -> reason, for sequences given up
        self.steps = 0
        self.polls = 0

    # -- slots ------------------------------------------------------------------------------------
    def add(self, slot: int, spec: GrammarSpec | None, length: int) -> bool:
        self.remove(slot)
        self.generation[slot] += 1   # the same on every rank: ids agree across tensor-parallel ranks
        if spec is None:
            return False
        seq_id = f"slot{slot}-{self.generation[slot]}"
        self.client.open(seq_id, spec)
        self.slots[slot] = _Slot(seq_id, spec, length)
        self.rows[slot] = -1
        return True

    def remove(self, slot: int) -> None:
        old = self.slots.pop(slot, None)
        if old is not None and not old.done:
            self._close(old.seq_id)

    def _close(self, seq_id: str) -> None:
        try:
            self.client.close(seq_id)
        except MaskClientError as exc:
            log.debug("closing %s: %s", seq_id, exc)

    # -- the step -----------------------------------------------------------------------------------
    def step(self, new_tokens: dict[int, list[int]], opened: Iterable[int] = ()) -> None:
        """Sends the tokens generated since the last step (and the opens), waits, stores the rows.
        Runs off the engine's thread in V2, on it in V1 (where the host has the tokens)."""
        request: dict[str, list[int]] = {}
        slot_of: dict[str, int] = {}
        for slot in set(opened) | set(new_tokens):
            state = self.slots.get(slot)
            if state is None or state.done:
                continue
            tokens = list(new_tokens.get(slot, ()))
            eos_at = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
            if eos_at is not None:            # the request ends here: nothing follows EOS
                state.done = True
                self.rows[slot] = self.eos_row
                self._close(state.seq_id)
                continue
            request[state.seq_id] = tokens
            slot_of[state.seq_id] = slot
        if not request:
            return
        self.polls += settle(self._send(request), slot_of, self._send, self.settings.wait_timeout_s,
                             self._take_row, self._give_up)

    def _take_row(self, slot: int, res: SeqResult, result: StepResult) -> None:
        self.rows[slot] = result.bitmask[res.row]

    def _send(self, request: dict) -> StepResult:
        self.steps += 1
        return self.client.step_async(request).result(self.settings.timeout_s + 5)

    def _give_up(self, slot: int, reason: str) -> None:
        state = self.slots[slot]
        state.done = True
        self.failed[state.seq_id] = reason
        self.rows[slot] = self.eos_row
        log.error("maskd sequence %s (slot %d) failed: %s; its request ends here (EOS-only row)",
                  state.seq_id, slot, reason)
        self._close(state.seq_id)

    # -- masks ---------------------------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, slots: np.ndarray) -> None:
        """Masks logits row i with the row of ``slots[i]``, for the rows that have a grammar."""
        rows = [i for i, s in enumerate(slots.tolist()) if s in self.slots]
        if not rows:
            return
        if logits.shape[0] != len(slots):
            raise RuntimeError(f"{logits.shape[0]} logits rows for {len(slots)} requests: maskd's logits processor "
                               "takes one row per request (speculative decoding is not supported)")
        bitmask = self.buffers.upload(self.rows[slots])
        apply_token_bitmask_inplace(logits, bitmask, indices=rows)

    def shutdown(self) -> None:
        self.client.shutdown()


def _refuse_speculative(vllm_config: Any) -> None:
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and getattr(spec, "num_speculative_tokens", None):
        raise ValueError("maskd's vLLM logits processor does not support speculative decoding: the draft tokens "
                         "of a step are not visible before its forward pass")


def _session(vllm_config: Any) -> str:
    """A key every rank of one engine computes alike (its config, instance id included, is shared)."""
    instance = getattr(vllm_config, "instance_id", "") or "engine"
    dp = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)
    return f"vllm-{instance}-dp{dp}"


def _max_slots(vllm_config: Any, default: int) -> int:
    return int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None) or default)


class MaskdLogitsProcessor(V2LogitsProcessor):
    """Model Runner V2 processor (the entry point); V1 construction returns MaskdV1LogitsProcessor."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any):
        if args and isinstance(args[0], (torch.device, str)):     # V1: (vllm_config, device, is_pin_memory)
            return MaskdV1LogitsProcessor(vllm_config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        _refuse_speculative(vllm_config)
        self.vllm_config = vllm_config
        self.req_states = req_states
        self.device = req_states.device
        self._session = _session(vllm_config)
        self._batch: _MaskdBatch | None = None          # created by the first maskd request
        self._opened: set[int] = set()
        self._resumed: dict[int, tuple[int, int]] = {}   # slot -> (prompt, prefill) of resumed requests
        self._pending: concurrent.futures.Future | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maskd-vllm")
        self._lock = threading.Lock()

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        _validate(sampling_params)

    @property
    def batch(self) -> _MaskdBatch:
        if self._batch is None:
            self._batch = _MaskdBatch(self._session, self.req_states.max_num_reqs, self.device)
        return self._batch

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        spec = spec_of(sampling_params)
        if spec is None and self._batch is None:
            return False
        self._wait_pending()       # the helper thread must not see a slot change under it
        length = int(self.req_states.prefill_len.np[req_idx])
        prompt = int(self.req_states.prompt_len.np[req_idx])
        used = self.batch.add(req_idx, spec, prompt)
        if used:
            self._opened.add(req_idx)
            if length > prompt:    # resumed after preemption: its output so far comes with the open
                self._resumed[req_idx] = (prompt, length)
        else:
            self._opened.discard(req_idx)
            self._resumed.pop(req_idx, None)
        return used

    def apply_staged_writes(self) -> None:
        """Before the forward pass: the newest tokens of every maskd slot go to the host (no device
        sync here) and the step goes out from the helper thread as soon as they land."""
        if self._batch is None or not self._batch.slots:
            return
        self._wait_pending()
        batch = self._batch
        live = sorted(s for s, st in batch.slots.items() if not st.done)
        if not live:
            return
        window = 1
        resumed, self._resumed = self._resumed, {}
        slots = torch.tensor(live, dtype=torch.long)
        dev_slots = slots.to(self.device, non_blocking=True)
        lengths = self.req_states.total_len.gpu.index_select(0, dev_slots).long()
        positions = (lengths[:, None] - window + torch.arange(window, device=self.device)).clamp_(min=0)
        tokens = self.req_states.all_token_ids.gpu[dev_slots[:, None], positions]
        packed = torch.cat([lengths[:, None].to(tokens.dtype), tokens], dim=1)
        histories = {s: self.req_states.all_token_ids.gpu[s, a:b] for s, (a, b) in resumed.items()}
        host, ready = _to_host(packed, [*histories.values()])
        opened, self._opened = self._opened, set()
        hist_slots = list(histories)
        self._pending = self._executor.submit(self._send, live, host, ready, opened, hist_slots, window)

    def _send(self, live: list[int], host: list[torch.Tensor], ready: Any, opened: set[int],
              hist_slots: list[int], window: int) -> None:
        if ready is not None:
            ready.synchronize()                          # the helper thread waits, not the engine's
        packed = host[0].numpy()
        histories = {s: host[1 + k].tolist() for k, s in enumerate(hist_slots)}
        batch = self._batch
        assert batch is not None
        new: dict[int, list[int]] = {}
        for k, slot in enumerate(live):
            state = batch.slots.get(slot)
            if state is None:
                continue
            length = int(packed[k, 0])
            if slot in histories:
                new[slot] = histories[slot]
                state.length += len(histories[slot])
            grew = length - state.length
            if grew > window:
                batch._give_up(slot, f"{grew} tokens appeared in one step; at most {window} were expected")
                continue
            if grew > 0:
                new[slot] = new.get(slot, []) + [int(t) for t in packed[k, 1 + window - grew:]]
                state.length = length
        batch.step(new, opened)

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if self._batch is None:
            return logits
        self._wait_pending()
        self._batch.mask(logits, np.asarray(ctx.idx_mapping_np))
        return logits

    @property
    def failed(self) -> dict[str, str]:
        return {} if self._batch is None else dict(self._batch.failed)

    def close(self) -> None:
        self._wait_pending()
        self._executor.shutdown(wait=False)
        if self._batch is not None:
            self._batch.shutdown()


def _to_host(packed: torch.Tensor, extra: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """Copies to (pinned) host memory without waiting; the event says when they have landed."""
    if packed.device.type != "cuda":
        return [packed.cpu(), *(t.cpu() for t in extra)], None
    outs = []
    for t in (packed, *extra):
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        outs.append(out)
    event = torch.cuda.Event()
    event.record()
    return outs, event


class MaskdV1LogitsProcessor(V1LogitsProcessor):
    """vLLM V1 interface (``--logits-processors maskd_client.vllm:MaskdV1LogitsProcessor``)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        _refuse_speculative(vllm_config)
        self.device = torch.device(device)
        self._session = _session(vllm_config)
        self._max = _max_slots(vllm_config, 1024)
        self._batch: _MaskdBatch | None = None
        self._outputs: dict[int, list[int]] = {}     # slot -> vLLM's live output token list
        self._batch_size = 0

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        _validate(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    @property
    def batch(self) -> _MaskdBatch:
        if self._batch is None:
            self._batch = _MaskdBatch(self._session, self._max, self.device)
        return self._batch

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        opened: set[int] = set()
        if batch_update is not None:
            self._batch_size = batch_update.batch_size
            for index in batch_update.removed:
                self._outputs.pop(index, None)
                if self._batch is not None:
                    self._batch.remove(index)
            for index, params, _prompt, output in batch_update.added:
                spec = spec_of(params)
                self._outputs.pop(index, None)
                if spec is None and self._batch is None:
                    continue
                if self.batch.add(index, spec, 0):
                    self._outputs[index] = output
                    opened.add(index)
            for a, b, direction in batch_update.moved:
                self._move(a, b, swap=direction.name == "SWAP")
        if self._batch is None or not self._batch.slots:
            return
        new = {}
        for index, output in self._outputs.items():
            state = self._batch.slots.get(index)
            if state is not None and len(output) > state.length:
                new[index] = list(output[state.length:])
                state.length = len(output)
        self._batch.step(new, opened)

    def _move(self, a: int, b: int, *, swap: bool) -> None:
        batch = self.batch
        sa, sb = batch.slots.pop(a, None), batch.slots.pop(b, None)
        ra, rb = batch.rows[a].copy(), batch.rows[b].copy()
        oa, ob = self._outputs.pop(a, None), self._outputs.pop(b, None)
        if sa is not None:
            batch.slots[b] = sa
        if oa is not None:
            self._outputs[b] = oa
        batch.rows[b] = ra
        if swap:
            if sb is not None:
                batch.slots[a] = sb
            if ob is not None:
                self._outputs[a] = ob
            batch.rows[a] = rb
        elif sb is not None and not sb.done:
            batch._close(sb.seq_id)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._batch is not None and self._batch.slots:
            self._batch.mask(logits, np.arange(logits.shape[0]))
        return logits

    @property
    def failed(self) -> dict[str, str]:
        return {} if self._batch is None else dict(self._batch.failed)

    def close(self) -> None:
        if self._batch is not None:
            self._batch.shutdown()
