"""Canonical JSON: the one encoder for everything ckptstore stores as JSON,
and the strict, bounded decoder for everything it reads back.

Encoding: UTF-8, keys sorted, no insignificant whitespace, no NaN/Infinity.
Byte-stable, so two encodings of one value compare equal (the lost-ack
read-back and the manifest digest rely on it).

Decoding treats stored bytes as hostile input: a size cap before parsing, no
NaN/Infinity, no duplicate keys, bounded integers, bounded nesting, no lone
surrogates, and (for records) the bytes must be exactly the canonical encoding
of what they decode to. Every failure is a :class:`CorruptionError`; nothing
else escapes.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import CorruptionError

#: Deepest nesting accepted when decoding (records are shallow; user metadata
#: and torch state trees rarely exceed a dozen levels).
MAX_DEPTH = 64
#: Longest integer literal accepted (a uint64 has 20 digits).
MAX_INT_DIGITS = 24


def canonical_json(value: Any) -> bytes:
    """The canonical bytes of a JSON value. Raises ``ValueError``/``TypeError``
    for values JSON cannot represent exactly (NaN, infinities, non-string keys
    of other types, arbitrary objects)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(text)} digits")
    return int(text)


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:32]} overflows a float")
    return v


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json`` ``object_pairs_hook`` that refuses an object naming a key twice."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:64]!r}")
        out[k] = v
    return out


def _depth(value: Any) -> int:
    """Nesting depth of a decoded value (iterative: no recursion to exhaust)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v)
    return deepest


def decode_json(data: bytes, *, where: str, max_bytes: int, canonical: bool = False) -> Any:
    """Decode stored JSON strictly. ``canonical``: the bytes must also equal the
    canonical encoding of the value (records; so a digest over the stored bytes
    covers exactly what a reader acts on)."""
    if len(data) > max_bytes:
        raise CorruptionError(f"{where}: {len(data)} bytes, more than the {max_bytes} allowed for it")
    if canonical:
        value = _canonical_fast(data)
        if value is not _CAREFUL:
            return value
    try:
        text = data.decode("utf-8")
        value = json.loads(
            text,
            parse_constant=_no_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            object_pairs_hook=no_duplicate_keys,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptionError(f"{where}: not valid JSON ({str(exc)[:200]})") from None
    if (data.count(b"[") + data.count(b"{") > MAX_DEPTH) and _depth(value) > MAX_DEPTH:
        raise CorruptionError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if canonical:
        try:
            again = canonical_json(value)
        except (ValueError, TypeError, UnicodeEncodeError) as exc:
            raise CorruptionError(f"{where}: not representable as canonical JSON ({str(exc)[:200]})") from None
        if again != data:
            raise CorruptionError(f"{where}: bytes are not the canonical encoding of the record")
    else:
        try:
            canonical_json(value)  # lone surrogates and the like
        except (ValueError, TypeError, UnicodeEncodeError) as exc:
            raise CorruptionError(f"{where}: not representable as JSON text ({str(exc)[:200]})") from None
    return value


_CAREFUL = object()
#: every ASCII digit to ``0`` and every other byte to ``.``: a run of more digits than an integer
#: literal may have is then a plain substring search (a regex search cost 13x more per record)
_DIGITS_ONLY = bytes(ord("0") if chr(c).isdigit() and c < 128 else ord(".") for c in range(256))
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)
_PLAIN = json.JSONDecoder(parse_constant=_no_constant)


def _canonical_fast(data: bytes) -> Any:
    """The value of canonical record bytes, parsed without the per-token hooks
    of the careful path; ``_CAREFUL`` whenever that path must decide (it then
    also words the error). Accepts exactly what the careful path accepts:
    the re-encoding must reproduce the bytes, which a duplicate key, a float
    that overflowed to infinity (refused by the encoder), a lone surrogate
    (refused when encoded to UTF-8) or any non-canonical spelling cannot; NaN
    and infinities are refused while parsing; an integer literal over the
    digit bound cannot occur without a run of that many digits in the bytes
    (then the careful path runs); nesting is checked as there."""
    if _LONG_RUN in data.translate(_DIGITS_ONLY):
        return _CAREFUL
    try:
        value = _PLAIN.decode(data.decode("utf-8"))
        if canonical_json(value) != data:
            return _CAREFUL
    except (UnicodeError, ValueError, TypeError, RecursionError):
        return _CAREFUL
    if (data.count(b"[") + data.count(b"{") > MAX_DEPTH) and _depth(value) > MAX_DEPTH:
        return _CAREFUL
    return value
