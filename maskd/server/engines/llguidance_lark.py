"""Lark text for llguidance: literals that name special tokens, reasoning prefixes, structural tags.

A literal (a reasoning marker, a tag's begin or end, a trigger) that is the name of one of the
tokenizer's special tokens is that token (``<[id]>``), as the model emits it; any other text is
a string literal, which the model may spell with any tokens (a marker split across tokens).

Structural tags (xgrammar's format: ``{"type": "structural_tag", "format": ...}``, and the
legacy ``{"structures": [...], "triggers": [...]}``) are translated here for llguidance. Formats:
``const_string``, ``json_schema`` (style "json"), ``any_text``, ``regex``, ``sequence``, ``or``,
``tag``, ``triggered_tags``, ``token_triggered_tags``, ``tags_with_separator``, ``optional``,
``plus``, ``star``, ``repeat``, ``token``. Free text between tags never contains a trigger (after
a trigger, one of its tags must follow). Other formats, and json_schema styles other than "json"
(the XML argument styles), are refused as UnsupportedSpec naming them: the server's llguidance
backend then compiles the spec with xgrammar (engines/fallback.py).
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

from maskd.server.engines.base import GrammarCompileError, UnsupportedSpec

SPECIAL_MARK = b"\xff"


class Specials:
    """The tokenizer's special tokens by name."""

    def __init__(self, tokenizer) -> None:
        ll = tokenizer.ll
        self.ids: dict[str, int] = {}
        for i in range(tokenizer.vocab_size):
            if ll.is_special_token(i):
                name = ll.decode_bytes([i]).decode("utf-8", "replace")
                if name:
                    self.ids.setdefault(name, i)
        self._by_first: dict[str, list[str]] = {}
        for name in sorted(self.ids, key=len, reverse=True):
            self._by_first.setdefault(name[0], []).append(name)

    def split(self, text: str) -> list[str | int]:
        """``text`` as runs of plain text and special token ids."""
        out: list[str | int] = []
        i = start = 0
        while i < len(text):
            name = next((n for n in self._by_first.get(text[i], ()) if text.startswith(n, i)), None)
            if name is None:
                i += 1
                continue
            if i > start:
                out.append(text[start:i])
            out.append(self.ids[name])
            i = start = i + len(name)
        if start < len(text):
            out.append(text[start:])
        return out

    def has_special(self, text: str) -> bool:
        return any(isinstance(p, int) for p in self.split(text))

    def lark(self, text: str) -> str:
        """A Lark expression matching ``text`` (special tokens as tokens); "" for empty text."""
        return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p, ensure_ascii=False)
                        for p in self.split(text))

    def marked(self, text: str) -> bytes:
        """``text`` as the document checkers see the output (special tokens as 0xFF + name)."""
        if not text:
            return b""
        names = {v: k for k, v in self.ids.items()}
        return b"".join(SPECIAL_MARK + names[p].encode() if isinstance(p, int) else p.encode()
                        for p in self.split(text))


def regex_literal(text: str) -> str:
    """``text`` as a literal inside /.../ (llguidance regex syntax)."""
    return re.escape(text).replace("/", "\\/")


def text_excluding(words: list[str]) -> str:
    """A terminal body: any text that contains none of ``words``."""
    if not words:
        return "/(?s:.*)/"
    alt = "|".join(regex_literal(w) for w in words)
    return f"/(?s:.*)/ & ~/(?s:.*({alt})(?s:.*))/"


def reasoning_lark(start: str, end: str, specials: Specials, body: str) -> str:
    """A grammar: free text up to the first ``end`` (after ``start`` when given), then ``body``."""
    if specials.has_special(end):
        prefix = " ".join(x for x in (specials.lark(start), "THINK_TEXT", specials.lark(end)) if x)
        terms = "THINK_TEXT: /(?s:.*)/\n"
    else:
        lead = ""
        if specials.has_special(start):
            lead, start = specials.lark(start) + " ", ""
        s, e = regex_literal(start), regex_literal(end)
        prefix = lead + "REASONING"
        terms = f"REASONING: /{s}(?s:.*){e}/ & ~/(?s:.*{e}(?s:.+))/\n"
    return f"start: {prefix} body\nbody: {body}\n{terms}"


