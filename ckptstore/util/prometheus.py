"""Prometheus's text exposition format, by hand (no client library needed).

:func:`render` turns samples into the text format (version 0.0.4) that
Prometheus scrapes and node_exporter's textfile collector reads;
:func:`write_textfile` publishes it atomically (written to a temporary file in
the same directory, fsynced, renamed), so the collector never reads half a
file. Metric and label names are checked; label values are escaped.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import InvalidInputError

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
KINDS = ("gauge", "counter")


@dataclass(frozen=True)
class Sample:
    """One metric sample: ``name{labels} value``, with its help text and type."""

    name: str
    value: float
    help: str
    kind: str = "gauge"
    labels: Mapping[str, str] = field(default_factory=dict)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v)) if abs(v) < 2**53 else repr(float(v))


def render(samples: Iterable[Sample]) -> str:
    """The text format: one ``# HELP`` and ``# TYPE`` line per metric name
    (in first-seen order), then its samples. Invalid names are refused."""
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        if not _NAME.fullmatch(s.name):
            raise InvalidInputError(f"metric name {s.name!r} is not a Prometheus name")
        if s.kind not in KINDS:
            raise InvalidInputError(f"metric {s.name}: type must be one of {KINDS}")
        for k in s.labels:
            if not _LABEL.fullmatch(k) or k.startswith("__"):
                raise InvalidInputError(f"metric {s.name}: label name {k!r} is not a Prometheus label name")
        by_name.setdefault(s.name, []).append(s)
    lines: list[str] = []
    for name, group in by_name.items():
        lines.append(f"# HELP {name} {_escape(group[0].help)}")
        lines.append(f"# TYPE {name} {group[0].kind}")
        for s in group:
            lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(s.labels.items()))
            lines.append(f"{name}{{{lab}}} {_number(s.value)}" if lab else f"{name} {_number(s.value)}")
    return "\n".join(lines) + "\n"


def write_textfile(path: str | os.PathLike[str], text: str) -> None:
    """Publish ``text`` at ``path`` atomically (temporary file, fsync, rename).
    node_exporter's textfile collector reads only ``*.prom`` files, so a name
    ending otherwise is refused."""
    p = os.fspath(path)
    if not p.endswith(".prom"):
        raise InvalidInputError(f"{p}: a metrics textfile must end in .prom (node_exporter reads only those)")
    d = os.path.dirname(os.path.abspath(p))
    fd, tmp = tempfile.mkstemp(prefix=".ckptstore-metrics-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
