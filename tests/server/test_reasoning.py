"""Reasoning gating as reasoning models run: free text until the end marker (a special token, or
text that may be split across tokens), then the grammar; a marker that never comes keeps the text
free and never allows EOS."""
import pytest

from conftest import allowed_ids
from maskd.server import MaskServer, ServerConfig
from maskd.server.engines import create_engine
from maskd.server.tokenizers import load_tokenizer
from maskd.specs import GrammarSpec, SpecError
from maskd_client import MaskClient, SeqStatus

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def deepseek_engine(deepseek):
    return create_engine("llguidance", deepseek, threads=1, json_schema_mode="complete")


@pytest.fixture(scope="module")
def qwen():
    tok = load_tokenizer("qwen2.5")
    return tok, create_engine("llguidance", tok, threads=1, json_schema_mode="complete")


def row(engine, m):
    out = engine.allocate(1)
    engine.fill_batch([m], [0], None, out)
    return allowed_ids(out[0])


def text_tokens(tok):
    """Tokens that are plain ASCII words: free text must allow every one of them."""
    return {i for i in range(tok.vocab_size) if not tok.ll.is_special_token(i)
            and tok.ll.decode_bytes([i]).strip().isalpha() and tok.ll.decode_bytes([i]).isascii()}


def test_special_token_marker(deepseek, deepseek_engine):
    """deepseek-v4: </think> is special token 128822; the prompt already opened the reasoning."""
    end = deepseek.encode("</think>")
    assert len(end) == 1 and deepseek.ll.is_special_token(end[0])
    m = deepseek_engine.new_matcher(deepseek_engine.compile(GrammarSpec.create("json_schema", SCHEMA,
                                                                               reasoning="</think>")))
    free = row(deepseek_engine, m)
    assert {i for i in free if deepseek.ll.is_special_token(i)} == {end[0]}   # the marker; no EOS, no others
    assert text_tokens(deepseek) <= free
    for piece in ("Let me think: {not json} ", "</th", "ink> is text here, ", "and {\"answer\": 1} too. "):
        assert m.consume(deepseek.encode(piece)) is None
        assert row(deepseek_engine, m) == free   # rows before the marker leave text free
    assert m.consume(end) is None
    body = row(deepseek_engine, m)
    assert body and all(deepseek.decode([i]).startswith("{") for i in body)
    assert m.consume(deepseek.encode('{"answer": 42}')) is None and m.is_accepting()


def test_text_marker_split_across_tokens(qwen):
    """qwen2.5: </think> is text, three tokens; any split of it ends the reasoning."""
    tok, engine = qwen
    assert len(tok.encode("</think>")) == 3
    g = engine.compile(GrammarSpec.create("json_schema", SCHEMA, reasoning=("<think>", "</think>")))
    m = engine.new_matcher(g)
    first = row(engine, m)
    assert all(b"<think>".startswith(tok.ll.decode_bytes([i])) for i in first)   # the start marker first
    assert m.consume(tok.encode("<think>") + tok.encode("so </div> and </thought> are text")) is None
    free = row(engine, m)
    assert text_tokens(tok) <= free and not (set(tok.eos_token_ids) & free)
    for split in (["</", "think", ">"], ["</th", "ink>"], ["</think", ">"]):
        m2 = engine.new_matcher(g)
        assert m2.consume(tok.encode("<think>hmm ")) is None
        for piece in split[:-1]:
            assert m2.consume(tok.encode(piece)) is None
            assert text_tokens(tok) <= row(engine, m2)   # a marker prefix is still free text
        assert m2.consume(tok.encode(split[-1])) is None
        body = row(engine, m2)
        assert body and all(tok.decode([i]).lstrip().startswith("{") or tok.decode([i]).isspace() for i in body)
        assert m2.consume(tok.encode('{"answer": 1}')) is None and m2.is_accepting()


def test_a_marker_that_never_comes(qwen):
    tok, engine = qwen
    m = engine.new_matcher(engine.compile(GrammarSpec.create("regex", "[0-9]+", reasoning="</think>")))
    words = tok.encode(" thinking") * 300
    free = row(engine, m)
    assert m.consume(words) is None
    assert row(engine, m) == free and not m.is_accepting() and not m.is_stopped()
    assert not (set(tok.eos_token_ids) & free)


def test_through_a_server_with_special_start_and_end(deepseek):
    """deepseek-v4 with both markers special: the first row allows only <think>; after </think> the
    schema; complete mode's validator sees only the document after the reasoning."""
    schema = {**SCHEMA, "properties": {"answer": {"type": "integer", "not": {"const": 13}}}}
    with MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=1, compile_threads=1)) as srv, \
            MaskClient(srv.address) as mc:
        spec = {"json_schema": schema, "reasoning": ["<think>", "</think>"]}

        def run(sid, text):
            mc.open(sid, spec)
            r = mc.step({sid: []})
            while r.seqs[sid].status is SeqStatus.WAITING:
                r = mc.step({sid: []})
            first = allowed_ids(r.bitmask[r.seqs[sid].row])
            for t in deepseek.encode(text):
                if r.seqs[sid].status is not SeqStatus.READY:
                    break
                if t not in allowed_ids(r.bitmask[r.seqs[sid].row]):
                    return first, r.seqs[sid], deepseek.decode([t])
                r = mc.step({sid: [t]})
            return first, r.seqs[sid], None

        first, good, refused = run("good", '<think>13 is unlucky, say {"answer": 13}</think>{"answer": 12}')
        assert first == set(deepseek.encode("<think>")) and refused is None
        assert good.status is SeqStatus.FINISHED and good.accepting
        # after the reasoning, 13 may not end: the row refuses the "}" (13 in the reasoning was fine)
        _, bad, refused = run("bad", '<think>fine</think>{"answer": 13}')
        assert bad.status is SeqStatus.READY and refused == "}"


@pytest.mark.parametrize("spec", [
    {"regex": "a", "reasoning": ["<think>", ""]},
    {"regex": "a", "reasoning": [1, "</think>"]},
    {"regex": "a", "reasoning": ["<think>"]},
])
def test_garbage_markers(spec):
    with pytest.raises(SpecError):
        GrammarSpec.from_dict(spec)