# -- structural tags ----------------------------------------------------------------------------------
@dataclasses.dataclass
class TagInfo:
    """What the document checker needs of one tag: how it begins and ends, and its JSON schema."""
    begin: str | int
    ends: list[str | int]
    json_schema: Any = None     # the content's schema, when the content is JSON
    is_json: bool = False
    relaxed: bool = False


# json_body(schema) -> (Lark expression for the JSON content, relaxed?)
JsonBody = Callable[[Any], "tuple[str, bool]"]


class StructuralTagLark:
    """Builds the Lark grammar of one structural tag."""

    def __init__(self, specials: Specials, json_body: JsonBody) -> None:
        self.specials = specials
        self.json_body = json_body
        self.rules: list[str] = []
        self.tags: list[TagInfo] = []
        self.loose_json: list[str] = []   # where relaxed JSON sits outside a tag
        self._n = 0

    def build(self, tag: Any) -> str:
        if not isinstance(tag, dict):
            raise GrammarCompileError("a structural tag is a JSON object")
        if "format" not in tag and "structures" in tag and "triggers" in tag:
            fmt = self._legacy(tag)
        elif "format" in tag:
            fmt = tag["format"]
        else:
            raise GrammarCompileError("a structural tag has a 'format' (or the legacy 'structures' and 'triggers')")
        top = self.format(fmt, "format")
        return "\n".join([f"start: {top}", *self.rules]) + "\n"

    @staticmethod
    def _legacy(tag: dict) -> dict:
        structures = tag["structures"]
        if not isinstance(structures, list) or not isinstance(tag["triggers"], list):
            raise GrammarCompileError("legacy structural tag: 'structures' and 'triggers' are lists")
        tags = []
        for s in structures:
            if not isinstance(s, dict) or "begin" not in s or "end" not in s:
                raise GrammarCompileError("legacy structural tag: each structure has 'begin', 'schema' and 'end'")
            schema = s.get("schema", s.get("parameters", {}))
            tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                         "content": {"type": "json_schema", "json_schema": schema}})
        return {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}

    def _rule(self, body: str, name: str = "r") -> str:
        self._n += 1
        rule = f"{name}_{self._n}"
        self.rules.append(f"{rule}: {body}")
        return rule

    def _term(self, body: str) -> str:
        self._n += 1
        term = f"T_{self._n}"
        self.rules.append(f"{term}: {body}")
        return term

    def _token(self, tok: Any, where: str) -> str:
        if isinstance(tok, dict) and tok.get("type") == "token":
            tok = tok.get("token")
        if isinstance(tok, bool) or not isinstance(tok, (int, str)):
            raise GrammarCompileError(f"{where}: a token is an id or a special token's name")
        if isinstance(tok, str):
            if tok not in self.specials.ids:
                raise UnsupportedSpec(f"{where}: {tok!r} is not a special token of this tokenizer; give its id")
            tok = self.specials.ids[tok]
        return f"<[{tok}]>"

    def _lit(self, text: Any, where: str) -> str:
        if not isinstance(text, str):
            raise GrammarCompileError(f"{where}: expected a string")
        return self.specials.lark(text)

    # -- formats --------------------------------------------------------------------------------------
    def format(self, fmt: Any, where: str) -> str:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise GrammarCompileError(f"{where}: a format is an object with a 'type'")
        kind = fmt["type"]
        handler = getattr(self, "_f_" + kind, None)
        if handler is None:
            raise UnsupportedSpec(f"{where}: structural tag format {kind!r} is not supported on llguidance")
        return handler(fmt, where)

    def _f_const_string(self, fmt, where):
        return self._lit(fmt.get("value"), where) or '""'

    def _f_json_schema(self, fmt, where):
        if fmt.get("style", "json") != "json":
            raise UnsupportedSpec(f"{where}: json_schema style {fmt['style']!r} is not supported on llguidance")
        body, relaxed = self.json_body(fmt.get("json_schema", True))
        if relaxed:
            self.loose_json.append(where)
        return self._rule(body, "json")

    def _f_any_text(self, fmt, where):
        return self._term(text_excluding(list(fmt.get("excludes") or [])))

    def _f_regex(self, fmt, where):
        pattern = fmt.get("pattern")
        if not isinstance(pattern, str):
            raise GrammarCompileError(f"{where}: regex needs a 'pattern' string")
        return self._term("/" + pattern.replace("/", "\\/") + "/")

    def _elements(self, fmt, where) -> list[str]:
        elements = fmt.get("elements")
        if not isinstance(elements, list) or not elements:
            raise GrammarCompileError(f"{where}: {fmt['type']} needs a non-empty 'elements' list")
        return [self.format(e, f"{where}.elements[{i}]") for i, e in enumerate(elements)]

    def _f_sequence(self, fmt, where):
        return self._rule(" ".join(self._elements(fmt, where)))

    def _f_or(self, fmt, where):
        return self._rule(" | ".join(self._elements(fmt, where)))

    def _repeat(self, fmt, where, suffix: str) -> str:
        return self._rule(f"({self.format(fmt.get('content'), where + '.content')}){suffix}")

    def _f_optional(self, fmt, where):
        return self._repeat(fmt, where, "?")

    def _f_plus(self, fmt, where):
        return self._repeat(fmt, where, "+")

    def _f_star(self, fmt, where):
        return self._repeat(fmt, where, "*")

    def _f_repeat(self, fmt, where):
        lo, hi = fmt.get("min", 0), fmt.get("max", -1)
        if not isinstance(lo, int) or not isinstance(hi, int) or lo < 0 or (hi != -1 and hi < lo):
            raise GrammarCompileError(f"{where}: repeat needs 0 <= min <= max (max -1: unbounded)")
        return self._repeat(fmt, where, f"{{{lo},{'' if hi == -1 else hi}}}")

    def _f_token(self, fmt, where):
        return self._token(fmt.get("token"), where)

    def _f_tag(self, fmt, where, *, begin_rest: str | None = None):
        begin = fmt.get("begin")
        begin_key: str | int
        if isinstance(begin, dict):
            begin_lark = self._token(begin, where + ".begin")
            begin_key = int(begin_lark[2:-2])
        else:
            begin_lark = self._lit(begin, where + ".begin")
            begin_key = begin
        if begin_rest is not None:   # a triggered tag: the trigger is already matched
            begin_lark = self.specials.lark(begin_rest)
        ends_raw = fmt.get("end")
        ends = ends_raw if isinstance(ends_raw, list) else [ends_raw]
        end_larks: list[str] = []
        end_keys: list[str | int] = []
        for e in ends:
            if isinstance(e, dict):
                end_larks.append(self._token(e, where + ".end"))
                end_keys.append(int(end_larks[-1][2:-2]))
            else:
                end_larks.append(self._lit(e, where + ".end") or '""')
                end_keys.append(e)
        content = fmt.get("content")
        info = TagInfo(begin_key, end_keys)
        n_loose = len(self.loose_json)
        if isinstance(content, dict) and content.get("type") == "any_text":
            body = self._text_until(end_keys, content, where)
        else:
            body = self.format(content, where + ".content")
            if isinstance(content, dict) and content.get("type") == "json_schema":
                info.is_json, info.json_schema = True, content.get("json_schema", True)
                info.relaxed = len(self.loose_json) > n_loose
                del self.loose_json[n_loose:]   # a relaxed schema in a tag is checked by the tag
            body = f"{body} ({' | '.join(end_larks)})"
        self.tags.append(info)
        return self._rule(" ".join(x for x in (begin_lark, body) if x), "tag")

    def _text_until(self, ends: list, content: dict, where: str) -> str:
        """any_text inside a tag: the text up to the first end."""
        excludes = list(content.get("excludes") or [])
        texts = [e for e in ends if isinstance(e, str) and e and not self.specials.has_special(e)]
        if len(texts) != len(ends):   # an end that is (or holds) a special token ends the text lexeme
            alts = " | ".join(self._lit(e, where) if isinstance(e, str) else f"<[{e}]>" for e in ends)
            return f"{self._term(text_excluding(excludes))} ({alts})"
        alt = "|".join(regex_literal(e) for e in texts)
        lex = f"/(?s:.*)({alt})/ & ~/(?s:.*({alt})(?s:.+))/"
        if excludes:
            lex += " & ~/(?s:.*(" + "|".join(regex_literal(w) for w in excludes) + ")(?s:.*))/"
        return self._term(lex)

    def _f_triggered_tags(self, fmt, where):
        triggers, tags = fmt.get("triggers"), fmt.get("tags")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise GrammarCompileError(f"{where}: triggered_tags needs a non-empty list of trigger strings")
        if not isinstance(tags, list) or not tags:
            raise GrammarCompileError(f"{where}: triggered_tags needs a non-empty 'tags' list")
        excludes = list(fmt.get("excludes") or [])
        text_triggers = [t for t in triggers if not self.specials.has_special(t)]
        # Free text never holds a text trigger (nor an excluded string); special tokens never occur in it.
        free = self._term(text_excluding(text_triggers + excludes))
        items = []
        for i, tag in enumerate(tags):
            begin = tag.get("begin") if isinstance(tag, dict) else None
            trig = max((t for t in triggers if isinstance(begin, str) and begin.startswith(t)), key=len, default=None)
            if trig is None or not isinstance(begin, str):
                raise GrammarCompileError(f"{where}.tags[{i}]: its begin must start with one of the triggers")
            if trig in text_triggers:   # free text and the trigger as one terminal: it ends at the first trigger
                head = self._term(f"{free} {json.dumps(trig, ensure_ascii=False)}")
            else:
                head = f"{free} {self.specials.lark(trig)}"
            body = self._f_tag(tag, f"{where}.tags[{i}]", begin_rest=begin[len(trig):])
            items.append(self._rule(f"{head} {body}", "call"))
        return self._calls(items, free, fmt)

    def _calls(self, items: list[str], tail: str, fmt: dict) -> str:
        alt = " | ".join(items)
        if fmt.get("stop_after_first"):
            return self._rule(f"({alt})" if fmt.get("at_least_one") else f"({alt}) | {tail}")
        return self._rule(f"({alt})+ {tail}" if fmt.get("at_least_one") else f"({alt})* {tail}")

    def _f_token_triggered_tags(self, fmt, where):
        tags = fmt.get("tags")
        if not isinstance(tags, list) or not tags:
            raise GrammarCompileError(f"{where}: token_triggered_tags needs a non-empty 'tags' list")
        for t in fmt.get("exclude_tokens") or []:
            self._token(t, where + ".exclude_tokens")   # special tokens never occur in free text anyway
        free = self._term(text_excluding([]))
        items = [self._rule(f"{free} {self._f_tag(tag, f'{where}.tags[{i}]')}", "call") for i, tag in enumerate(tags)]
        return self._calls(items, free, fmt)

    def _f_tags_with_separator(self, fmt, where):
        tags, sep = fmt.get("tags"), fmt.get("separator")
        if not isinstance(tags, list) or not tags or not isinstance(sep, str):
            raise GrammarCompileError(f"{where}: tags_with_separator needs 'tags' and a 'separator' string")
        one = self._rule(" | ".join(self._f_tag(t, f"{where}.tags[{i}]") for i, t in enumerate(tags)))
        if fmt.get("stop_after_first"):
            return self._rule(one if fmt.get("at_least_one") else f"{one}?")
        sep_l = self.specials.lark(sep)
        many = f"{one} ({sep_l} {one})*" if sep_l else f"{one}+"
        return self._rule(many if fmt.get("at_least_one") else f"({many})?")
