"""Storage is input: strict, bounded decoding of every record, and the
consistency checks a forger must defeat (PROTOCOL.md §2, §4.2, §4.4, §4.5).

Hostile objects are planted with RawAccess, which bypasses the backend, on the
memory and local backends and on a real S3 server (moto)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import CheckpointStore, CorruptionError, OpenOptions, SaveState, SkipReason, StoreUnavailableError
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.cli.commands import main as cli_main
from ckptstore.protocol.records import MAX_COMMIT_RECORD, AttemptRecord, CommitRecord, EventRecord, RunRecord
from tests.helpers import IDENT, RawAccess

HOSTILE_BACKENDS = pytest.mark.backends("memory", "local", "moto")


def _save(store: CheckpointStore, step: int, payload: bytes | None = None) -> P.CommitRecord:
    with store.save(step) as s:
        s.put("model", payload or f"weights@{step}".encode())
    assert s.ref is not None
    return s.ref.record


def _store(factory: Callable[[], Backend], **kw: object) -> CheckpointStore:
    return CheckpointStore.open(factory(), "run", identity=IDENT, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- decoding


GOOD_COMMIT = CommitRecord(
    "run", 7, 1, P.new_save_id(7, 1), "w" * 32, "a" * 64, {"m": P.ComponentEntry("m", 3, "b" * 64)}, 1.5e9, {"k": 1}
)


def test_good_records_round_trip() -> None:
    assert CommitRecord.decode(GOOD_COMMIT.encode(), "x") == GOOD_COMMIT
    a = AttemptRecord("run", 3, 7, "w1", 1.0, (1, 2), "host")
    assert AttemptRecord.decode(a.encode(), "x") == a
    r = RunRecord("run", {"k": [1, "v"]}, "c" * 64, 2.0, None)
    assert RunRecord.decode(r.encode(), "x") == r
    e = EventRecord("progress", 3.0, 2, {"step": 4})
    assert EventRecord.decode(e.encode(), "x") == e


def _mutated(**changes: object) -> bytes:
    rec = GOOD_COMMIT.to_record()
    rec.update(changes)
    return json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b'{"protocol_version":1}',
        _mutated(step=1e400).replace(b"Infinity", b"1e400"),
        _mutated(created_at=1e400).replace(b"Infinity", b"1e400"),
        _mutated(step=10**50),
        _mutated(metadata={"x": "\ud800"}) if False else _mutated().replace(b'"k":1', b'"k":"\\ud800"'),
        _mutated().replace(b'"k":1', b'"k":NaN'),
        _mutated().replace(b'"k":1', b'"k":1,"k":2'),
        _mutated().replace(b'"k":1', b'"k":' + b"[" * 5000 + b"]" * 5000),
        _mutated(step=True),
        _mutated(step=-1),
        _mutated(attempt=0),
        _mutated(save_id=P.new_save_id(8, 1)),  # names another step
        _mutated(components={"../x": {"size": 1, "blake3": "0" * 64}}),
        _mutated(components={"m": {"size": -1, "blake3": "0" * 64}}),
        _mutated(components={"m": {"size": 1, "blake3": "xyz"}}),
        _mutated(identity_digest=None),
        _mutated(kind="run"),
        b" " + GOOD_COMMIT.encode(),  # not canonical
        json.dumps(GOOD_COMMIT.to_record(), indent=1).encode(),  # not canonical
    ],
)
def test_malformed_commit_records_are_corruption_errors(data: bytes) -> None:
    with pytest.raises(CorruptionError):
        CommitRecord.decode(data, "planted")


def test_newer_version_is_its_own_error() -> None:
    with pytest.raises(P.UnsupportedVersion):
        CommitRecord.decode(_mutated(protocol_version=P.PROTOCOL_VERSION + 1), "x")


def test_oversized_record_refused_before_parsing() -> None:
    with pytest.raises(CorruptionError, match="more than"):
        CommitRecord.decode(b"{" + b" " * (MAX_COMMIT_RECORD + 10) + b"}", "x")


def test_commit_must_match_its_key() -> None:
    with pytest.raises(CorruptionError):
        CommitRecord.decode(GOOD_COMMIT.encode(), "x", step=8, attempt=1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_fuzz_every_parser_raises_only_corruption(data: bytes) -> None:
    for decode in (
        lambda d: CommitRecord.decode(d, "f"),
        lambda d: AttemptRecord.decode(d, "f"),
        lambda d: RunRecord.decode(d, "f"),
        lambda d: EventRecord.decode(d, "f"),
        lambda d: P.decode_json(d, where="f", max_bytes=300),
    ):
        try:
            decode(data)
        except CorruptionError:
            pass


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(JSONISH, st.sampled_from(["step", "attempt", "save_id", "components", "metadata", "created_at", "ranks"]))
def test_fuzz_commit_fields_raise_only_corruption(value: object, field: str) -> None:
    rec = GOOD_COMMIT.to_record()
    rec[field] = value
    try:
        data = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError):
        return
    try:
        CommitRecord.decode(data, "f")
    except CorruptionError:
        pass


# ------------------------------------------- names: one spelling (PROTOCOL.md §1)

#: characters another parser might read as a digit: other scripts' digits, superscripts, fractions ...
OTHER_DIGITS = st.characters(categories=("Nd", "No", "Nl"), exclude_characters="0123456789")
STEPS = st.integers(min_value=0, max_value=P.MAX_STEP)
ATTEMPTS = st.integers(min_value=1, max_value=P.MAX_ATTEMPT)
HEX = st.text("0123456789abcdef", min_size=1, max_size=1)


def _names(version: int) -> dict[str, tuple[Callable[[str], object], Callable[[str, object], str | None]]]:
    """Parser of each kind of name, and the canonical spelling of what it parsed
    (from the parsed value and the name's random tail)."""
    layout = P.layout_of(version)
    return {
        "commit": (layout.parse_commit_name, lambda n, v: layout.commit_name(*v)),  # type: ignore[misc]
        "attempt": (P.parse_attempt_name, lambda n, v: f"{v:08d}.json"),
        "save-id": (P.parse_save_id, lambda n, v: f"{v[0]:012d}-{v[1]:08d}-{n[-12:]}"),  # type: ignore[index]
        "event": (P.parse_event_name, lambda n, v: f"{v[0]:020d}-{v[1]}-{n[-13:]}"),  # type: ignore[index]
    }


@st.composite
def _name_and_edits(draw: st.DrawFn) -> tuple[int, str, str, str]:
    version = draw(st.sampled_from([1, 2]))
    kind = draw(st.sampled_from(["commit", "attempt", "save-id", "event"]))
    step, attempt = draw(STEPS), draw(ATTEMPTS)
    rand = "".join(draw(st.lists(HEX, min_size=12, max_size=12)))
    name = {
        "commit": P.layout_of(version).commit_name(step, attempt),
        "attempt": f"{attempt:08d}.json",
        "save-id": f"{step:012d}-{attempt:08d}-{rand}",
        "event": f"{step:020d}-{draw(st.from_regex(r'[A-Za-z0-9_-]{1,8}', fullmatch=True))}-{rand[:8]}.json",
    }[kind]
    mutated = list(name)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        at = draw(st.integers(min_value=0, max_value=len(mutated)))
        ch = draw(OTHER_DIGITS | st.sampled_from(list("0123456789\n\t /.-+_")) | st.characters())
        how = draw(st.sampled_from(["replace", "insert"]))
        if how == "replace" and at < len(mutated):
            mutated[at] = ch
        else:
            mutated.insert(at, ch)
    return version, kind, name, "".join(mutated)


@settings(max_examples=1500, deadline=None)
@given(_name_and_edits())
def test_fuzz_names_parse_only_in_their_one_spelling(case: tuple[int, str, str, str]) -> None:
    """A canonical name parses; any edit of it (another script's digit,
    a superscript, a newline, a sign ...) parses only if it is itself the
    canonical spelling of what it parses to: never a twin of another name."""
    version, kind, name, mutated = case
    parse, spell = _names(version)[kind]
    value = parse(name)
    assert value is not None and spell(name, value) == name, name
    got = parse(mutated)
    if got is not None:
        assert mutated.isascii() and spell(mutated, got) == mutated, (name, mutated, got)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=2), st.integers(min_value=0, max_value=47), OTHER_DIGITS),
                min_size=1, max_size=12))
