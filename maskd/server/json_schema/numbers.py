"""Numbers in complete mode's grammar: big integer constants and number bounds left to the validator.

``const`` / ``enum`` integers beyond 2^53 that no double holds (``9007199254740993``): llguidance
reads them as doubles and matches the nearest one's text. The grammar takes, in their place, the
integers between the two doubles around the value (``[2^53, 2^53 + 2]``: the value and its two
neighbours; any integer past 2^62, where llguidance's integer ranges end), and the validator decides.

Number bounds: llguidance's range regex (``rx_float_range``, llguidance 1.9.1) is narrower than the
bound (no exponent form: ``1e-06`` for ``"minimum": 0``; no number whose digits are a prefix of the
bound's: ``0.999999`` for ``"maximum": 0.9999999``; no trailing zeros at the bound or next to an
excluded 0; no ``-0``), and its JSON schema input has no number regex of one's own. Where a number
node's bounds are all that constrains its value (``row_checked_numbers``), the grammar takes any
number there and the rows check the bounds on every token (``NumberRule``, below): exact for
decimals, exponent forms admitted where every exponent in their direction stays inside. Dropping the
bounds without the rows' check was measured and not kept (a model could start ``-5`` under
``"minimum": 0``, which no continuation ends). docs/decisions/0025-number-bounds-stay-llguidances.md.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np

from maskd.server.json_schema.relax import map_schemas, node_at, pointer_path, put_at

_RANGE_LIMIT = 1 << 62   # llguidance's integer ranges work on i64: past this, any integer


def _inexact(value: Any) -> bool:
    """An integer no double holds exactly."""
    if not isinstance(value, int) or isinstance(value, bool) or -(1 << 53) <= value <= 1 << 53:
        return False
    try:
        return int(float(value)) != value
    except OverflowError:
        return True


def _integers_around(value: int) -> dict:
    """The integers between the doubles on either side of ``value`` (a superset of ``{value}``)."""
    if abs(value) >= _RANGE_LIMIT:
        return {"type": "integer"}
    f = float(value)
    lo, hi = (f, math.nextafter(f, math.inf)) if f < value else (math.nextafter(f, -math.inf), f)
    return {"type": "integer", "minimum": int(lo), "maximum": int(hi)}


def grammar_numbers(schema: Any) -> tuple[Any, frozenset[str]]:
    """(the schema complete mode's grammar takes, the keywords it leaves to the validator): inexact
    big integers of ``const`` / ``enum`` widened to the integers around them (see above). The schema
    itself where nothing changes."""
    if not isinstance(schema, dict):
        return schema, frozenset()
    text = json.dumps(schema)
    if '"const"' not in text and '"enum"' not in text:
        return schema, frozenset()
    words: set[str] = set()

    def fix(node: dict) -> dict:
        out = node
        word = "const" if "const" in node else "enum"
        values = [node["const"]] if word == "const" else node.get("enum")
        if isinstance(values, list) and any(_inexact(v) for v in values):
            words.add(word)
            options = [_integers_around(v) for v in values if _inexact(v)]
            rest = [v for v in values if not _inexact(v)]
            if rest:
                options.append({"enum": rest})
            out = {k: v for k, v in out.items() if k != word}
            if "anyOf" in out:   # the node's own anyOf stays: the constants join as an allOf member
                out["allOf"] = [*out.get("allOf", []), {"anyOf": options}]
            else:
                out["anyOf"] = options
        return out
    out = map_schemas(schema, fix)
    return (out, frozenset(words)) if words else (schema, frozenset())


def inexact_integers(schema: Any) -> tuple[bytes, ...]:
    """The decimal texts of the ``const`` / ``enum`` integers of ``schema`` that the grammar widens
    (``grammar_numbers``): the rows keep a number from growing past 2^53 into one that no continuation
    can make pass (``JsonDocumentChecker``)."""
    found: set[bytes] = set()

    def visit(node: dict) -> dict:
        values = [node["const"]] if "const" in node else node.get("enum")
        if isinstance(values, list):
            found.update(str(v).encode() for v in values if _inexact(v))
        return node
    if isinstance(schema, dict) and ('"const"' in json.dumps(schema) or '"enum"' in json.dumps(schema)):
        map_schemas(schema, visit)
    return tuple(sorted(found))


# -- number bounds the rows enforce ------------------------------------------------------------------
#
# llguidance 1.9.1 writes a bounded number as a regex of plain decimals (rx_float_range) that is
# narrower than the bound (no exponent form, no "-0", holes at the bound's digits), and its JSON
# schema input has no other way to say which numbers a node takes. Where a number node's bounds
# are all that constrains its value (``row_checked_numbers``), complete mode's grammar takes any
# number there and the rows (``NumberRule.vetoes``) allow a token only where the number written so
# far can still end as one in the bound's language: every decimal in the bound (exact: prefixes of
# the bound's digits, trailing zeros, "-0"), and an exponent form whose mantissa is such a decimal
# and whose every exponent in one direction stays inside (toward zero where the bound holds the
# values between the mantissa and zero, away from it where the bound is open on that side), within
# 1e-300 .. 1e300 in magnitude (Python reads 1e-400 as 0.0, 1e400 as inf). So no number can be
# started that no continuation ends (decision 0025's dead ends), and a model is never led into an
# exponent to repair a decimal out of range. docs/decisions/0025-number-bounds-stay-llguidances.md.

BOUND_WORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
# What may stand beside the bounds of a number node whose bounds the rows take: not another
# constraint on the number (multipleOf, const, enum), not a combinator or reference that would add one.
_NOT_BESIDE = frozenset({"multipleOf", "const", "enum", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
                         "$ref", "$dynamicRef", "$recursiveRef", "dependentSchemas", "dependencies",
                         "unevaluatedProperties", "unevaluatedItems", "contains"})
# An object or array whose children another subschema may constrain as well: its children stay
# llguidance's (a bound merged in from a sibling would keep llguidance's regex under the rows).
_COMBINED = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies",
                       "unevaluatedProperties", "unevaluatedItems", "contains", "$dynamicRef", "$recursiveRef"})
_NOTES = frozenset({"$ref", "$id", "id", "$schema", "$anchor", "$comment", "title", "description", "examples",
                    "default", "$defs", "definitions", "deprecated", "readOnly", "writeOnly"})
_EXP_LIMIT = 300   # exponent forms stay within 1e-300 .. 1e300 in magnitude


def _exact(value: Any) -> Fraction | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return Fraction(Decimal(repr(value)))   # the bound as written, not the double's expansion
    return Fraction(value)


@dataclasses.dataclass(frozen=True)
class Interval:
    """The numbers a node's bounds allow (None: unbounded on that side)."""
    lo: Fraction | None = None
    lo_open: bool = False
    hi: Fraction | None = None
    hi_open: bool = False

    @property
    def empty(self) -> bool:
        if self.lo is None or self.hi is None:
            return False
        return self.lo > self.hi or (self.lo == self.hi and (self.lo_open or self.hi_open))

    def contains(self, x: Fraction) -> bool:
        if self.lo is not None and (x < self.lo or (x == self.lo and self.lo_open)):
            return False
        return not (self.hi is not None and (x > self.hi or (x == self.hi and self.hi_open)))

    def meet(self, other: Interval) -> Interval:
        lo, lo_open = self.lo, self.lo_open
        if other.lo is not None and (lo is None or other.lo > lo or (other.lo == lo and other.lo_open)):
            lo, lo_open = other.lo, other.lo_open
        hi, hi_open = self.hi, self.hi_open
        if other.hi is not None and (hi is None or other.hi < hi or (other.hi == hi and other.hi_open)):
            hi, hi_open = other.hi, other.hi_open
        return Interval(lo, lo_open, hi, hi_open)

    def side(self, negative: bool) -> tuple[Fraction, bool, Fraction | None, bool] | None:
        """The magnitudes (a, a open, b or None, b open) of the nonzero numbers of one sign it holds."""
        if not negative:
            if self.hi is not None and self.hi <= 0:
                return None
            if self.lo is None or self.lo <= 0:
                a, a_open = Fraction(0), True
            else:
                a, a_open = self.lo, self.lo_open
            b, b_open = self.hi, self.hi_open
        else:
            if self.lo is not None and self.lo >= 0:
                return None
            if self.hi is None or self.hi >= 0:
                a, a_open = Fraction(0), True
            else:
                a, a_open = -self.hi, self.hi_open
            b, b_open = (None if self.lo is None else -self.lo), self.lo_open
        if b is not None and (a > b or (a == b and (a_open or b_open))):
            return None
        return a, a_open, b, b_open


def interval_of(node: Any) -> Interval | None:
    """The bounds of a number node as an interval (draft 4's boolean exclusives too); None without
    numeric bounds or with a bound that is not a finite number."""
    if not isinstance(node, dict) or not BOUND_WORDS & node.keys():
        return None
    out = Interval()
    for word, strict in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        ex = node.get(strict)
        for w, open_ in ((word, ex is True), (strict, True)):
            if w in node and not (w == strict and isinstance(ex, bool)):
                value = _exact(node[w])
                if value is None:
                    return None
                out = out.meet(Interval(lo=value, lo_open=open_) if word == "minimum"
                               else Interval(hi=value, hi_open=open_))
    if out.lo is None and out.hi is None:
        return None
    return out


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _local_ref(ref: Any) -> str | None:
    if ref == "#":
        return ""
    if isinstance(ref, str) and ref.startswith("#/"):
        return ref[1:]
    return None


def row_checked_numbers(schema: Any) -> dict[str, Interval]:
    """The number nodes (JSON pointers) whose bounds complete mode's grammar leaves to the rows, with
    their intervals: a node typed ``number`` with bounds and no other constraint on the number
    beside them, reached from the root only through ``properties``, ``additionalProperties``,
    ``items``, ``prefixItems``, ``additionalItems`` and plain local ``$ref`` of objects and arrays
    that nothing else constrains (no combinator, no ``patternProperties`` beside the property), so
    that wherever it applies it is the only subschema there and the validator pins it (its value
    is checked as the rows need). A schema with references that are not local pointers has none."""
    if not isinstance(schema, dict):
        return {}
    text = json.dumps(schema)
    if not BOUND_WORDS & set(re.findall(r'"(minimum|maximum|exclusiveMinimum|exclusiveMaximum)"', text)):
        return {}
    if re.search(r'"\$(dynamicRef|recursiveRef)"', text) or re.search(r'"\$ref":\s*"(?!#(/|"))', text):
        return {}
    clean: set[str] = set()
    dirty: set[str] = set()
    todo: list[tuple[str, bool]] = [("", True)]
    seen: set[tuple[str, bool]] = set()
    while todo:
        ptr, ok = todo.pop()
        if (ptr, ok) in seen or len(seen) > 100_000:
            continue
        seen.add((ptr, ok))
        (clean if ok else dirty).add(ptr)
        node = node_at(schema, pointer_path(ptr))
        if not isinstance(node, dict):
            continue
        plain = ok and not _COMBINED & node.keys() and ("$ref" not in node or node.keys() <= _NOTES)
        target = _local_ref(node.get("$ref"))
        if target is not None:
            todo.append((target, plain))
        free = plain and not node.get("patternProperties")
        props = node.get("properties")
        if isinstance(props, dict):
            todo += [(f"{ptr}/properties/{_escape(key)}", free) for key in props]
        for word in ("additionalProperties", "additionalItems", "items"):
            if isinstance(node.get(word), dict):
                todo.append((f"{ptr}/{word}", free if word == "additionalProperties" else plain))
        for word in ("items", "prefixItems"):
            if isinstance(node.get(word), list):
                todo += [(f"{ptr}/{word}/{i}", plain) for i in range(len(node[word]))]
        for word in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(word), list):
                todo += [(f"{ptr}/{word}/{i}", False) for i in range(len(node[word]))]
        for word in ("not", "if", "then", "else", "contains", "propertyNames", "unevaluatedItems",
                     "unevaluatedProperties"):
            if isinstance(node.get(word), dict):
                todo.append((f"{ptr}/{word}", False))
        for word in ("patternProperties", "dependentSchemas", "dependencies"):
            if isinstance(node.get(word), dict):
                todo += [(f"{ptr}/{word}/{_escape(k)}", False) for k, v in node[word].items() if isinstance(v, dict)]
    out = {}
    for ptr in clean - dirty:
        node = node_at(schema, pointer_path(ptr))
        if not isinstance(node, dict) or _NOT_BESIDE & node.keys():
            continue
        t = node.get("type")
        if not (t == "number" or (isinstance(t, list) and "number" in t)):
            continue
        interval = interval_of(node)
        if interval is not None and not interval.empty:
            out[ptr] = interval
    return out


