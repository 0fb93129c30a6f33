"""One tensor-parallel rank (a process of its own): SGLang's grammar backend from the registry, on
the session every rank shares, decoding the same batch as the other ranks. After every step the
ranks all-gather their masks (torch.distributed, gloo, loopback) and each checks they are equal.

The gate file protocol with the test process: once every rank has registered its grammars, rank 0
writes ``registered``; the test blocks the server's compile thread and writes ``gate``; then every
rank opens a request on a grammar nobody registered, which waits for its compile on the server.
"""
from __future__ import annotations

import json
import os
import pathlib
import time


def run(rank: int, world: int, target: str, port: int, workdir: str, docs: list, retry_rank: int) -> None:
    os.environ["MASKD_TARGET"] = target
    os.environ["MASKD_SESSION"] = f"tp-{world}"
    os.environ["MASKD_WAIT_TIMEOUT_S"] = "30"
    import torch
    import torch.distributed as dist
    from sglang_drive import backend_from_registry, compile, masks

    from maskd.server.tokenizers import load_tokenizer
    from maskd_client.sglang import GrammarSpec, SglangMaskdGrammar

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    work = pathlib.Path(workdir)
    tok = load_tokenizer("cl100k")
    eos = tok.eos_token_ids[0]
    backend = backend_from_registry(tok.ll.vocab_size, tok.eos_token_ids)
    requests = []                                      # [grammar, tokens, position]
    for schema, doc in docs:
        grammar, error = compile(backend, ("json", json.dumps(schema)))
        assert error is None, error
        requests.append([grammar, tok.encode(doc), 0])
    dist.barrier()
    if rank == 0:
        (work / "registered").touch()
    deadline = time.time() + 60
    while not (work / "gate").exists():
        assert time.time() < deadline, "the test never closed the compile gate"
        time.sleep(0.01)
    dist.barrier()
    # a grammar nobody registered (no id: its open carries the spec, and the server compiles it then)
    late = SglangMaskdGrammar(backend, GrammarSpec.from_request({"regex": "[0-9]{3}-[a-z]{2}"}), "")
    requests.append([late, tok.encode("123-ab"), 0])

    report = {"polls_per_step": [], "steps": 0}
    step = 0
    while any(r[2] <= len(r[1]) for r in requests):
        live = [r for r in requests if r[2] <= len(r[1])]
        if step % world == rank:
            time.sleep(0.03 * (1 + step % 3))          # this rank lags behind the others this step
        if rank == retry_rank and step == 3:           # this rank loses its stream: the client restores and retries
            stream = next(iter(backend.client._streams.values()))
            stream._call.cancel()
        polls = backend.polls
        mask = masks([r[0] for r in live], tok.ll.vocab_size)
        report["polls_per_step"].append(backend.polls - polls)
        gathered = [torch.empty_like(mask) for _ in range(world)]
        dist.all_gather(gathered, mask)
        for other, m in enumerate(gathered):
            assert torch.equal(m, mask), f"rank {rank}: rows differ from rank {other}'s at step {step}"
        for r in live:
            grammar, tokens, pos = r
            if pos < len(tokens):
                word = int(mask[live.index(r)][tokens[pos] >> 5])
                assert (word >> (tokens[pos] & 31)) & 1, f"valid token refused at step {step}"
                grammar.accept_token(tokens[pos])
            else:
                grammar.accept_token(eos)
                assert grammar.is_terminated()
                grammar.finished = True
            r[2] = pos + 1
        step += 1
    report["steps"] = step
    report["maskd_steps"] = backend.steps
    report["reopen_steps"] = backend.reopen_steps
    report["recoveries"] = backend.client.recoveries
    report["replays"] = backend.client.replays
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        (work / "reports.json").write_text(json.dumps(reports))
    backend.client.flush_closes()
    dist.barrier()
    backend.shutdown()
    dist.destroy_process_group()