def test_fuzz_listings_with_twins_of_real_names(twins: list[tuple[int, int, str]]) -> None:
    """Twins of real commit, attempt and save names (a digit respelled in another
    script), with junk bytes: selection, listing and gc see exactly the real
    saves, and gc deletes no planted twin."""
    b = MemoryBackend("twins")
    st_ = CheckpointStore.open(b, "run", identity=IDENT)
    refs = [_save(st_, s) for s in (1, 2)]
    real = [P.LATEST_LAYOUT.commit_key("run", 2, 1), P.attempt_key("run", 1), P.component_key("run", refs[1].save_id, "model")]
    planted = {}
    for which, at, ch in twins:
        key = real[which]
        digits = [i for i, c in enumerate(key) if c.isdigit() and i > len("run/")]
        i = digits[at % len(digits)]
        planted[key[:i] + ch + key[i + 1 :]] = b"twin"
    raw = RawAccess(b)
    for k, v in planted.items():
        raw.set(k, v)
    reader = CheckpointStore.open(b, "run", mode="r")
    assert [(i.step, i.state) for i in reader.list_saves(deep=True)] == [(2, SaveState.COMMITTED), (1, SaveState.COMMITTED)]
    rep = reader.gc(keep_last=1, grace_seconds=0)
    assert rep.refused is None and [s for s, _ in rep.deleted_saves] == [refs[0].save_id]
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.save_id == refs[1].save_id and reader.read(latest, "model") == b"weights@2"
    assert all(raw.get(k) == v for k, v in planted.items())