def grammar_number_bounds(schema: Any) -> tuple[Any, frozenset[str]]:
    """(the schema complete mode's grammar takes, the keywords it leaves to the validator and the
    rows): the bounds of ``row_checked_numbers``'s nodes dropped, so the grammar takes any number
    there. The schema itself where there is none."""
    nodes = row_checked_numbers(schema)
    if not nodes:
        return schema, frozenset()
    words: set[str] = set()
    out = schema
    for ptr in sorted(nodes, key=len, reverse=True):
        path = pointer_path(ptr)
        node = node_at(out, path)
        words |= BOUND_WORDS & node.keys()
        out = put_at(out, path, {k: v for k, v in node.items() if k not in BOUND_WORDS})
    return out, frozenset(words)


@dataclasses.dataclass(frozen=True)
class _Num:
    """A JSON number written so far: sign, integer digits, fraction, exponent."""
    neg: bool
    ints: str
    dot: bool = False
    frac: str = ""
    exp: bool = False
    esign: str = ""
    edigits: str = ""

    @property
    def magnitude(self) -> Fraction:
        return Fraction(int(self.ints + self.frac or "0"), 10 ** len(self.frac))


_PREFIX = re.compile(rb"(-?)([0-9]*)(?:(\.)([0-9]*))?(?:([eE])([+-]?)([0-9]*))?\Z")


