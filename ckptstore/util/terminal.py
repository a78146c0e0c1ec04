"""Make strings that come from storage safe to show on a terminal.

Anything read from a store (save directory names, component names, details
that quote them, hosts in attempt records, ledger payloads) may have been
planted by whoever can write to the storage. Printed raw, an ANSI escape
sequence can rewrite the screen, set the window title or fake a line; a
bidirectional override can make ``gc`` output show a different name than
the one deleted; a newline can forge a whole line of a report.

:func:`escape` turns every such character into a visible escape:

* C0 and C1 control characters and DEL (``ESC`` → ``\\x1b``, newline → ``\\n``);
* Unicode format characters — bidi embeddings/overrides/isolates
  (U+202A–202E, U+2066–2069), marks (U+200E, U+200F, U+061C), zero-width
  characters, BOM — (``\\u202e``);
* line and paragraph separators (U+2028, U+2029);
* lone surrogates (undecodable bytes of a file name, ``\\udcff``), which
  would otherwise make ``print`` fail;
* the backslash itself (``\\\\``), so an escape in the output is never
  ambiguous with the same characters stored literally.

Printable text, including non-ASCII letters, is left as it is. JSON output
needs none of this: ``json.dumps`` escapes all of it (``ensure_ascii``).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn"})


def _visible(ch: str) -> str:
    o = ord(ch)
    if o < 0x100:
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch, f"\\x{o:02x}")
    if o < 0x10000:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def is_unsafe(ch: str) -> bool:
    """True for a character :func:`escape` replaces (besides the backslash)."""
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def escape(text: object, *, backslash: bool = True) -> str:
    """``str(text)`` with every control, format, separator and surrogate
    character as a visible escape (and ``\\`` doubled unless ``backslash`` is
    False). The result is one line of printable characters."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable() and "\\" not in s:  # fast path: nothing to do (isprintable is False for all of the above)
        return s
    out = []
    for ch in s:
        if ch == "\\":
            out.append("\\\\" if backslash else ch)
        elif ch == " " or not is_unsafe(ch):
            out.append(ch)
        else:
            out.append(_visible(ch))
    return "".join(out)


def escape_lines(text: str) -> str:
    """A multi-line text made of lines the program composed: each line
    escaped (backslashes kept as they are — the values in it were escaped
    already), the line breaks kept. A last line of defence before printing."""
    return "\n".join(escape(line, backslash=False) for line in text.split("\n"))


def sanitize(obj: Any) -> Any:
    """A copy of a JSON-like tree with every string (keys included) escaped,
    for rendering as text."""
    if isinstance(obj, str):
        return escape(obj)
    if isinstance(obj, Mapping):
        return {sanitize(k) if isinstance(k, str) else k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [sanitize(v) for v in obj]
    return obj