def _careful(data: bytes) -> object:
    """What the careful (hook-based) canonical decoder says: the value, or the CorruptionError class."""
    from ckptstore.protocol import canonical

    fast = canonical._canonical_fast
    try:
        canonical._canonical_fast = lambda d: canonical._CAREFUL  # type: ignore[assignment]
        return P.decode_json(data, where="f", max_bytes=1 << 20, canonical=True)
    except CorruptionError:
        return CorruptionError
    finally:
        canonical._canonical_fast = fast  # type: ignore[assignment]


SPELLINGS = st.sampled_from([
    b"", b" ", b"1" * 25, b"-0", b"1e400", b"NaN", b"-Infinity", b'"\\ud800"', b'"\\u00e9"', b"\xc3\xa9", b"\xff",
    b'"k":1,"k":2', b"[" * 70, b"]" * 70, b"{" * 70, b"}" * 70, b"1.0", b"1.50", b"1E5", b",", b'"a":', b"9" * 24,
])


@settings(max_examples=500, deadline=None)
@given(JSONISH, st.lists(st.tuples(st.integers(min_value=0, max_value=400), SPELLINGS), max_size=3))
def test_fast_canonical_decoding_accepts_exactly_what_the_careful_one_does(value: object, edits: list) -> None:  # type: ignore[type-arg]
    try:
        data = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError):
        data = b"{}"
    for at, text in edits:  # splice hostile spellings in anywhere
        data = data[:at] + text + data[at:]
    want = _careful(data)
    try:
        got: object = P.decode_json(data, where="f", max_bytes=1 << 20, canonical=True)
    except CorruptionError:
        got = CorruptionError
    assert got == want or (got != got and want != want), (data[:200], got, want)  # NaN never decodes: no NaN values


# ------------------------------------------------------------ on a store


@HOSTILE_BACKENDS
@pytest.mark.parametrize("junk", [b"garbage\x00", b"", b'{"protocol_version":99,"kind":"attempt"}'])
def test_junk_attempt_record_hides_nothing_and_blocks_gc(backend_factory: Callable[[], Backend], junk: bytes) -> None:
    st = _store(backend_factory)
    _save(st, 1)
    good = _save(st, 2)
    RawAccess(backend_factory()).set(P.attempt_key("run", 2), junk)
    reader = CheckpointStore.open(backend_factory(), "run", mode="r")
    sel = reader.latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.save_id == good.save_id
    assert any("attempt record 2" in n for n in sel.notes)
    # a new writer takes number 3 (never the junk one's) and resumes from step 2
    st2 = _store(backend_factory)
    assert st2.attempt is not None and st2.attempt.number == 3
    assert st2.resumed_from is not None and st2.resumed_from.step == 2
    rep = st2.gc(keep_last=1, grace_seconds=0)
    assert rep.refused and "attempt record 2" in rep.refused and not rep.actions
    assert [i.step for i in st2.list_saves() if i.state is SaveState.COMMITTED] == [2, 1]


@HOSTILE_BACKENDS
def test_attempt_number_at_the_top_refuses_a_writer_clearly(backend_factory: Callable[[], Backend]) -> None:
    st = _store(backend_factory)
    _save(st, 1)
    top = AttemptRecord("run", P.MAX_ATTEMPT, 1, "zz", 1.0)  # resumed from 1: fences nothing
    RawAccess(backend_factory()).set(P.attempt_key("run", P.MAX_ATTEMPT), top.encode())
    with pytest.raises(StoreUnavailableError, match="exhausted"):
        _store(backend_factory)
    assert CheckpointStore.open(backend_factory(), "run", mode="r").latest_complete() is not None


