"""MaskdLogitsProcessor in transformers' generate, with a tiny random Llama, the real deepseek-v4
tokenizer and a real maskd server on a loopback port."""
import json
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from maskd.server import MaskServer, ServerConfig  # noqa: E402
from maskd_client import MaskClient, SeqStatus  # noqa: E402
from maskd_client.hf import MaskdLogitsProcessor, MaskdSequenceFailed  # noqa: E402
from maskd_tools.demo import hf_tokenizer, tiny_llama, validate  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3}},
    "required": ["tags"],
    "additionalProperties": False,
}
COLOR = {"enum": ["red", "green", "blue"]}


def spec(schema):
    return {"json_schema": schema, "whitespace": "compact"}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=2, compile_threads=1)).start()
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture(scope="module")
def tok():
    return hf_tokenizer()


@pytest.fixture(scope="module")
def model(server):
    return tiny_llama(server.engine.width, seed=0, hidden_size=32, layers=1)


@pytest.fixture(scope="module")
def eos(server):
    return set(server.engine.tokenizer.eos_token_ids)


def outputs(out, prompt_len, eos):
    """(generated tokens before EOS, saw EOS) per row."""
    rows = []
    for row in out[:, prompt_len:].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        rows.append((row if end is None else row[:end], end is not None))
    return rows


class Recorder(transformers.LogitsProcessor):
    """Runs after maskd: records how many tokens each row still allows."""

    def __init__(self):
        self.allowed = []

    def __call__(self, input_ids, scores):
        self.allowed.append(torch.isfinite(scores).sum(dim=1).tolist())
        return scores


def test_outputs_validate_greedy_and_sampling(server, tok, model, eos):
    enc = tok(["Person as JSON:"], return_tensors="pt")
    for do_sample in (False, True):
        torch.manual_seed(1)
        with MaskdLogitsProcessor(server.address, spec(PERSON)) as proc:
            out = model.generate(**enc, max_new_tokens=96, do_sample=do_sample, **proc.generate_kwargs())
            assert proc.finished == [True]
        [(tokens, finished)] = outputs(out, enc["input_ids"].shape[1], eos)
        assert finished
        assert proc.tokens[0] == tokens  # only generated tokens were sent, never the prompt or EOS
        ok, why = validate(tok.decode(tokens), PERSON)
        assert ok, why


def test_without_prefetcher_and_one_spec_for_several_rows(server, tok, model, eos):
    """Only the logits processor (no stopping criteria): the step is sent when it is called.
    One spec, the batch size taken from the first call (num_return_sequences expands it)."""
    enc = tok(["Color:"], return_tensors="pt")
    torch.manual_seed(2)
    with MaskdLogitsProcessor(server.address, spec(COLOR)) as proc:
        out = model.generate(**enc, max_new_tokens=16, do_sample=True, num_return_sequences=3,
                             logits_processor=transformers.LogitsProcessorList([proc]),
                             eos_token_id=sorted(eos), pad_token_id=min(eos))
        assert proc.batch_size == 3
    for tokens, finished in outputs(out, enc["input_ids"].shape[1], eos):
        assert finished
        assert json.loads(tok.decode(tokens)) in COLOR["enum"]


def test_padded_batch_with_two_schemas(server, tok, model, eos):
    prompts = ["A person, please, as a JSON object with a name:", "Tags:"]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    assert enc["attention_mask"][1].sum() < enc["attention_mask"][0].sum()  # row 1 is padded
    rec = Recorder()
    client = MaskClient(server.address, tokenizer=server.engine.tokenizer.fingerprint, want_forced_tokens=False)
    try:
        with MaskdLogitsProcessor(client, [spec(PERSON), spec(TAGS)]) as proc:
            kw = proc.generate_kwargs()
            kw["logits_processor"].append(rec)
            out = model.generate(**enc, max_new_tokens=96, do_sample=False, **kw)
            assert proc.finished == [True, True]
            sent = [list(t) for t in proc.tokens]
        assert client.open_sequences == []  # closed on the server too
    finally:
        client.shutdown()
    rows = outputs(out, enc["input_ids"].shape[1], eos)
    lengths = [len(t) for t, _ in rows]
    assert lengths[0] != lengths[1], "want one row to finish first, so pads follow its EOS"
    for (tokens, finished), schema, sent_tokens in zip(rows, (PERSON, TAGS), sent):
        assert finished
        assert sent_tokens == tokens  # pads after EOS were not sent
        ok, why = validate(tok.decode(tokens), schema)
        assert ok, why
    # Every row of every step was masked: never all allowed, never nothing allowed.
    vocab = server.engine.width
    for step in rec.allowed:
        assert all(0 < n < vocab for n in step)


