"""A JSON number ends by grammar: a copy of a JSON Schema in which every integer and number the
schema leaves unbounded gets bounds, for grammar.py to compile with llguidance.

llguidance writes an unbounded integer or number as any count of digits, and a small model can
ramble digits until -n runs out. llguidance (1.9) has no option for digit counts (x-guidance sets
only whitespace, separators and escapes), its minimum/maximum become range regexes of a fixed
digit count and its multipleOf admits no more decimals than its own, while a Lark grammar's %json
is compiled by the same code (custom number rules would mean a JSON Schema compiler of our own).
A bound of the user's own is kept as given, however wide (llguidance holds an integer bound to 64
bits).
"""

import copy
import decimal
from dataclasses import dataclass

# - |integer| <= 2^53 - 1, JavaScript's Number.MAX_SAFE_INTEGER (16 digits): every integer up to it
#   is exact in a double, the number JSON readers parse into. llguidance reads bounds as doubles,
#   so 10^16 - 1 would round to 10^16 and let a 17th digit through.
# - a number: a whole number as above, or one under 10^8 with at most 8 decimals (multipleOf
#   1e-8): 16 significant digits either way, and no exponent (llguidance drops it under two
#   bounds). 8 decimals keep prices, percentages and coordinates to the millimetre, and 10^8
#   times a digit stays within the 32-bit arithmetic of llguidance's multipleOf.
SAFE_INTEGER = 2**53 - 1
DECIMALS = 1e-8
FRACTION = 1e8  # a number with decimals: |x| < 10^8, so 8 + 8 digits
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# Any JSON value, numbers bounded as above at any depth: what an open place of a schema holds (a
# property or item of any type, an object's other properties, an array's other items) and
# --format json's values. llguidance's own any-value grammar has unbounded numbers.
_VALUE_NAME = "localkv-value"
_VALUE_REF = {"$ref": f"#/$defs/{_VALUE_NAME}"}
_VALUE = {
    "type": ["null", "boolean", "number", "string", "array", "object"],
    "items": _VALUE_REF,
    "additionalProperties": _VALUE_REF,
}
_TYPES = set(_VALUE["type"])
# keywords that leave a schema open to any value
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "readOnly", "writeOnly", "deprecated"}
_ANNOTATIONS |= {"x-guidance"}  # the top level's llguidance options
# keywords that decide a schema's types without "type": such a schema is left as it is
_APPLICATORS = {"$ref", "anyOf", "oneOf", "allOf", "not", "if", "const", "enum"}


def bounded_numbers(schema: dict, open_places: bool = True) -> dict:
    """A copy of a JSON Schema whose integers and numbers, wherever they are, have the bounds
    above on each side the schema leaves open, and with open_places, whose open places hold
    localkv's any value (the caller's schema is not changed)."""
    r = _Rewrite(open_places, _decimals_join(schema))
    out = r.bound(copy.deepcopy(schema))
    if not r.opened:
        return out
    if not isinstance(out.setdefault("$defs", {}), dict):
        return bounded_numbers(schema, open_places=False)  # a broken $defs: llguidance says so
    out["$defs"][_VALUE_NAME] = r.bound(copy.deepcopy(_VALUE))
    return out


def _decimals_join(schema) -> bool:
    """Whether the decimals cap can join each multipleOf of the schema: where two meet (allOf)
    llguidance takes their least common multiple in 32 bits, 10^8 x m for m a multiple of 1e-8,
    and one that overflows is a wrong grammar, not an error."""
    if isinstance(schema, list):
        return all(_decimals_join(v) for v in schema)
    if not isinstance(schema, dict):
        return True
    m = schema.get("multipleOf")
    if isinstance(m, (int, float)) and not isinstance(m, bool):
        scaled = decimal.Decimal(repr(m)).scaleb(8)
        if scaled != scaled.to_integral_value() or abs(scaled) >= 2**32:
            return False
    return all(_decimals_join(v) for v in schema.values())


