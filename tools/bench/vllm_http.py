"""``maskd bench vllm``'s HTTP side: requests streamed to a ``vllm serve`` engine, ``concurrency`` at
a time, each timed chunk by chunk (time to first token, the gaps between chunks, to its end)."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from maskd_tools.vllm_serve import MODEL  # the served model's name, whichever model it is


def constraint(mode: str, schema: dict, compact: bool) -> dict:
    """A request's fields that ask ``mode`` for JSON under ``schema``: maskd through ``vllm_xargs``,
    vLLM's own backend through ``structured_outputs``, nothing for unconstrained."""
    if mode == "unconstrained":
        return {}
    if mode == "maskd":
        return {"vllm_xargs": {"maskd": json.dumps({"json": schema, "disable_any_whitespace": compact})}}
    return {"structured_outputs": {"json": schema}}


def send(url: str, body: Callable[[int], dict], concurrency: int, n: int, streaming: threading.Event | None = None,
         stop: threading.Event | None = None) -> tuple[dict[int, dict], float]:
    """``n`` streaming requests (fewer once ``stop`` is set), ``concurrency`` at a time, request i's body
    ``body(i)`` (the served model's name, streaming and usage added): ({i: its result (``stream``)},
    wall seconds). ``streaming`` is set once a first token came back."""
    host, port = url.removeprefix("http://").split(":")
    numbers = iter(range(n))
    lock = threading.Lock()
    done: dict[int, dict] = {}

    def client() -> None:   # one of ``concurrency``: the next request until none is left or ``stop``
        while stop is None or not stop.is_set():
            with lock:
                i = next(numbers, None)
            if i is None:
                return
            request = {"model": MODEL, **body(i), "stream": True, "stream_options": {"include_usage": True}}
            done[i] = stream(host, int(port), request, streaming)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    return done, time.perf_counter() - t0


def count(values: Iterable) -> dict:
    """How many times each value occurs."""
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def stream(host: str, port: int, body: dict, streaming: threading.Event | None = None) -> dict:
    """One streaming request (a chat request where the body has messages): completion tokens, the
    time to the first text (or tool-call delta, which a tool parser holds until it read the call's
    name), the gaps between the later ones, the text, the finish reason, the seconds to its end, an error;
    where a chat request asks for logprobs, the text token by token (``pieces``); the response's ``id``
    and when it was sent (``t0``, ``time.monotonic``)."""
    res: dict[str, Any] = {"tokens": 0, "ttft": None, "gaps": [], "text": "", "finish": None, "elapsed": None,
                           "error": None, "pieces": [], "id": None, "t0": None}
    conn = http.client.HTTPConnection(host, port, timeout=600)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    t0 = res["t0"] = time.monotonic()     # (the clock vllm_timeline's stamps use, in every process)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            res["error"] = f"HTTP {reply.status}: {reply.read()[:300]!r}"
            return res
        last = None
        parts = []
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.monotonic()
            res["id"] = res["id"] or chunk.get("id")
            if chunk.get("usage"):
                res["tokens"] = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                res["pieces"] += [x["token"] for x in (choice.get("logprobs") or {}).get("content") or ()]
                text = choice.get("text") or delta.get("content")
                if text or delta.get("tool_calls"):
                    parts.append(text or "")
                    if last is None:
                        res["ttft"] = now - t0
                        if streaming is not None:
                            streaming.set()
                    else:
                        res["gaps"].append(now - last)
                    last = now
                if choice.get("finish_reason"):
                    res["finish"] = choice["finish_reason"]
        res["text"] = "".join(parts)
        res["elapsed"] = time.monotonic() - t0
    except (OSError, http.client.HTTPException, ValueError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return res