def test_beam_search_raises(server, tok, model):
    enc = tok(["JSON:"], return_tensors="pt")
    with (MaskdLogitsProcessor(server.address, [spec(PERSON)]) as proc,
          pytest.raises(ValueError, match="num_beams")):
        model.generate(**enc, max_new_tokens=8, num_beams=2, do_sample=False,
                       logits_processor=transformers.LogitsProcessorList([proc]))
    with (MaskdLogitsProcessor(server.address, spec(PERSON), batch_size=1) as proc,
          pytest.raises(ValueError, match="beam search")):
        model.generate(**enc, max_new_tokens=8, num_beams=3, do_sample=False,
                       logits_processor=transformers.LogitsProcessorList([proc]))


def test_processor_is_single_use(server, tok, model):
    enc = tok(["JSON:"], return_tensors="pt")
    with MaskdLogitsProcessor(server.address, spec(COLOR)) as proc:
        model.generate(**enc, max_new_tokens=12, **proc.generate_kwargs())
        with pytest.raises(ValueError, match="new processor"):
            model.generate(**enc, max_new_tokens=12, **proc.generate_kwargs())


def test_grammar_that_does_not_compile_fails_the_row(server, tok, model):
    enc = tok(["x", "y"], return_tensors="pt", padding=True)
    with (MaskdLogitsProcessor(server.address, [spec(COLOR), {"lark": "start: ( nope"}]) as proc,
          pytest.raises(MaskdSequenceFailed) as info):
        model.generate(**enc, max_new_tokens=8, **proc.generate_kwargs())
    assert info.value.row == 1
    assert "compile" in str(info.value)


class ForceToken(transformers.LogitsProcessor):
    """Runs after maskd and makes a token the grammar forbids the argmax at one step."""

    def __init__(self, token, at_step):
        self.token, self.at_step, self.calls = token, at_step, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.at_step:
            scores[0, self.token] = 1e9
        self.calls += 1
        return scores


def test_rejected_token_fails_the_row(server, tok, model):
    enc = tok(["JSON:"], return_tensors="pt")
    bad = tok.encode("zzz", add_special_tokens=False)[0]  # never allowed at the start of an object
    with MaskdLogitsProcessor(server.address, spec(PERSON)) as proc:
        kw = proc.generate_kwargs()
        kw["logits_processor"].append(ForceToken(bad, at_step=0))
        with pytest.raises(MaskdSequenceFailed, match="rejected") as info:
            model.generate(**enc, max_new_tokens=8, **kw)
        assert proc.statuses[0] is SeqStatus.FAILED
    assert info.value.row == 0


def test_waits_for_a_compiling_grammar(server, tok, model, eos, monkeypatch):
    """A slow compile: the processor polls (empty steps) and never applies an all-allowed mask."""
    real_compile = server.cache._compile     # the compile thread's job: make it take 0.4 s longer

    def slow_compile(entry):
        time.sleep(0.4)
        return real_compile(entry)

    monkeypatch.setattr(server.cache, "_compile", slow_compile)
    schema = dict(PERSON, title="slow one")  # a grammar the cache has not seen
    rec = Recorder()
    enc = tok(["JSON:"], return_tensors="pt")
    with MaskdLogitsProcessor(server.address, spec(schema)) as proc:
        kw = proc.generate_kwargs()
        kw["logits_processor"].append(rec)
        out = model.generate(**enc, max_new_tokens=96, do_sample=False, **kw)
        assert proc.polls > 0
        assert proc.wait_seconds[0] >= 0.3
    vocab = server.engine.width
    assert all(0 < n < vocab for step in rec.allowed for n in step)
    [(tokens, finished)] = outputs(out, enc["input_ids"].shape[1], eos)
    assert finished
    ok, why = validate(tok.decode(tokens), schema)
    assert ok, why


def test_bad_arguments(server):
    with pytest.raises(TypeError):
        MaskdLogitsProcessor(42, spec(COLOR))
    with pytest.raises(ValueError):
        MaskdLogitsProcessor(server.address, [])
    with pytest.raises(ValueError):
        MaskdLogitsProcessor(server.address, [spec(COLOR)], batch_size=2)
