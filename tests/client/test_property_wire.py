"""Property: whatever a sampler picks under the masks a real maskd server sends, every output
that ends with EOS is valid for its schema.

A fixed-seed sample of MaskBench-dev schemas, several sequences per schema (greedy and
temperature sampling over random logits), all sequences of the sample batched in one step per
token through an embedded server on a loopback port, a budget of 200 tokens per sequence.
Outputs are checked with ``jsonschema`` (format assertions off). The server runs in the default
complete mode: where its grammar is a relaxation, a document that can no longer pass is ended by
the validator (counted), and none of those ever ends with EOS. Schemas that jsonschema cannot
check (bad schema, unknown meta-schema, unresolvable ``$ref``) or that the engine does not
compile are skipped and counted.

The random logits carry a bias towards tokens that close strings, arrays and objects (and EOS),
so that many sequences finish within the budget; without it almost no string ever ends.
"""
import json
import pathlib
import random
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("referencing")
import referencing.exceptions  # noqa: E402

from maskd.server import Limits, MaskServer, ServerConfig  # noqa: E402
from maskd_client import MaskClient, SeqStatus  # noqa: E402
from maskd_client.apply import apply_token_bitmask_inplace  # noqa: E402

MASKBENCH = pathlib.Path(__file__).parents[2] / ".." / "shared" / "maskbench-dev"
N_FILES = 28
SEED = 20240611
BUDGET = 200
# (greedy, temperature, closer bias) per sequence of a schema.
MODES = [(True, 1.0, 4.0), (False, 1.0, 6.0), (False, 0.7, 3.0)]

pytestmark = [
    pytest.mark.maskbench,
    pytest.mark.skipif(not MASKBENCH.is_dir(), reason="needs ../shared/maskbench-dev (MaskBench-dev files)"),
]


def _checker(schema):
    """A jsonschema validator for the schema, or (None, why) when jsonschema cannot check it."""
    if not isinstance(schema, (dict, bool)):
        return None, "not a schema"
    if (isinstance(schema, dict) and "$schema" in schema
            and jsonschema.validators.validator_for(schema, default=None) is None):
        return None, f"unknown meta-schema {schema['$schema']!r}"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        return None, f"check_schema: {exc.message[:80]}"
    return cls(schema), ""  # no format_checker: format assertions off


def _closer_ids(tok):
    """Tokens that only close things (quote, bracket, brace), plus EOS."""
    ids = []
    for i in range(tok.vocab_size):
        b = tok.ll.decode_bytes([i])
        if b and all(c in b'"}]' for c in b):
            ids.append(i)
    return sorted(set(ids) | set(tok.eos_token_ids))


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=2, compile_threads=2,
                                  limits=Limits(compile_timeout_s=20.0))).start()
    yield srv
    srv.stop(grace=1.0)