# where subschemas sit, in the keywords llguidance reads; not `not`, where a bound would widen
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "additionalProperties", "anyOf", "oneOf", "allOf")


@dataclass
class _Rewrite:
    open_places: bool  # put localkv's any value where the schema takes any
    decimals: bool  # cap a number's decimals
    opened: bool = False  # whether it did

    def bound(self, s):
        """s with its numbers bounded and its open places opened, in place where s is a dict."""
        if self.open_places and (s is True or isinstance(s, dict) and set(s) <= _ANNOTATIONS):
            self.opened = True
            return (s if isinstance(s, dict) else {}) | _VALUE_REF
        if not isinstance(s, dict):
            return s
        for key in _SCHEMA_MAPS:
            if isinstance(s.get(key), dict):
                s[key] = {name: self.bound(sub) for name, sub in s[key].items()}
        for key in _SUBSCHEMAS:
            if isinstance(s.get(key), list):
                s[key] = [self.bound(sub) for sub in s[key]]
            elif key in s:
                s[key] = self.bound(s[key])
        types = s.get("type", None if _APPLICATORS & set(s) else _TYPES)  # no type: any
        types = {types} if isinstance(types, str) else set(types) if isinstance(types, (list, set)) else set()
        if self.open_places and "object" in types and not {"additionalProperties", "unevaluatedProperties"} & set(s):
            s["additionalProperties"] = self.bound(True)  # JSON Schema's default: any other property
        if self.open_places and "array" in types and not {"items", "additionalItems", "unevaluatedItems"} & set(s):
            s["items"] = self.bound(True)  # after prefixItems, if any
        if not types & {"integer", "number"} or "const" in s or "enum" in s:
            return s  # not a number, or one of a fixed few
        if "number" in types and "multipleOf" not in s and "anyOf" not in s and self.decimals:
            return _whole_or_fraction(s, types)
        return _bounded(s, SAFE_INTEGER)


def _bounded(s: dict, limit: float) -> dict:
    """s bounded to [-limit, limit] on each side it leaves open, in place: a side of the user's
    own stays, and the other stays open too where their bound lies beyond it."""
    low, high = _limit(s, "minimum", "exclusiveMinimum"), _limit(s, "maximum", "exclusiveMaximum")
    if low is None and (high is None or high >= -limit):
        s["minimum"] = -limit
    if high is None and (low is None or low <= limit):
        s["maximum"] = limit
    return s


def _whole_or_fraction(s: dict, types: set) -> dict:
    """A number as one of: a whole number of up to 16 digits (2^53 - 1), or one under 10^8 with
    up to 8 decimals: at most 16 significant digits either way, what a double holds. The
    schema's own bounds hold in both; where they leave no room under 10^8, whole numbers only."""
    bounds = {k: s.pop(k) for k in _BOUNDS if k in s}
    others = sorted(types - {"integer", "number"})
    whole = _bounded({"type": "integer"} | bounds, SAFE_INTEGER)
    fraction = {"type": "number"} | bounds | {"multipleOf": DECIMALS}
    low, high = _limit(fraction, "minimum", "exclusiveMinimum"), _limit(fraction, "maximum", "exclusiveMaximum")
    fits = (low is None or low < FRACTION) and (high is None or high > -FRACTION)
    if low is None:
        fraction["exclusiveMinimum"] = -FRACTION
    if high is None:
        fraction["exclusiveMaximum"] = FRACTION
    s.pop("type", None)
    s["anyOf"] = ([{"type": others}] if others else []) + [whole] + ([fraction] if fits else [])
    return s


def _limit(s: dict, inclusive: str, exclusive: str) -> float | None:
    """The schema's own bound on one side (a draft-4 `exclusiveMinimum: true` is no bound)."""
    for key in (inclusive, exclusive):
        v = s.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None
