"""Keep credentials out of messages, logs and records.

* :func:`redact_url` — ``https://user:pass@host/…?X-Amz-Signature=…`` →
  ``https://user:***@host/…?X-Amz-Signature=***``.
* :func:`redact_text` — every URL inside a free text redacted as above, and
  every known secret value (see :func:`secret_values`) replaced by ``***``.
* :func:`secret_values` — the values of storage options (and of the clients'
  credential variables) that must never be shown.

Used by the command line on everything it prints and by the backends in their
error messages. Redaction is a last line of defence: messages should not
contain secrets in the first place.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

MASK = "***"

#: Storage-option names (any nesting level) whose values are credentials.
_SECRET_KEY_RE = re.compile(r"secret|passw|token|credential|signature|session|private|(^|_)key($|_)|api_?key|auth",
                            re.IGNORECASE)
#: Query parameters that carry credentials in pre-signed or tokenised URLs.
_SECRET_QUERY_RE = re.compile(r"signature|credential|token|secret|passw|sig$|^sig|key|auth", re.IGNORECASE)
#: Environment variables of the storage clients that hold credentials.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "GOOGLE_OAUTH_ACCESS_TOKEN",
              "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "CKPTSTORE_AUTH_KEYS")
#: A URL with a scheme inside free text (stops at whitespace and quotes).
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
#: ``user:password@`` right after ``//`` even where the rest does not parse as a URL.
_USERINFO = re.compile(r"(//[^/@\s:'\"]*):([^@\s/'\"]*)@")
_MIN_SECRET = 6  # shorter values ("anon", "true") are no credentials and would garble output


def redact_url(url: str) -> str:
    """``url`` with the password of its user-info and credential-bearing query
    parameters masked. Text that is not a URL is returned unchanged (apart
    from a ``//user:pass@`` pattern, which is masked wherever it appears)."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, sep, _password = userinfo.partition(":")
            netloc = f"{user}{':' + MASK if sep else ''}@{hostport}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(_SECRET_QUERY_RE.search(k) for k, _ in pairs):
                query = "&".join(
                    f"{quote(k, safe='')}={MASK if _SECRET_QUERY_RE.search(k) else quote(v, safe='')}" for k, v in pairs
                )
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:  # unparsable (bad port, brackets): mask by pattern
        return _USERINFO.sub(lambda m: f"{m.group(1)}:{MASK}@", url)


def secret_values(options: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None,
                  all_values: bool = False) -> list[str]:
    """Credential values found in ``options`` (recursively: ``client_kwargs``,
    ``credentials``…) and in the clients' credential variables of ``environ``
    (default: ``os.environ``). With ``all_values``, every string value of
    ``options`` counts (the command line uses this for ``-o``: it never needs
    to echo an option's value)."""
    out: set[str] = set()

    def walk(obj: Any, secret: bool) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, secret or all_values or bool(_SECRET_KEY_RE.search(str(k))))
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v, secret)
        elif isinstance(obj, str) and secret and len(obj) >= _MIN_SECRET and obj.lower() not in ("true", "false"):
            out.add(obj)

    walk(options or {}, False)
    env = os.environ if environ is None else environ
    for name in SECRET_ENV:
        v = env.get(name)
        if v and len(v) >= _MIN_SECRET:
            out.add(v)
            if name == "CKPTSTORE_AUTH_KEYS":  # ID:HEX[,ID:HEX...]: each key on its own too
                out.update(p.partition(":")[2].strip() for p in v.split(",") if len(p.partition(":")[2].strip()) >= _MIN_SECRET)
    return sorted(out, key=len, reverse=True)  # longest first: a secret containing another is masked whole


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL passed through :func:`redact_url` and every
    string of ``secrets`` (and its URL-quoted form) replaced by ``***``."""
    for s in sorted({s for s in secrets if s and len(s) >= _MIN_SECRET}, key=len, reverse=True):
        text = text.replace(s, MASK)
        q = quote(s, safe="")
        if q != s:
            text = text.replace(q, MASK)
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return _USERINFO.sub(lambda m: f"{m.group(1)}:{MASK}@", text)


def redact_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of storage options fit to print or record: credential values
    masked, URLs redacted."""

    def walk(obj: Any, secret: bool) -> Any:
        if isinstance(obj, Mapping):
            return {k: walk(v, secret or bool(_SECRET_KEY_RE.search(str(k)))) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [walk(v, secret) for v in obj]
        if isinstance(obj, str):
            return MASK if secret else redact_url(obj)
        return MASK if secret and obj is not None and not isinstance(obj, bool) else obj

    return dict(walk(dict(options or {}), False))