def test_finished_outputs_validate(server):
    t_start = time.perf_counter()
    tok = server.engine.tokenizer
    width = server.engine.width
    eos = set(tok.eos_token_ids)
    files = sorted(MASKBENCH.glob("*.json"))
    sample = random.Random(SEED).sample(files, min(N_FILES, len(files)))

    checkers, skipped = {}, {}
    for path in sample:
        schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
        checker, why = _checker(schema)
        if checker is None:
            skipped[path.name] = why
        else:
            checkers[path.name] = (schema, checker)

    closers = np.asarray(_closer_ids(tok))
    client = MaskClient(server.address, tokenizer=tok.fingerprint, want_forced_tokens=False)
    seqs = {}  # seq_id -> dict(name, greedy, temp, bias, tokens)
    for name, (schema, _) in checkers.items():
        for k, (greedy, temp, b) in enumerate(MODES):
            sid = f"{name}#{k}"
            client.open(sid, {"json_schema": schema})
            # Each sequence draws from its own generator: its output does not depend on which
            # other sequences share its steps (compiles finish in any order).
            rng = np.random.default_rng([SEED, len(seqs)])
            seqs[sid] = {"name": name, "greedy": greedy, "temp": temp, "bias": b, "rng": rng,
                         "tokens": [], "next": []}

    live = set(seqs)
    finished, failures, compile_failed, out_of_budget = [], [], set(), 0
    cannot_pass = []   # complete mode: the validator ended a document that could no longer pass
    steps = 0
    deadline = time.monotonic() + 180  # a safety net only: compiles time out after 20 s
    try:
        while live:
            assert time.monotonic() < deadline, f"still {len(live)} live sequences after 180 s"
            steps += 1
            order = sorted(live)
            result = client.step({sid: seqs[sid]["next"] for sid in order})
            ready, rows = [], []
            for sid in order:
                res = result.seqs[sid]
                s = seqs[sid]
                s["next"] = []
                if res.status is SeqStatus.WAITING:
                    continue  # asked again next step, with no tokens
                if res.status is SeqStatus.FAILED:
                    live.discard(sid)
                    if not s["tokens"]:
                        compile_failed.add(s["name"])  # the engine does not take this schema
                    elif "does not match the JSON schema" in res.reason:
                        # complete mode: the grammar is a relaxation, the validator ended a document
                        # that cannot pass any more; it never ends with EOS
                        cannot_pass.append(sid)
                    else:
                        failures.append(f"{sid}: a token sampled under the mask was rejected: {res.reason}")
                    continue
                assert res.has_rows, f"{sid}: {res.status} {res.reason}"
                if len(s["tokens"]) >= BUDGET:
                    live.discard(sid)
                    out_of_budget += 1
                    continue
                s["finished_status"] = res.status is SeqStatus.FINISHED
                s["accepting"] = res.accepting
                ready.append(sid)
                rows.append(res.row)
            if not ready:
                time.sleep(0.005)  # only grammars still compiling
                continue
            noise = np.empty((len(ready), width), dtype=np.float32)
            gumbel = np.zeros((len(ready), width), dtype=np.float32)
            for i, sid in enumerate(ready):
                s = seqs[sid]
                noise[i] = s["rng"].standard_normal(width, dtype=np.float32)
                noise[i, closers] += s["bias"]
                if not s["greedy"]:
                    u = s["rng"].random(width, dtype=np.float32)
                    np.maximum(u, np.float32(1e-30), out=u)  # random() may return 0
                    gumbel[i] = -np.log(-np.log(u))
            logits = torch.from_numpy(noise)
            bitmask = torch.from_numpy(np.ascontiguousarray(result.bitmask[rows]))
            apply_token_bitmask_inplace(logits, bitmask)
            # Sampling at temperature T is the argmax of logits / T plus Gumbel noise; greedy rows
            # have no noise and T = 1.
            temps = torch.tensor([seqs[sid]["temp"] for sid in ready])[:, None]
            picks = (logits / temps + torch.from_numpy(gumbel)).argmax(dim=-1).tolist()
            words = result.bitmask[rows, np.asarray(picks) >> 5]
            allowed = (words >> (np.asarray(picks) & 31)) & 1
            for sid, tok_id, ok in zip(ready, picks, allowed):
                s = seqs[sid]
                assert ok, f"{sid}: sampled token {tok_id}, which its mask forbids"
                if tok_id in eos:
                    assert s["accepting"], f"{sid}: EOS allowed while the grammar is not accepting"
                    live.discard(sid)
                    finished.append(sid)
                    continue
                assert not s["finished_status"], f"{sid}: FINISHED row allowed non-EOS token {tok_id}"
                s["tokens"].append(tok_id)
                s["next"] = [tok_id]
    finally:
        for sid in list(client.open_sequences):
            client.close(sid)
        client.shutdown()

    invalid = []
    for sid in finished:
        s = seqs[sid]
        schema, checker = checkers[s["name"]]
        raw = tok.decode_bytes(s["tokens"])
        try:
            text = raw.decode("utf-8")
            value = json.loads(text)
        except ValueError as exc:
            invalid.append(f"{sid}: not JSON ({exc}): {raw[:200]!r}")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                error = jsonschema.exceptions.best_match(checker.iter_errors(value))
        except referencing.exceptions.Unresolvable as exc:  # remote or unknown $ref
            skipped[s["name"]] = f"unresolvable $ref: {str(exc)[:80]}"
            continue
        if error is not None:
            invalid.append(f"{sid}: {error.message[:200]} in {text[:300]}")

    checked = [sid for sid in finished if seqs[sid]["name"] not in skipped]
    names = {seqs[sid]["name"] for sid in checked}
    summary = (f"{len(sample)} files: {len(names)} schemas with a checked output; "
               f"{len(checkers)} checkable, {len(compile_failed)} not compiled by the "
               f"engine, {len(seqs)} sequences, {len(finished)} finished, {len(checked)} checked, "
               f"{out_of_budget} out of budget, {len(cannot_pass)} ended by the validator, {steps} steps, "
               f"{time.perf_counter() - t_start:.1f} s; "
               f"skipped: {skipped}")
    print(summary)
    assert not failures, "\n".join(failures)
    assert not invalid, summary + "\n" + "\n".join(invalid)
    # Not vacuous: most schemas produce at least one finished, checked output.
    names_checked = {seqs[sid]["name"] for sid in checked}
    assert len(names_checked) >= len(checkers) // 2, summary + f"; {len(names_checked)} schemas checked"
