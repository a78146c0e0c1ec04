"""The publication protocol in executable form: pure, no I/O.

* :mod:`.canonical` — the one canonical JSON encoder and the strict decoder;
* :mod:`.layout` — key names (a run's commit-name :class:`Layout`), their
  parsing, input validation;
* :mod:`.records` — typed run, attempt, commit and event records;
* :mod:`.selection` — which commits are in the run's history, candidate
  order, save states, skip reasons;
* :mod:`.gcplan` — what garbage collection keeps and deletes.

``protocol_spec/PROTOCOL.md`` is the normative text; the two must agree.
"""

from .canonical import canonical_json, decode_json
from .layout import (
    ATTEMPT_WIDTH,
    LATEST_LAYOUT,
    LAYOUT_V1,
    LAYOUT_V2,
    MAX_ATTEMPT,
    MAX_STEP,
    PROTOCOL_VERSION,
    RESERVED_MARK,
    RUN_RECORD,
    STEP_WIDTH,
    Layout,
    attempt_key,
    attempt_of_key,
    attempts_prefix,
    commits_prefix,
    component_key,
    event_name,
    events_prefix,
    is_component_name,
    layout_of,
    new_save_id,
    parse_attempt_name,
    parse_event_name,
    parse_save_id,
    run_prefix,
    run_record_key,
    save_prefix,
    saves_prefix,
    validate_component_name,
    validate_event_kind,
    validate_run_id,
    validate_step,
)
from .records import (
    AttemptRecord,
    CommitRecord,
    ComponentEntry,
    EventRecord,
    RunRecord,
    UnsupportedVersion,
    digest_bytes,
    now,
)

__all__ = [
    "ATTEMPT_WIDTH",
    "LATEST_LAYOUT",
    "LAYOUT_V1",
    "LAYOUT_V2",
    "MAX_ATTEMPT",
    "MAX_STEP",
    "PROTOCOL_VERSION",
    "RESERVED_MARK",
    "RUN_RECORD",
    "STEP_WIDTH",
    "AttemptRecord",
    "CommitRecord",
    "ComponentEntry",
    "EventRecord",
    "Layout",
    "RunRecord",
    "UnsupportedVersion",
    "attempt_key",
    "attempt_of_key",
    "attempts_prefix",
    "canonical_json",
    "commits_prefix",
    "component_key",
    "decode_json",
    "digest_bytes",
    "event_name",
    "events_prefix",
    "is_component_name",
    "layout_of",
    "new_save_id",
    "now",
    "parse_attempt_name",
    "parse_event_name",
    "parse_save_id",
    "run_prefix",
    "run_record_key",
    "save_prefix",
    "saves_prefix",
    "validate_component_name",
    "validate_event_kind",
    "validate_run_id",
    "validate_step",
]