@HOSTILE_BACKENDS
def test_copied_commit_with_edited_step_is_never_selected(backend_factory: Callable[[], Backend]) -> None:
    st = _store(backend_factory)
    rec = _save(st, 1)
    forged = rec.to_record()
    forged["step"] = 900
    data = json.dumps(forged, sort_keys=True, separators=(",", ":")).encode()
    RawAccess(backend_factory()).set(P.LATEST_LAYOUT.commit_key("run", 900, 1), data)
    sel = CheckpointStore.open(backend_factory(), "run", mode="r").latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == 1
    assert sel.skipped[0].step == 900 and sel.skipped[0].reason is SkipReason.UNREADABLE_RECORD


@HOSTILE_BACKENDS
def test_forged_old_commit_naming_the_newest_save_cannot_make_gc_delete_it(
    backend_factory: Callable[[], Backend],
) -> None:
    st = _store(backend_factory)
    for s in (1, 2, 3):
        newest = _save(st, s)
    forged = newest.to_record()
    forged["step"] = 0
    forged["save_id"] = newest.save_id
    RawAccess(backend_factory()).set(
        P.LATEST_LAYOUT.commit_key("run", 0, 1), json.dumps(forged, sort_keys=True, separators=(",", ":")).encode()
    )
    st.gc(keep_last=1, grace_seconds=0)
    reader = CheckpointStore.open(backend_factory(), "run", mode="r")
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.save_id == newest.save_id
    assert reader.read(latest, "model") == b"weights@3"


@HOSTILE_BACKENDS
@pytest.mark.parametrize(
    "payload",
    [b'{"protocol_version":1e400}', b'{"protocol_version":' + b"9" * 5000 + b"}", b"[" * 100000,
     b'{"kind":"commit","protocol_version":1,"run_id":"\\udc80"}'],
)
def test_pathological_records_are_errors_not_crashes(backend_factory: Callable[[], Backend], payload: bytes) -> None:
    st = _store(backend_factory)
    good = _save(st, 1)
    raw = RawAccess(backend_factory())
    raw.set(P.LATEST_LAYOUT.commit_key("run", 5, 1), payload)
    raw.set(P.run_record_key("other"), payload)
    reader = CheckpointStore.open(backend_factory(), "run", mode="r")
    sel = reader.latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.save_id == good.save_id
    assert sel.skipped[0].reason is SkipReason.UNREADABLE_RECORD
    assert _store(backend_factory).resumed_from is not None  # a writer still opens and resumes
    with pytest.raises(CorruptionError):
        CheckpointStore.open(backend_factory(), "other", mode="r")


def test_junk_commits_of_unregistered_attempts_are_not_read() -> None:
    mem = MemoryBackend()
    st = CheckpointStore.open(mem, "run", identity=IDENT)
    good = _save(st, 1)
    raw = RawAccess(mem)
    for i in range(2000):
        raw.set(P.LATEST_LAYOUT.commit_key("run", 10 + i, 77), b"junk" * 100)
    counting = FaultyBackend(mem)
    sel = CheckpointStore.open(counting, "run", mode="r").latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.save_id == good.save_id
    reads = [t for t in counting.trace if t.op in ("get", "get_range")]
    assert len(reads) < 10, counting.format_trace()[-2000:]
    assert len(sel.skipped) == 100 and sel.more_skipped == 1900
    assert sel.skipped[0].reason is SkipReason.UNREGISTERED_ATTEMPT


def test_oversized_component_reads_stay_bounded() -> None:
    mem = MemoryBackend()
    # version 2: plants an oversized whole component under saves/
    st = CheckpointStore.open(mem, "run", identity=IDENT, options=OpenOptions(protocol_version=2))
    ref = CheckpointStore.open(mem, "run", mode="r").latest_complete() or None
    assert ref is None
    good = _save(st, 1, b"x" * 100)
    key = P.component_key("run", good.save_id, "model")
    RawAccess(mem).set(key, b"x" * 10_000_000)  # the component grew behind the store's back
    counting = FaultyBackend(mem)
    reader = CheckpointStore.open(counting, "run", mode="r")
    with pytest.raises(CorruptionError):
        reader.read(reader.get_save(1), "model")
    ranges = [t for t in counting.trace if t.op == "get_range" and t.key == key]
    assert ranges, counting.format_trace()
    assert sum(int(t.outcome.split()[1][:-1]) for t in ranges) <= 101  # recorded size + 1, not 10 MB


def test_cli_prints_one_line_for_a_corrupt_run_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptstore.backends.local import LocalBackend

    b = LocalBackend(str(tmp_path))
    RawAccess(b).set(P.run_record_key("bad"), b'{"protocol_version":1e400}')
    rc = cli_main(["ls", str(tmp_path), "bad"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "CorruptionError" in err[0]
