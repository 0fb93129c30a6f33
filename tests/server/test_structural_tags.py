"""Structural tags (tool calls) on the default engine, token by token with the real special tokens of
the built-in tokenizers: free text until a trigger, then the tag's begin, JSON arguments per the
tool's schema, the end, free text again."""
import pytest

from conftest import allowed_ids
from maskd.server import MaskServer, ServerConfig
from maskd.server.engines import GrammarCompileError, create_engine
from maskd.server.tokenizers import load_tokenizer
from maskd.specs import GrammarSpec
from maskd_client import MaskClient, SeqStatus

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
QWEN_BEGIN = '<tool_call>\n{"name": "get_weather", "arguments": '
QWEN_END = "}\n</tool_call>"
DS_CALLS = "<｜tool▁calls▁begin｜>"
DS_BEGIN = DS_CALLS + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
DS_END = "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"


def triggered(trigger, begin, end, schema=WEATHER, **extra):
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "tags": [
        {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}],
        **extra}}


@pytest.fixture(scope="module", params=["qwen3.6", "deepseek-v4", "qwen2.5"])
def setup(request):
    tok = load_tokenizer(request.param)
    engine = create_engine("llguidance", tok, threads=1, json_schema_mode="complete")
    if request.param == "deepseek-v4":
        tag = triggered(DS_CALLS, DS_BEGIN, DS_END)
        begin, end = DS_BEGIN, DS_END
    else:
        tag = triggered("<tool_call>", QWEN_BEGIN, QWEN_END)
        begin, end = QWEN_BEGIN, QWEN_END
    args = '{"city": "Paris"}'
    return tok, engine, tag, begin, args, end


def tokens_of(engine, tok, text):
    """What the model emits for ``text``: special tokens as their ids, the rest as text tokens."""
    out = []
    for part in engine.specials.split(text):
        out += [part] if isinstance(part, int) else tok.encode(part)
    return out


def row(engine, m):
    out = engine.allocate(1)
    engine.fill_batch([m], [0], None, out)
    return allowed_ids(out[0])


def test_a_tool_call_in_free_text(setup):
    tok, engine, tag, begin, args, end = setup
    g = engine.compile(GrammarSpec.create("structural_tag", tag))
    seq = tokens_of(engine, tok, "Let me check. " + begin + args + end + " It is sunny.")
    m = engine.new_matcher(g)
    assert m.consume(seq) is None and m.is_accepting()
    bad = tokens_of(engine, tok, "Let me check. " + begin + args.replace("city", "town") + end)
    assert engine.new_matcher(g).validate(bad) < len(bad)


def test_rows_leave_text_free_until_the_trigger_then_force_the_begin(setup):
    tok, engine, tag, begin, _, _ = setup
    trigger = tag["format"]["triggers"][0]
    m = engine.new_matcher(engine.compile(GrammarSpec.create("structural_tag", tag)))
    free = row(engine, m)
    specials = {i for i in free if tok.ll.is_special_token(i)}
    trig_ids = [p for p in engine.specials.split(trigger) if isinstance(p, int)]
    assert specials == set(tok.eos_token_ids) | set(trig_ids)   # free text, EOS, the special trigger
    ascii_words = {i for i in range(tok.vocab_size) if not tok.ll.is_special_token(i)
                   and tok.ll.decode_bytes([i]).isalpha() and tok.ll.decode_bytes([i]).isascii()}
    assert ascii_words <= free
    assert m.consume(tokens_of(engine, tok, "Sure, ")) is None and row(engine, m) == free
    assert m.consume(tokens_of(engine, tok, trigger)) is None
    forced = row(engine, m)
    rest = begin[len(trigger):]
    first = engine.specials.split(rest)[0]
    if isinstance(first, int):
        assert forced == {first}
    else:
        assert forced and all(first.encode().startswith(tok.ll.decode_bytes([i])) or
                              tok.ll.decode_bytes([i]).startswith(first.encode()[:1]) for i in forced)
        assert not {i for i in forced if tok.ll.is_special_token(i)}
    assert tok.eos_token_ids[0] not in forced


def test_a_text_trigger_split_across_tokens(cl100k):
    """qwen2.5 has no <tool_call> token: the trigger is text, spelled by several tokens, and free
    text may hold its prefixes but never the whole trigger unless a call follows."""
    tok = load_tokenizer("qwen2.5")
    engine = create_engine("llguidance", tok, threads=1)
    g = engine.compile(GrammarSpec.create("structural_tag", triggered("<tool_call>", QWEN_BEGIN, QWEN_END)))
    assert len(tok.encode("<tool_call>")) > 1
    m = engine.new_matcher(g)
    assert m.consume(tok.encode("a <toolbox> and <tool")) is None   # prefixes of the trigger are text
    assert m.consume(tok.encode("_call>")) is None                   # now it is the trigger
    assert m.validate(tok.encode(" more free text")) == 0
    assert m.consume(tok.encode('\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')) is None
    assert m.is_accepting()