def parse_prefix(text: bytes) -> _Num | None:
    """The number ``text`` starts, or None where no JSON number starts so."""
    m = _PREFIX.match(text)
    if m is None:
        return None
    neg, ints, dot, frac, e, esign, edigits = m.groups()
    if (len(ints) > 1 and ints[:1] == b"0") or (dot and not ints) or (e and (not ints or (dot and not frac))):
        return None
    return _Num(bool(neg), ints.decode(), bool(dot), (frac or b"").decode(), bool(e), (esign or b"").decode(),
                (edigits or b"").decode())


_NO_LIMIT = 1 << 62
_MAX_J = 400

# A magnitude as (n, k): n / 10^k, both integers >= 0 (bounds are decimals; so is what is written).
Dec = tuple[int, int]


def _dec(x: Fraction) -> Dec:
    den, k = x.denominator, 0
    while (10 ** k) % den:
        k += 1
        if k > 400:
            raise ValueError(f"not a decimal: {x}")
    return x.numerator * 10 ** k // den, k


def _cmp(x: Dec, y: Dec) -> int:
    (n1, k1), (n2, k2) = x, y
    if k1 < k2:
        n1 *= 10 ** (k2 - k1)
    elif k2 < k1:
        n2 *= 10 ** (k1 - k2)
    return (n1 > n2) - (n1 < n2)


