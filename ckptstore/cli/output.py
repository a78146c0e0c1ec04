"""What the command line prints, and how it fails (protocol_spec/THREATS.md §3.5, §3.6, §3.8).

* Results: ``--json`` through ``json.dumps(ensure_ascii=True)`` (every control
  character escaped); text escaped line by line as a last line of defence —
  store-derived values are escaped where they are formatted (:data:`esc`).
* Everything printed is redacted: passwords in URLs, the values of this
  invocation's ``-o`` options, the clients' credential variables and the
  record keys of ``CKPTSTORE_AUTH_KEYS``.
* Every failure — usage error, deliberate error, ``OSError``, unexpected
  exception — and every warning is one line on stderr; ``--debug`` adds the
  (redacted) traceback. Exit status: 2 bad input, 1 otherwise, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import CkptStoreError, ExtraRequiredError, InvalidInputError
from ..util.redact import redact_text, secret_values
from ..util.terminal import escape, escape_lines

#: Values that must never be printed: the ``-o`` option values of this
#: invocation (filled while parsing) and the clients' credential variables.
SECRETS: list[str] = []
_OPTION_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_SECRET_OPTION = re.compile(r"secret|passw|token|credential|key|auth|sig", re.IGNORECASE)
#: A store-derived value, safe for the terminal (one line, visible escapes).
esc = escape


def parse_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``-o KEY=VALUE`` pairs. A malformed one is refused naming at most its
    key: a value (or a whole argument without ``=``) may be a credential."""
    out: dict[str, Any] = {}
    for i, p in enumerate(pairs or [], 1):
        if "=" not in p:
            SECRETS.append(p)
            raise InvalidInputError(f"storage option #{i}: expected KEY=VALUE (the argument is not shown)")
        k, v = p.split("=", 1)
        # never echo a value: a mistyped key may hold a secret. A URL value (an
        # endpoint) stays readable: its password is masked by URL redaction.
        if "://" not in v or _SECRET_OPTION.search(k):
            SECRETS.append(v)
        if not _OPTION_KEY.fullmatch(k):
            raise InvalidInputError(f"storage option #{i}: malformed key (expected letters, digits, '_', '.', '-')")
        val: Any = v
        if v.lower() in ("true", "false"):
            val = v.lower() == "true"
        out[k] = val
    return out


def emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    """Print a command's result: ``obj`` with ``--json``, else ``text``."""
    out = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=True) if args.json else escape_lines(text)
    print(redact_text(out, SECRETS))


def fail(message: str) -> None:
    """One line on stderr: redacted, escaped (a newline in a message cannot
    start a forged line)."""
    print(escape(redact_text(message, SECRETS), backslash=False), file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """Usage errors are one line too (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        fail(f"ckptstore: error: {message} (see {self.prog} --help)")
        raise SystemExit(2)


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:
    """A warning is one escaped, redacted line too (its text may quote store keys)."""
    fail(f"ckptstore: warning: {message}")


def run_guarded(args: argparse.Namespace) -> int:
    """Run the parsed command; any failure becomes one line and an exit status."""
    del SECRETS[:]
    SECRETS.extend(secret_values())
    debug = bool(getattr(args, "debug", False))
    with warnings.catch_warnings():
        warnings.showwarning = show_warning  # e.g. unauthenticated records under --auth-policy warn
        try:
            return int(args.fn(args))
        except (InvalidInputError, ExtraRequiredError) as exc:
            _trace(debug)
            fail(f"ckptstore: error: {exc}")
            return 2
        except KeyboardInterrupt:
            fail("ckptstore: interrupted")
            return 130
        except (CkptStoreError, OSError) as exc:  # OSError: a local file the command writes (--svg), a broken pipe
            _trace(debug)
            fail(f"ckptstore: {type(exc).__name__}: {exc}")
            return 1
        except Exception as exc:  # noqa: BLE001 - the CLI's contract: one line, never a traceback
            _trace(debug)
            hint = "" if debug else " (run with --debug for the traceback)"
            fail(f"ckptstore: internal error: {type(exc).__name__}: {exc}{hint}")
            return 1


def _trace(debug: bool) -> None:
    if debug:
        sys.stderr.write(redact_text(traceback.format_exc(), SECRETS))