def test_legacy_form_separator_and_first_only(cl100k):
    engine = create_engine("llguidance", cl100k, threads=1)
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=f>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}},
         "end": "</function>"}]}
    m = engine.new_matcher(engine.compile(GrammarSpec.create("structural_tag", legacy)))
    assert m.consume(cl100k.encode('hi <function=f>{"x": 1}</function> bye <function=f>{"x": 2}</function>')) is None
    assert m.is_accepting()
    tag = {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
           "end": "</a>"}
    sep = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": [tag], "separator": ",",
                                                "at_least_one": True}}
    g = engine.compile(GrammarSpec.create("structural_tag", sep))
    assert engine.new_matcher(g).consume(cl100k.encode("<a>1</a>,<a>2</a>")) is None
    assert engine.new_matcher(g).validate(cl100k.encode("x")) == 0     # no free text between tags
    first = triggered("<f>", "<f>", "</f>", {"type": "integer"}, stop_after_first=True)
    m = engine.new_matcher(engine.compile(GrammarSpec.create("structural_tag", first)))
    assert m.consume(cl100k.encode("text <f>7</f>")) is None and m.is_stopped()


def test_other_shapes_and_garbage(cl100k):
    engine = create_engine("llguidance", cl100k, threads=1)
    seq = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "A:"}, {"type": "regex", "pattern": "[0-9]{2}"},
        {"type": "optional", "content": {"type": "const_string", "value": "!"}},
        {"type": "repeat", "min": 1, "max": 2, "content": {"type": "or", "elements": [
            {"type": "const_string", "value": "x"}, {"type": "const_string", "value": "y"}]}},
        {"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": "</t>"}]}}
    g = engine.compile(GrammarSpec.create("structural_tag", seq))
    assert engine.new_matcher(g).consume(cl100k.encode("A:12!xy<t>any </ text</t>")) is None
    assert engine.new_matcher(g).validate(cl100k.encode("A:12xyx")) < len(cl100k.encode("A:12xyx"))
    for bad, message in (({"type": "structural_tag", "format": {"type": "tag", "begin": 5}}, "expected a string"),
                         ({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"],
                                                                "tags": [{"type": "tag", "begin": "<b>", "end": "x",
                                                                          "content": {"type": "any_text"}}]}},
                          "must start with one of the triggers"),
                         ({"type": "structural_tag", "format": {"type": "token", "token": "not-special"}},
                          "not a special token"),
                         ({"type": "structural_tag", "format": {"type": "repeat", "min": 3, "max": 1,
                                                                "content": {"type": "any_text"}}}, "repeat needs"),
                         ({"type": "structural_tag", "format": "nope"}, "a format is an object")):
        with pytest.raises(GrammarCompileError, match=message):
            engine.compile(GrammarSpec.create("structural_tag", bad))


def test_tool_schema_llguidance_cannot_enforce_is_checked_when_the_call_closes():
    """Complete mode through a real server: the tool's schema uses oneOf; the grammar takes it as
    anyOf and the arguments are checked by the validator when the tag closes."""
    schema = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer", "multipleOf": 2},
                                                               {"type": "integer", "multipleOf": 3}]}},
              "required": ["n"]}
    tag = triggered("<tool_call>", '<tool_call>{"name": "f", "arguments": ', "}</tool_call>", schema)
    with MaskServer(ServerConfig(port=0, tokenizer="qwen3.6", threads=1, compile_threads=1)) as srv, \
            MaskClient(srv.address) as mc:
        tok = load_tokenizer("qwen3.6")
        engine = srv.engine

        def run(sid, text):
            mc.open(sid, {"structural_tag": tag})
            r = mc.step({sid: []})
            while r.seqs[sid].status is SeqStatus.WAITING:
                r = mc.step({sid: []})
            for t in tokens_of(engine, tok, text):
                if r.seqs[sid].status is not SeqStatus.READY:
                    break
                r = mc.step({sid: [t]})
            return r.seqs[sid]

        good = run("good", 'ok <tool_call>{"name": "f", "arguments": {"n": 4}}</tool_call> and then')
        assert good.status is SeqStatus.READY and good.accepting
        bad = run("bad", 'ok <tool_call>{"name": "f", "arguments": {"n": 6}}</tool_call>')
        assert bad.status is SeqStatus.FAILED and bad.step < len(tokens_of(engine, tok, 'ok <tool_call>{"name": "f", '
                                                                                 '"arguments": {"n": 6}}</tool_call>'))
        assert "arguments of tool call 1" in bad.reason and "do not match their JSON schema" in bad.reason
    with pytest.raises(GrammarCompileError, match="tool's JSON schema does not compile"):
        create_engine("llguidance", tok, threads=1, json_schema_mode="strict").compile(
            GrammarSpec.create("structural_tag", tag))
