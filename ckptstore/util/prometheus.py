"""Prometheus metrics through the official client, ``prometheus-client`` (extra ``metrics``).

ckptstore describes its metrics as :class:`Sample` values (no dependency);
this module hands them to the client, which owns the text format:

* :func:`registry` — a ``prometheus_client.CollectorRegistry`` that reads the
  samples afresh at every scrape (serve it from your own HTTP endpoint with
  ``prometheus_client.start_http_server(port, registry=...)`` or
  ``make_wsgi_app(registry)``);
* :func:`render` — the text exposition format (version 0.0.4), the client's
  ``generate_latest``;
* :func:`write_textfile` — a file for node_exporter's textfile collector, the
  client's ``write_to_textfile`` (written beside the target, then renamed over
  it, so the collector never reads half a file).

Without the extra, each raises :class:`~ckptstore.errors.ExtraRequiredError`
naming ``pip install 'ckptstore[metrics]'``; importing this module never needs
it. Metric and label names are checked here (one spelling: the classic
Prometheus names, a counter's ending in ``_total``) so the names a dashboard
uses do not depend on the client's version; label values are escaped by the
client.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from ..errors import ExtraRequiredError, InvalidInputError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

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


def client(what: str = "Prometheus metrics") -> ModuleType:
    """The ``prometheus_client`` module, or the one-line error naming the extra."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ExtraRequiredError(what, "metrics", "prometheus-client") from exc
    return prometheus_client


def _check(s: Sample) -> None:
    if not _NAME.fullmatch(s.name):
        raise InvalidInputError(f"metric name {s.name!r} is not a Prometheus name")
    if s.kind not in KINDS:
        raise InvalidInputError(f"metric {s.name}: type must be one of {KINDS}")
    if s.kind == "counter" and not s.name.endswith("_total"):
        raise InvalidInputError(f"metric {s.name}: a counter's name ends in _total")
    for k in s.labels:
        if not _LABEL.fullmatch(k) or k.startswith("__"):
            raise InvalidInputError(f"metric {s.name}: label name {k!r} is not a Prometheus label name")


def families(samples: Iterable[Sample]) -> list[Metric]:
    """The samples as the client's metric families: one per name, in
    first-seen order, each with its help and type. Invalid names are refused."""
    from prometheus_client.metrics_core import Metric

    by_name: dict[str, Metric] = {}
    for s in samples:
        _check(s)
        fam = by_name.get(s.name)
        if fam is None:
            # the client names a counter family without its _total suffix and adds it to the sample
            base = s.name[: -len("_total")] if s.kind == "counter" else s.name
            fam = by_name[s.name] = Metric(base, s.help, s.kind)
        fam.add_sample(s.name, {k: str(v) for k, v in s.labels.items()}, float(s.value))
    return list(by_name.values())


class _Samples:
    """A collector whose samples are read from ``source`` at every collection."""

    def __init__(self, source: Callable[[], Iterable[Sample]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from families(self.source())


def registry(samples: Iterable[Sample] | Callable[[], Iterable[Sample]]) -> CollectorRegistry:
    """A ``prometheus_client.CollectorRegistry`` holding ``samples`` — a list
    (fixed values) or a function returning them (read at every scrape)."""
    pc = client()
    source: Callable[[], Iterable[Sample]]
    if callable(samples):
        source = samples
    else:
        fixed = list(samples)
        families(fixed)  # refuse invalid names now, not at the first scrape
        source = lambda: fixed  # noqa: E731
    reg: CollectorRegistry = pc.CollectorRegistry(auto_describe=False)
    reg.register(_Samples(source))  # a collector is any object with collect()
    return reg


def render(samples: Iterable[Sample]) -> str:
    """The text format: one ``# HELP`` and ``# TYPE`` line per metric name
    (in first-seen order), then its samples. Invalid names are refused."""
    pc = client()
    return bytes(pc.generate_latest(registry(samples))).decode("utf-8")


def write_textfile(path: str | os.PathLike[str], samples: Iterable[Sample]) -> None:
    """Publish ``samples`` at ``path`` for node_exporter's textfile collector,
    with the client's ``write_to_textfile`` (a temporary file in the same
    directory, renamed over ``path``). The collector reads only ``*.prom``
    files, so a name ending otherwise is refused."""
    p = os.fspath(path)
    if not p.endswith(".prom"):
        raise InvalidInputError(f"{p}: a metrics textfile must end in .prom (node_exporter reads only those)")
    pc = client(f"the metrics textfile {p}")
    pc.write_to_textfile(p, registry(samples))
