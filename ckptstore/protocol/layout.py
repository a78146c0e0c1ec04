"""Object layout: key names, their parsing, and input validation. Pure.

Every key ckptstore creates parses back with the functions here; anything in
the store whose name does not parse is not ckptstore's and is never deleted.

A run's commit records are named by its :class:`Layout`, fixed by the
protocol version of the run record (PROTOCOL.md §1.1): version 1 names them
oldest first, version 2 newest first, so that an ascending listing (what
object stores return) starts with the candidates selection tries first.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import InvalidInputError

RUN_RECORD = "RUN.json"
ATTEMPTS_DIR = "attempts"
SAVES_DIR = "saves"
COMMITS_DIR = "commits"
EVENTS_DIR = "events"
PIECES_DIR = "pieces"
INTENTS_DIR = "intents"

STEP_WIDTH = 12
ATTEMPT_WIDTH = 8
MAX_STEP = 10**STEP_WIDTH - 1
MAX_ATTEMPT = 10**ATTEMPT_WIDTH - 1

#: The newest protocol version this code reads and writes. Version 3 is version 2
#: plus pieces addressed by content (PROTOCOL.md §9); new runs get
#: :data:`DEFAULT_VERSION` unless their creator asks for another.
PROTOCOL_VERSION = 3
#: The version of runs created without asking for one (``ckptstore.options.new_run_version`` says
#: which options ask for version 2 instead).
DEFAULT_VERSION = 3
#: The first version whose saves store their bytes as shared pieces.
PIECES_VERSION = 3

#: Reserved for backends' temporary names (the local backend's temp files);
#: never part of a key, so a temporary can never be mistaken for an object.
RESERVED_MARK = ".ckpt-tmp-"

# One spelling per name (PROTOCOL.md §1): ASCII only (``[0-9]``, never ``\d``,
# which also matches other scripts' digits), whole-string matches (``$`` would
# accept a trailing newline), and every parser below accepts a name only if
# encoding its parsed value gives the same name back.
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}", re.ASCII)
_COMMIT_RE = re.compile(rf"([0-9]{{{STEP_WIDTH}}})\.([0-9]{{{ATTEMPT_WIDTH}}})\.json", re.ASCII)
_COMMIT_V2_RE = re.compile(
    rf"([0-9]{{{STEP_WIDTH}}})\.([0-9]{{{ATTEMPT_WIDTH}}})-([0-9]{{{STEP_WIDTH}}})\.([0-9]{{{ATTEMPT_WIDTH}}})\.json",
    re.ASCII,
)
_ATTEMPT_RE = re.compile(rf"([0-9]{{{ATTEMPT_WIDTH}}})\.json", re.ASCII)
_SAVE_ID_RE = re.compile(rf"([0-9]{{{STEP_WIDTH}}})-([0-9]{{{ATTEMPT_WIDTH}}})-([0-9a-f]{{12}})", re.ASCII)
_EVENT_RE = re.compile(r"([0-9]{20})-([A-Za-z0-9_-]{1,64})-([0-9a-f]{8})\.json", re.ASCII)
_HEX64_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)
_INTENT_RE = re.compile(rf"([0-9]{{{ATTEMPT_WIDTH}}})-([0-9a-f]{{12}})\.json", re.ASCII)
_EVENT_KIND_RE = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)


# ---------------------------------------------------------------------------
# validation of caller input (InvalidInputError: nothing has been written)


def validate_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not run_id:
        raise InvalidInputError("run ID must be a non-empty string")
    if not _RUN_ID_RE.fullmatch(run_id):
        raise InvalidInputError(
            f"run ID {run_id!r} is invalid: use 1-128 characters from letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return run_id


def validate_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidInputError(f"step must be an int, got {type(step).__name__}")
    if step < 0 or step > MAX_STEP:
        raise InvalidInputError(f"step must be between 0 and {MAX_STEP}, got {step}")
    return step


def is_component_name(name: object) -> bool:
    """A relative path of '/'-separated safe segments that can never escape the
    save's prefix (no absolute path, '..', '.', backslash, empty segment or
    reserved temporary marker)."""
    if not isinstance(name, str) or not name or len(name) > 512:
        return False
    return _component_name_ok(name)


#: Names parsed once per process for a listing read again (pure functions of the string; issue 32):
#: each memo holds at most this many, and starts again empty when full.
PARSE_MEMO = 1 << 15
_K = TypeVar("_K")
_V = TypeVar("_V")


def _memo(fn: Callable[[_K], _V]) -> Callable[[_K], _V]:
    """``fn`` (pure, of a hashable argument) with its results kept in a bounded dict."""
    seen: dict[_K, _V] = {}

    def cached(arg: _K) -> _V:
        try:
            return seen[arg]
        except KeyError:
            pass
        value = fn(arg)
        if len(seen) >= PARSE_MEMO:
            seen.clear()
        seen[arg] = value
        return value

    return cached


@_memo
def _component_name_ok(name: str) -> bool:
    return all(_SEGMENT_RE.fullmatch(seg) and RESERVED_MARK not in seg for seg in name.split("/"))


def validate_component_name(name: object) -> str:
    if not is_component_name(name):
        raise InvalidInputError(
            f"component name {str(name)[:80]!r} is invalid: use 1-512 characters, '/'-separated segments of "
            "letters, digits, '.', '_' and '-', none starting with '.' or '-', none empty, '.' or '..'"
        )
    assert isinstance(name, str)
    return name


def validate_event_kind(kind: object) -> str:
    if not isinstance(kind, str) or not _EVENT_KIND_RE.fullmatch(kind):
        raise InvalidInputError(f"event kind {str(kind)[:80]!r} must be 1-64 letters, digits, '-' or '_'")
    return kind


# ---------------------------------------------------------------------------
# keys


def run_prefix(run_id: str) -> str:
    return f"{run_id}/"


def run_record_key(run_id: str) -> str:
    return f"{run_id}/{RUN_RECORD}"


def attempts_prefix(run_id: str) -> str:
    return f"{run_id}/{ATTEMPTS_DIR}/"


def attempt_key(run_id: str, attempt: int) -> str:
    if not 1 <= attempt <= MAX_ATTEMPT:
        raise InvalidInputError(f"attempt number {attempt} is outside 1..{MAX_ATTEMPT}")
    return f"{run_id}/{ATTEMPTS_DIR}/{attempt:0{ATTEMPT_WIDTH}d}.json"


def commits_prefix(run_id: str) -> str:
    return f"{run_id}/{COMMITS_DIR}/"


def saves_prefix(run_id: str) -> str:
    return f"{run_id}/{SAVES_DIR}/"


def save_prefix(run_id: str, save_id: str) -> str:
    return f"{run_id}/{SAVES_DIR}/{save_id}/"


def component_key(run_id: str, save_id: str, name: str) -> str:
    return f"{run_id}/{SAVES_DIR}/{save_id}/{name}"


def events_prefix(run_id: str) -> str:
    return f"{run_id}/{EVENTS_DIR}/"


def pieces_prefix(run_id: str) -> str:
    return f"{run_id}/{PIECES_DIR}/"


def piece_key(run_id: str, holder: str, digest: str) -> str:
    """Where a piece lives: under the save that first wrote it (its *holder*),
    named by its BLAKE3 (PROTOCOL.md §9.1)."""
    return f"{run_id}/{PIECES_DIR}/{holder}/{digest}"


def parse_piece_key(run_id: str, key: str) -> tuple[str, str] | None:
    """(holder save ID, digest) of a listed piece key, only for exactly that
    canonical key; None for anything else (never a piece, never deleted)."""
    prefix = pieces_prefix(run_id)
    if not isinstance(key, str) or not key.startswith(prefix):
        return None
    holder, _, digest = key[len(prefix) :].partition("/")
    if parse_save_id(holder) is None or not _HEX64_RE.fullmatch(digest):
        return None
    return holder, digest


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _HEX64_RE.fullmatch(value) is not None


def intents_prefix(run_id: str) -> str:
    return f"{run_id}/{INTENTS_DIR}/"


def new_intent_key(run_id: str, attempt: int) -> str:
    """A fresh save-intent key of ``attempt`` (``intents/<attempt:08d>-<12 hex>.json``)."""
    if not 1 <= attempt <= MAX_ATTEMPT:
        raise InvalidInputError(f"attempt number {attempt} is outside 1..{MAX_ATTEMPT}")
    return f"{run_id}/{INTENTS_DIR}/{attempt:0{ATTEMPT_WIDTH}d}-{uuid.uuid4().hex[:12]}.json"


def parse_intent_key(run_id: str, key: str) -> int | None:
    """The attempt of a listed save-intent key in its one spelling; None otherwise."""
    prefix = intents_prefix(run_id)
    m = _INTENT_RE.fullmatch(key[len(prefix) :]) if isinstance(key, str) and key.startswith(prefix) else None
    if m is None:
        return None
    n = int(m.group(1))
    return n if 1 <= n <= MAX_ATTEMPT and f"{prefix}{n:0{ATTEMPT_WIDTH}d}-{m.group(2)}.json" == key else None


def event_name(usec: int, kind: str) -> str:
    return f"{usec:020d}-{validate_event_kind(kind)}-{uuid.uuid4().hex[:8]}.json"


def new_save_id(step: int, attempt: int) -> str:
    """Unique per save: step and attempt for humans, 48 random bits for uniqueness."""
    validate_step(step)
    if not 1 <= attempt <= MAX_ATTEMPT:
        raise InvalidInputError(f"attempt number {attempt} is outside 1..{MAX_ATTEMPT}")
    return f"{step:0{STEP_WIDTH}d}-{attempt:0{ATTEMPT_WIDTH}d}-{uuid.uuid4().hex[:12]}"


def parse_attempt_name(name: str) -> int | None:
    """The number of an attempt-record name (``<attempt:08d>.json``); None for
    any other name, another spelling of a number included."""
    m = _ATTEMPT_RE.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        return None
    n = int(m.group(1))
    return n if 1 <= n <= MAX_ATTEMPT and f"{n:0{ATTEMPT_WIDTH}d}.json" == name else None


def parse_save_id(save_id: str) -> tuple[int, int] | None:
    """(step, attempt) of a save ID; None for anything else, another spelling
    of the same numbers included."""
    return _parse_save_id(save_id) if isinstance(save_id, str) else None


@_memo
def _parse_save_id(save_id: str) -> tuple[int, int] | None:
    m = _SAVE_ID_RE.fullmatch(save_id)
    if m is None:
        return None
    step, attempt = int(m.group(1)), int(m.group(2))
    if attempt < 1 or f"{step:0{STEP_WIDTH}d}-{attempt:0{ATTEMPT_WIDTH}d}-{m.group(3)}" != save_id:
        return None
    return step, attempt


def parse_event_name(name: str) -> tuple[int, str] | None:
    """(microseconds, kind) of an event name; None for anything else."""
    m = _EVENT_RE.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        return None
    usec, kind = int(m.group(1)), m.group(2)
    return (usec, kind) if f"{usec:020d}-{kind}-{m.group(3)}.json" == name else None


def attempt_of_key(run_id: str, key: str) -> int | None:
    """The attempt number of a listed key, only if ``key`` is exactly that
    attempt's canonical key (PROTOCOL.md §1: one spelling per name): a key in
    a sub-folder of ``attempts/``, or any other spelling of a number, is None."""
    prefix = attempts_prefix(run_id)
    n = parse_attempt_name(key[len(prefix) :]) if key.startswith(prefix) else None
    return n if n is not None and attempt_key(run_id, n) == key else None


# ---------------------------------------------------------------------------
# commit-record names: the one thing the two layouts name differently


@dataclass(frozen=True)
class Layout:
    """How one run names its commit records (PROTOCOL.md §1.1).

    * version 1: ``<step:012d>.<attempt:08d>.json`` — oldest first in an
      ascending listing, so the newest candidate is known only after the
      whole ``commits/`` prefix was listed;
    * version 2: ``<S:012d>.<A:08d>-<step:012d>.<attempt:08d>.json`` with
      ``S = 10^12-1-step`` and ``A = 10^8-1-attempt`` — newest first: the
      first keys of an ascending listing are the candidates selection tries
      first. The plain step and attempt follow for people reading a bucket;
      a name parses only when both halves agree.

    Either way the name is a function of (step, attempt) alone, so two writers
    of one attempt and step race for one key (create-if-absent decides), and
    the names of one step share :meth:`step_prefix` and are contiguous in a
    listing.
    """

    version: int

    @property
    def newest_first(self) -> bool:
        return self.version >= 2

    @property
    def pieces(self) -> bool:
        """Saves of this version store their bytes as shared pieces (§9)."""
        return self.version >= PIECES_VERSION

    def commit_name(self, step: int, attempt: int) -> str:
        validate_step(step)
        if not 1 <= attempt <= MAX_ATTEMPT:
            raise InvalidInputError(f"attempt number {attempt} is outside 1..{MAX_ATTEMPT}")
        plain = f"{step:0{STEP_WIDTH}d}.{attempt:0{ATTEMPT_WIDTH}d}"
        if not self.newest_first:
            return f"{plain}.json"
        return f"{MAX_STEP - step:0{STEP_WIDTH}d}.{MAX_ATTEMPT - attempt:0{ATTEMPT_WIDTH}d}-{plain}.json"

    def commit_key(self, run_id: str, step: int, attempt: int) -> str:
        return f"{run_id}/{COMMITS_DIR}/{self.commit_name(step, attempt)}"

    def parse_commit_name(self, name: str) -> tuple[int, int] | None:
        """(step, attempt) of a commit-record name of this layout; None for
        anything else (a name of the other layout included)."""
        m = (_COMMIT_V2_RE if self.newest_first else _COMMIT_RE).fullmatch(name) if isinstance(name, str) else None
        if m is None:
            return None
        step, attempt = (int(m.group(3)), int(m.group(4))) if self.newest_first else (int(m.group(1)), int(m.group(2)))
        if not (0 <= step <= MAX_STEP and 1 <= attempt <= MAX_ATTEMPT) or self.commit_name(step, attempt) != name:
            return None  # another spelling (digits of another script, halves that disagree): not ours
        return step, attempt

    def commit_of_key(self, run_id: str, key: str) -> tuple[int, int] | None:
        """(step, attempt) of a listed key, only if ``key`` is exactly that
        commit's canonical key (a key in a sub-folder of ``commits/``, or any
        other spelling of the same numbers, is None)."""
        return _commit_of_key((self, run_id, key)) if isinstance(key, str) and isinstance(run_id, str) else None

    def _commit_of_key(self, run_id: str, key: str) -> tuple[int, int] | None:
        prefix = f"{run_id}/{COMMITS_DIR}/"
        sa = self.parse_commit_name(key[len(prefix) :]) if key.startswith(prefix) else None
        return sa if sa is not None and self.commit_key(run_id, *sa) == key else None

    @property
    def name_length(self) -> int:
        """Every commit-record name of this layout has this many characters."""
        return len(self.commit_name(0, 1))

    def step_prefix(self, step: int) -> str:
        """The start every commit-record name of ``step`` shares (and no other step's)."""
        return f"{(MAX_STEP - step) if self.newest_first else step:0{STEP_WIDTH}d}."


LAYOUT_V1 = Layout(1)
LAYOUT_V2 = Layout(2)
#: Version 3: the names of version 2, saves stored as pieces addressed by content.
LAYOUT_V3 = Layout(3)
#: The layout of runs created without asking for a version (``DEFAULT_VERSION``).
LATEST_LAYOUT = LAYOUT_V3
_LAYOUTS = {1: LAYOUT_V1, 2: LAYOUT_V2, 3: LAYOUT_V3}


def history_name(name: str) -> tuple[Layout, int, int] | None:
    """(naming, step, attempt) of a commit-record name under *any* version's
    pattern (THREATS.md §4.13): ``naming`` is :data:`LAYOUT_V1` for a
    version-1 name and :data:`LAYOUT_V2` for a name of versions 2 and 3 (they
    share one pattern); None for anything else. Such a name is history
    whatever the run record says: it was written by a writer of that naming,
    so a run record of the other naming disagrees with it."""
    for naming in (LAYOUT_V1, LAYOUT_V2):
        sa = naming.parse_commit_name(name)
        if sa is not None:
            return naming, sa[0], sa[1]
    return None


def naming_versions(naming: Layout) -> str:
    """The protocol versions whose commit records a naming names, in words."""
    return "1" if not naming.newest_first else "2 and 3"


def layout_of(version: int) -> Layout:
    """The layout of a run whose run record has ``version`` (1 … :data:`PROTOCOL_VERSION`)."""
    layout = _LAYOUTS.get(version) if isinstance(version, int) and not isinstance(version, bool) else None
    if layout is None:
        raise InvalidInputError(
            f"protocol version {version!r} is not one this ckptstore writes (1 … {PROTOCOL_VERSION})"
        )
    return layout


@_memo
def _commit_of_key(args: tuple[Layout, str, str]) -> tuple[int, int] | None:
    return args[0]._commit_of_key(args[1], args[2])
