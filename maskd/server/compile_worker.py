"""A compile worker process: ``python -m maskd.server.compile_worker BACKEND TOKENIZER WIDTH STACK MODE NICE``
(MODE: the server's JSON schema mode; NICE: the CPU priority it runs at, the server's compile_nice).

Reads length-prefixed pickled requests on stdin and answers on stdout (see compile_pool):
``("warm", at_once)`` loads the engine (``at_once``: at the process's own priority, for a server that
does not serve yet; lowered to NICE only after it); ``("compile", GrammarSpec)`` answers ``("ok", bytes)`` with the
serialized compiled grammar or ``("error", message)``. Where the engine loads more on the way (the
fallback's secondary engine), ``("loading", None)`` and ``("loaded", None)`` come before the
answer. The worker runs at CPU priority NICE (19, the lowest, by default); its time limit is of
CPU time (compile_pool). The compile runs on a thread with a stack of STACK bytes, the size the server's own compile
threads exceed. Anything the engine prints goes to stderr, so stdout carries only answers.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from typing import Any

from maskd.server.compile_pool import (
    _HEADER,
    read_exact,
    write_message,
)
from maskd.server.priority import lower_priority


def main(argv: list[str]) -> int:
    backend, tokenizer, width, stack = argv[0], argv[1], int(argv[2]) or None, int(argv[3])
    json_schema_mode = argv[4] if len(argv) > 4 else "strict"
    nice = int(argv[5]) if len(argv) > 5 else 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")        # the answers' channel ...
    os.dup2(2, 1)                           # ... and stdout (prints of any library) goes to stderr
    threading.stack_size(stack)
    status: list[int] = []
    # One thread of STACK bytes serves every request (a thread started per request cost its start
    # and a 64 MB stack's mapping on each compile's round trip).
    thread = threading.Thread(target=lambda: status.append(_serve_all(backend, tokenizer, width, json_schema_mode,
                                                                      nice, out)),
                              name="maskd-compile-worker")
    thread.start()
    lower_priority(nice, thread=True)      # this thread only waits (the serving one lowers itself once warm)
    thread.join()
    return status[0] if status else 1


def _serve_all(backend: str, tokenizer: str, width: int | None, json_schema_mode: str, nice: int, out) -> int:
    inp = sys.stdin.buffer.fileno()
    lowered = False
    engine: Any = None

    def load():
        nonlocal engine
        if engine is None:
            from maskd.server.engines import create_engine
            from maskd.server.tokenizers import load_tokenizer
            engine = create_engine(backend, load_tokenizer(tokenizer, width), threads=1,
                                   json_schema_mode=json_schema_mode)
            engine.load_listener = lambda phase: write_message(out, (phase, None))   # see compile_pool
        return engine

    while True:
        try:
            (size,) = _HEADER.unpack(read_exact(inp, _HEADER.size, None))
        except EOFError:
            return 0
        kind, payload = pickle.loads(read_exact(inp, size, None))
        if not lowered and not (kind == "warm" and payload):
            lower_priority(nice, thread=True)   # compiles take only what the server's step path leaves
            lowered = True
        answer: list[Any] = []
        _serve(load, kind, payload, answer)
        if not lowered:                     # loaded at once (at the start, where nothing waits on a step)
            lower_priority(nice, thread=True)
            lowered = True
        try:
            write_message(out, answer[0])
        except BrokenPipeError:   # the server is gone (or killed this worker's slot): nothing to answer
            return 0


def _serve(load, kind: str, payload: Any, answer: list) -> None:
    from maskd.server.engines import GrammarCompileError
    try:
        engine = load()
        if kind == "compile_many":      # one answer per spec, in order
            answer.append(("ok", [_compile_one(engine, spec) for spec in payload]))
            return
        answer.append(("ok", None) if kind == "warm" else ("ok", engine.serialize(engine.compile(payload))))
    except GrammarCompileError as exc:
        answer.append(("error", str(exc)))
    except Exception as exc:   # an engine bug: this grammar's compile error, the worker lives on
        answer.append(("error", f"internal compile error: {type(exc).__name__}: {exc}"))


def _compile_one(engine, spec) -> tuple[str, Any]:
    from maskd.server.engines import GrammarCompileError
    try:
        return "ok", engine.serialize(engine.compile(spec))
    except GrammarCompileError as exc:
        return "error", str(exc)
    except Exception as exc:   # an engine bug: this grammar's compile error
        return "error", f"internal compile error: {type(exc).__name__}: {exc}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