def _floor_at(x: Dec, s: int) -> int:
    """floor(x / 10^s)."""
    e = x[1] + s
    return x[0] * 10 ** -e if e <= 0 else x[0] // 10 ** e


def _ceil_at(x: Dec, s: int) -> int:
    """ceil(x / 10^s)."""
    e = x[1] + s
    return x[0] * 10 ** -e if e <= 0 else -((-x[0]) // 10 ** e)


def _within_far(side: tuple[Dec, bool, Dec | None, bool], x: Dec) -> bool:
    """Whether magnitude ``x`` is not past the side's bound farther from zero (none: never)."""
    _, _, far, far_open = side
    if far is None:
        return True
    c = _cmp(x, far)
    return c < 0 or (c == 0 and not far_open)


class NumberRule:
    """The rows' check of a number whose subschemas' bounds the grammar leaves to them: which numbers
    may still be written (see above), and which tokens would leave none. Exact, in integers."""

    def __init__(self, interval: Interval) -> None:
        self.interval = interval
        self.zero = interval.contains(Fraction(0))
        self.sides: dict[bool, tuple[Dec, bool, Dec | None, bool] | None] = {}
        for neg in (False, True):
            side = interval.side(neg)
            self.sides[neg] = None if side is None else \
                (_dec(side[0]), side[1], None if side[2] is None else _dec(side[2]), side[3])
        lo, hi = interval.lo, interval.hi
        # exponents toward zero: (0, m] (or [m, 0)) inside the bound; away from it: open on that side
        self.toward = {False: lo is None or lo <= 0, True: hi is None or hi >= 0}
        self.away = {False: hi is None, True: lo is None}
        self._vetoes: dict[tuple, tuple[np.ndarray, bool] | None] = {}

    def token_vetoes(self, text: bytes, table) -> tuple[np.ndarray, bool] | None:
        """For the number written so far (``text``; empty where one may start) and a table of the
        tokens that go on with it or start it (``closers.NumberTokens``): (the ids of those that
        would leave no number allowed, whether ending it here is refused); None where ``text``
        starts no number. Kept per text: the rows of many sequences ask the same."""
        key = (id(table), text)
        if key in self._vetoes:
            return self._vetoes[key]
        written = parse_prefix(text) if text else None
        found = None
        if written is not None or not text:
            bad = [table.digit_ids[self.digit_vetoes(written, table.width, table.value, table.lead0,
                                                     table.digit_ends)]]
            for part, ends, ids in table.other:
                after = parse_prefix(text + part)
                if after is not None and not (self.complete(after) if ends else self.viable(after)):
                    bad.append(ids)
            found = (np.concatenate(bad), not self.complete(written))
        if len(self._vetoes) < 2048:
            self._vetoes[key] = found
        return found

    # -- one number ---------------------------------------------------------------------------------
    def _hits(self, neg: bool, low: Dec, high: Dec) -> bool:
        """Whether some magnitude in [low, high) with this sign is allowed (low 0: zero too)."""
        if low[0] == 0 and self.zero:
            return True
        side = self.sides[neg]
        return side is not None and _cmp(high, side[0]) > 0 and _within_far(side, low)

    def _allowed(self, neg: bool, x: Dec) -> bool:
        if x[0] == 0:
            return self.zero
        side = self.sides[neg]
        if side is None:
            return False
        c = _cmp(x, side[0])
        return (c > 0 or (c == 0 and not side[1])) and _within_far(side, x)

    def _int_hits(self, neg: bool, digits: int) -> bool:
        side = self.sides[neg]
        if side is None:
            return False
        for j in range(_MAX_J):
            scale = 10 ** j
            if self._hits(neg, (digits * scale, 0), ((digits + 1) * scale, 0)):
                return True
            if side[2] is not None and _cmp((digits * scale, 0), side[2]) > 0:
                return False
        return False

    def _exp_limits(self, n: _Num) -> tuple[int, int] | None:
        """For an exponent form: (how far below 0, how far above it the exponent may go), or None
        where its mantissa is not a number the bound allows."""
        digits = int(n.ints + n.frac)
        f = len(n.frac)
        if not self._allowed(n.neg, (digits, f)):
            return None
        if digits == 0:
            return _NO_LIMIT, _NO_LIMIT
        d = len(str(digits))
        k_hi = _EXP_LIMIT + f - d + (1 if digits == 10 ** (d - 1) else 0)   # |m| 10^k <= 1e300
        k_lo = f - _EXP_LIMIT + 1 - d                                         # |m| 10^k >= 1e-300
        return (max(0, -k_lo) if self.toward[n.neg] else 0), (max(0, k_hi) if self.away[n.neg] else 0)

    def viable(self, n: _Num | None) -> bool:
        """Whether the number written so far (None: nothing yet) can still end as one allowed."""
        if n is None:
            return True
        if n.exp:
            limits = self._exp_limits(n)
            if limits is None:
                return False
            return not n.edigits or int(n.edigits) <= limits[0 if n.esign == "-" else 1]
        if not n.ints:
            return self.zero or self.sides[n.neg] is not None
        if not n.dot:
            if n.ints == "0":
                return self._hits(n.neg, (0, 0), (1, 0))
            return self._int_hits(n.neg, int(n.ints))
        x = int(n.ints + n.frac)
        return self._hits(n.neg, (x, len(n.frac)), (x + 1, len(n.frac)))

    def complete(self, n: _Num | None) -> bool:
        """Whether the number written so far may end here."""
        if n is None or not n.ints or (n.dot and not n.frac) or (n.exp and not n.edigits):
            return False
        if n.exp:
            limits = self._exp_limits(n)
            return limits is not None and int(n.edigits) <= limits[0 if n.esign == "-" else 1]
        return self._allowed(n.neg, (int(n.ints + n.frac), len(n.frac)))

    # -- the digit tokens, at once -------------------------------------------------------------------
    def _ranges(self, neg: bool, c: int, s: int, values: bool) -> tuple[int, int] | None:
        """The v with (values) the magnitude (c + v) 10^s allowed, or (not values) some allowed
        magnitude in [(c + v) 10^s, (c + v + 1) 10^s); zero aside."""
        side = self.sides[neg]
        if side is None:
            return None
        a, a_open, b, b_open = side
        if values:
            lo = (_floor_at(a, s) + 1 if a_open else _ceil_at(a, s)) - c
        else:
            lo = _floor_at(a, s) - c
        if b is None:
            return lo, _NO_LIMIT
        hi = (_ceil_at(b, s) - 1 if b_open else _floor_at(b, s)) - c
        return (lo, hi) if lo <= hi else None

    def _int_ranges(self, neg: bool, c: int, w: int) -> list[tuple[int, int]]:
        """The v for which the integer digits c + v (more digits may follow: j of them, then a
        fraction) can still make an allowed magnitude."""
        side = self.sides[neg]
        if side is None:
            return []
        a, _, b, b_open = side
        out = []
        least = 0 if c else 1   # a number's first digits do not start with 0
        for j in range(_MAX_J):
            lo = _floor_at(a, j) - c
            hi = _NO_LIMIT if b is None else (_ceil_at(b, j) - 1 if b_open else _floor_at(b, j)) - c
            if hi < least:
                break
            if lo <= hi:
                out.append((lo, hi))
            if lo <= 0 and hi >= 10 ** w - 1:
                break
        return out

    def digit_vetoes(self, n: _Num | None, width: np.ndarray, value: np.ndarray, lead0: np.ndarray,
                     ends: np.ndarray) -> np.ndarray:
        """Which digit tokens (each: how many digits, their value, whether it starts with a 0 and
        is longer than one, whether it ends the number) would leave a number that can no longer
        end allowed (or end one not allowed): a boolean per token."""
        neg = bool(n is not None and n.neg)
        started = n is not None and bool(n.ints)
        if n is not None and n.exp:
            limits = self._exp_limits(n)
            if limits is None:
                return np.ones(len(width), dtype=bool)
            base = int(n.edigits or "0")
            limit = limits[0 if n.esign == "-" else 1]
            room = np.zeros(len(width), dtype=np.int64)
            for w in np.unique(width).tolist():
                room[width == w] = max(-1, min(limit - base * 10 ** w, _NO_LIMIT))
            return value > room
        if started and not n.dot and n.ints == "0":   # type: ignore[union-attr]
            return np.zeros(len(width), dtype=bool)   # no digit may follow a leading 0: the grammar's
        ok = np.zeros(len(width), dtype=bool)
        for w in np.unique(width).tolist():
            cont: list[tuple[int, int] | None] = []
            if n is not None and n.dot:
                c = int(n.ints + n.frac) * 10 ** w
                s = -(len(n.frac) + w)
                cont.append(self._ranges(neg, c, s, False))
                done = self._ranges(neg, c, s, True)
                zero_cont = c == 0 and self._hits(neg, (0, 0), (1, -s))
                zero_done = c == 0 and self.zero
            else:
                c = int(n.ints) * 10 ** w if started else 0   # type: ignore[union-attr]
                cont += self._int_ranges(neg, c, w)
                done = self._ranges(neg, c, 0, True)
                zero_cont = zero_done = False
                if not started:   # a number's first digits: "0" is zero (a fraction may follow), "05" no number
                    zero_cont, zero_done = self._hits(neg, (0, 0), (1, 0)), self.zero
                    cont = [None if r is None else (max(r[0], 1), r[1]) for r in cont]
                    if done is not None:
                        done = (max(done[0], 1), done[1])
            at = width == w
            v = value[at]
            good = np.zeros(len(v), dtype=bool)
            for r in cont:
                if r is not None:
                    good |= (v >= max(r[0], -1)) & (v <= min(r[1], _NO_LIMIT))
            good_done = np.zeros(len(v), dtype=bool)
            if done is not None:
                good_done = (v >= max(done[0], -1)) & (v <= min(done[1], _NO_LIMIT))
            if c == 0:
                good |= (v == 0) & zero_cont
                good_done |= (v == 0) & zero_done
            ok[at] = np.where(ends[at], good_done, good)
        if not started:
            ok |= lead0   # "05": no number; the grammar's
        return ~ok
