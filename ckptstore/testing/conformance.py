"""The backend conformance suite, written once (the zarr ``StoreTests`` idea).

Subclass :class:`BackendConformance` in a pytest module, give it a
``backend`` fixture that returns a fresh, empty backend (a unique prefix is
enough), and tell it how to reach the storage underneath without the
backend's own methods: override :meth:`~BackendConformance.set_raw`,
:meth:`~BackendConformance.get_raw` and :meth:`~BackendConformance.delete_raw`
(or return a :class:`~ckptstore.testing.raw.RawStorage` from a
``raw_storage`` fixture, as ckptstore's own backends do). Every backend
ckptstore ships runs exactly this class; how to write one is in
:mod:`ckptstore.testing`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from ..backends.base import MAX_KEY_DEPTH, Backend
from ..errors import LimitReachedError, NotFoundError
from .raw import RawStorage


def race_create_round(
    backend: Backend, create: Callable[[str, bytes], bool], key: str, *, exclusive: bool = True, writers: int = 8
) -> tuple[str, list[bool | None]] | None:
    """One round of ``writers`` threads calling ``create(key, b"writer-<i>")`` at
    the same moment; None when the round kept the create-if-absent promise (at
    least one winner, the stored bytes a winner's, and with ``exclusive`` exactly
    one winner), else ``(key, each thread's answer)`` to report."""
    results: list[bool | None] = [None] * writers
    barrier = threading.Barrier(writers)

    def go(i: int) -> None:
        barrier.wait()
        results[i] = create(key, f"writer-{i}".encode())

    ts = [threading.Thread(target=go, args=(i,)) for i in range(writers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    winners = [i for i, ok in enumerate(results) if ok]
    ok = bool(winners) and backend.get(key) in {f"writer-{i}".encode() for i in winners}
    if exclusive:
        ok = ok and len(winners) == 1
    return None if ok else (key, results)


class BackendConformance:
    """Behaviour every :class:`Backend` must show.

    Needs a ``backend`` fixture. The storage underneath is reached through
    :meth:`set_raw`, :meth:`get_raw` and :meth:`delete_raw`; override them (a
    third-party backend, with its private access), or override the
    ``raw_storage`` fixture to return a :class:`~ckptstore.testing.raw.RawStorage`
    (ckptstore's own backends: the fixture knows which backend it made and
    picks :class:`~ckptstore.testing.raw.MemoryRaw`, ``LocalRaw``, ...).

    Capability flags, both fixtures to override: ``create_is_atomic_under_races``
    (default True; answer False only for a test double whose conditional write
    is not atomic, such as moto: the race test then asserts what still holds,
    at least one winner and a winner's bytes stored, instead of exactly one
    winner) and ``race_rounds`` (how many rounds of 8 racing creates; default 3).
    """

    @pytest.fixture
    def raw_storage(self) -> RawStorage | None:
        """Direct access to the storage under ``backend``; None: the raw methods are overridden."""
        return None

    @pytest.fixture(autouse=True)
    def _bind_raw_storage(self, raw_storage: RawStorage | None) -> None:
        self._raw = raw_storage

    @pytest.fixture
    def create_is_atomic_under_races(self) -> bool:
        """Whether ``create`` gives exactly one winner to concurrent callers (PROTOCOL.md §7.1)."""
        return True

    @pytest.fixture
    def race_rounds(self) -> int:
        """Rounds of the racing-create test."""
        return 3

    def _raw_storage(self) -> RawStorage:
        raw: RawStorage | None = getattr(self, "_raw", None)
        if raw is None:
            raise NotImplementedError(
                f"{type(self).__name__}: the conformance suite needs direct access to the storage under the "
                "backend: override set_raw, get_raw and delete_raw (or return a RawStorage from a raw_storage "
                "fixture); see ckptstore.testing"
            )
        return raw

    def set_raw(self, backend: Backend, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` straight on the storage (replacing), as if another
        program wrote it: the backend's own methods are not used."""
        self._raw_storage().set(key, data)

    def get_raw(self, backend: Backend, key: str) -> bytes | None:
        """The bytes really stored at ``key``, or None if nothing is, read past the backend."""
        return self._raw_storage().get(key)

    def delete_raw(self, backend: Backend, key: str) -> None:
        """Remove whatever is stored at ``key`` (nothing if absent), past the backend."""
        self._raw_storage().delete(key)

    def test_put_lands_as_ground_truth(self, backend: Backend) -> None:
        backend.put("g/t/obj", [b"abc", b"def"])
        assert self.get_raw(backend, "g/t/obj") == b"abcdef"

    def test_planted_object_is_seen(self, backend: Backend) -> None:
        self.set_raw(backend, "g/planted", b"xyz")
        assert backend.get("g/planted") == b"xyz"
        assert backend.size("g/planted") == 3
        assert [o.key for o in backend.list("g/")] == ["g/planted"]

    def test_create_never_replaces_a_planted_object(self, backend: Backend) -> None:
        self.set_raw(backend, "g/rec", b"theirs")
        assert backend.create("g/rec", b"ours") is False
        assert self.get_raw(backend, "g/rec") == b"theirs"

    def test_get_range_is_bounded(self, backend: Backend) -> None:
        self.set_raw(backend, "g/big", b"x" * 5000)
        assert backend.get_range("g/big", 0, 11) == b"x" * 11
        assert backend.get_range("g/big", 4990, 6000) == b"x" * 10
        assert backend.get_range("g/big", 6000, 6001) == b""

    def test_delete_removes_ground_truth(self, backend: Backend) -> None:
        self.set_raw(backend, "g/d", b"1")
        backend.delete("g/d")
        assert self.get_raw(backend, "g/d") is None

    def test_object_removed_behind_the_backend_is_missing(self, backend: Backend) -> None:
        backend.put("g/gone", [b"1"])
        self.delete_raw(backend, "g/gone")
        assert not backend.exists("g/gone") and backend.list("g/") == []
        with pytest.raises(NotFoundError):
            backend.get("g/gone")

    def test_object_of_several_parts(self, backend: Backend) -> None:
        """Larger than two 16 MiB upload parts, fed in odd-sized chunks."""
        part = bytes(range(256)) * 4096  # 1 MiB
        data = part * 33 + b"tail"
        chunks = [data[i : i + 3_000_001] for i in range(0, len(data), 3_000_001)]
        backend.put("big/obj", chunks)
        assert backend.size("big/obj") == len(data)
        assert self.get_raw(backend, "big/obj") == data
        assert backend.get_range("big/obj", 16 * 2**20 - 5, 16 * 2**20 + 5) == data[16 * 2**20 - 5 : 16 * 2**20 + 5]

    def test_incomplete_hooks_are_safe_on_an_empty_prefix(self, backend: Backend) -> None:
        assert backend.list_incomplete("nothing-here/", 1e12) == []

    def test_put_get_roundtrip(self, backend: Backend) -> None:
        backend.put("a/b/c.bin", [b"hello ", memoryview(b"world")])
        assert backend.get("a/b/c.bin") == b"hello world"
        assert backend.size("a/b/c.bin") == 11

    def test_empty_object(self, backend: Backend) -> None:
        backend.put("e/empty", [])
        assert backend.get("e/empty") == b""
        assert [o.key for o in backend.list("e/")] == ["e/empty"]

    def test_put_replaces(self, backend: Backend) -> None:
        backend.put("k", [b"one"])
        backend.put("k", [b"two-two"])
        assert backend.get("k") == b"two-two"

    def test_get_range(self, backend: Backend) -> None:
        data = bytes(range(256)) * 40
        backend.put("r", [data])
        assert backend.get_range("r", 0, 10) == data[:10]
        assert backend.get_range("r", 5000, 6000) == data[5000:6000]
        assert backend.get_range("r", len(data) - 3, len(data) + 100) == data[-3:]

    def test_readinto(self, backend: Backend) -> None:
        data = bytes(range(256)) * 40
        backend.put("r", [data])
        out = bytearray(100)
        assert backend.readinto("r", 5000, memoryview(out)) == 100 and bytes(out) == data[5000:5100]
        tail = bytearray(10)
        assert backend.readinto("r", len(data) - 3, memoryview(tail)) == 3 and bytes(tail[:3]) == data[-3:]
        assert backend.readinto("r", len(data), memoryview(bytearray(1))) == 0
        with pytest.raises(NotFoundError):
            backend.readinto("nope", 0, memoryview(bytearray(1)))

    def test_missing_raises_not_found(self, backend: Backend) -> None:
        with pytest.raises(NotFoundError):
            backend.get("nope")
        with pytest.raises(NotFoundError):
            backend.size("nope/deeper")
        with pytest.raises(NotFoundError):
            backend.get_range("nope", 0, 1)
        assert not backend.exists("nope")

    def test_delete_and_missing_delete(self, backend: Backend) -> None:
        backend.put("d/x", [b"1"])
        backend.delete("d/x")
        assert not backend.exists("d/x")
        backend.delete("d/x")  # no error
        assert backend.list("d/") == []

    def test_list_is_recursive_sorted_and_prefix_bound(self, backend: Backend) -> None:
        for k in ["p/b", "p/a/1", "p/a/2", "pq/x", "other/y"]:
            backend.put(k, [k.encode()])
        got = backend.list("p/")
        assert [o.key for o in got] == ["p/a/1", "p/a/2", "p/b"]
        assert [o.size for o in got] == [5, 5, 3]
        assert all(o.mtime > 0 for o in got)
        assert [o.key for o in backend.list("p/a/")] == ["p/a/1", "p/a/2"]
        assert backend.list("missing/") == []

    def test_list_of_a_prefix_ending_mid_name(self, backend: Backend) -> None:
        for k in ["m/12-a/x", "m/12-a/y/z", "m/12-b/x", "m/13-a/x", "m/12", "m/2"]:
            backend.put(k, [k.encode()])
        assert [o.key for o in backend.list("m/12-")] == ["m/12-a/x", "m/12-a/y/z", "m/12-b/x"]
        assert [o.key for o in backend.list("m/12")] == ["m/12", "m/12-a/x", "m/12-a/y/z", "m/12-b/x"]
        assert [o.key for o in backend.list("m/12-a/")] == ["m/12-a/x", "m/12-a/y/z"]
        assert backend.list("m/14") == []

    def test_a_listed_version_is_stable_and_changes_with_a_same_size_rewrite(self, backend: Backend) -> None:
        """``ObjectInfo.version`` (where the backend reports one) is the piece evidence of
        PROTOCOL.md §9.2: the same until the object is written again, and different after a
        rewrite of the same size even within the server's clock resolution (SeaweedFS lists
        whole seconds, so ``mtime`` alone would not show it)."""
        backend.put("ver/x", [b"A" * 64])
        (first,) = backend.list("ver/")
        (again,) = backend.list("ver/")
        assert (again.size, again.mtime, again.version) == (first.size, first.mtime, first.version)
        if not first.version:
            return  # the backend reports no version: its evidence is size and mtime (local: ns mtime)
        self.set_raw(backend, "ver/x", b"B" * 64)
        (after,) = backend.list("ver/")
        assert after.size == first.size
        assert after.version and after.version != first.version

    def test_deferred_puts_land_when_settled(self, backend: Backend) -> None:
        pending = [backend.put_deferred(f"dfr/a/{i}", [b"x" * i, b"y"]) for i in range(5)]
        pending.append(backend.put_deferred("dfr/b/one", [b"one"]))
        backend.settle(pending)
        backend.settle([])
        for i in range(5):
            assert self.get_raw(backend, f"dfr/a/{i}") == b"x" * i + b"y"
        assert backend.get("dfr/b/one") == b"one"
        assert [o.key for o in backend.list("dfr/")] == [*(f"dfr/a/{i}" for i in range(5)), "dfr/b/one"]

    def test_list_after_deleting_everything_is_empty(self, backend: Backend) -> None:
        backend.put("gone/a/x", [b"1"])
        backend.delete("gone/a/x")
        assert backend.list("gone/") == []
        assert backend.list("gone/a/") == []

    def test_create_if_absent(self, backend: Backend) -> None:
        assert backend.create("c/rec.json", b"first") is True
        assert backend.create("c/rec.json", b"second") is False
        assert backend.get("c/rec.json") == b"first"

    def test_lazy_create_and_delete_are_visible_on_return(self, backend: Backend) -> None:
        """``create_lazy`` is create-if-absent, ``delete_lazy`` a delete; both seen by the next read and listing."""
        assert backend.create_lazy("lz/rec.json", b"first") is True
        assert backend.create_lazy("lz/rec.json", b"second") is False
        assert backend.create("lz/rec.json", b"third") is False
        assert self.get_raw(backend, "lz/rec.json") == b"first"
        assert [o.key for o in backend.list("lz/")] == ["lz/rec.json"]
        backend.delete_lazy("lz/rec.json")
        assert self.get_raw(backend, "lz/rec.json") is None and backend.list("lz/") == []
        backend.delete_lazy("lz/rec.json")  # a missing key: no error

    def test_racing_creates_have_one_winner_each_round(
        self, backend: Backend, create_is_atomic_under_races: bool, race_rounds: int
    ) -> None:
        """8 threads create the same key at once, ``race_rounds`` times: each round one
        winner (at least one where the server's create is not atomic), its bytes stored."""
        violations = [
            v for r in range(race_rounds)
            if (v := race_create_round(backend, backend.create, f"race/{r:04d}.json",
                                       exclusive=create_is_atomic_under_races))
        ]
        assert violations == []

    def test_failing_stream_leaves_no_object(self, backend: Backend) -> None:
        def gen() -> Iterator[bytes]:
            yield b"x" * 1000
            raise RuntimeError("source failed")

        with pytest.raises(RuntimeError):
            backend.put("f/broken", gen())
        assert not backend.exists("f/broken")
        assert backend.list("f/") == []

    def test_large_object_multi_chunk(self, backend: Backend) -> None:
        chunk = bytes(range(256)) * 4096  # 1 MiB
        backend.put("big/obj", [chunk] * 9)
        assert backend.size("big/obj") == 9 * len(chunk)
        assert backend.get_range("big/obj", 8 * len(chunk) + 7, 8 * len(chunk) + 9) == chunk[7:9]

    # -- list_keys: ``list`` without sizes, in pages --------------------------
    # Byte order and an S3 server's tree order (SeaweedFS lists folder by
    # folder) agree here: no name continues with a character below '/' where a
    # sibling descends into a folder ("p-/y" next to "p/..." would differ).
    LISTED = ["p/a/1", "p/a/2", "p/b", "p/b0", "p/c.json", "pq/x", "other/y", "p/z/deep/er", "p/zz"]

    @staticmethod
    def _expected(backend: Backend, prefix: str, start_after: str = "", limit: int | None = None) -> list[str]:
        keys = [o.key for o in backend.list(prefix) if o.key > start_after]
        return keys if limit is None else keys[:limit]

    def test_list_keys_is_list_after_start_after_up_to_limit(self, backend: Backend) -> None:
        for k in self.LISTED:
            self.set_raw(backend, k, k.encode())
        for prefix in ("p/", "p", "p/a/", "p/b", "missing/", "p/z/"):
            for start_after in ("", "p/", "p/a/1", "p/a/15", "p/b", "p/b00", "p/zz", "a", "z"):
                for limit in (None, 0, 1, 2, 3, 100):
                    got = backend.list_keys(prefix, start_after=start_after, limit=limit)
                    assert got == self._expected(backend, prefix, start_after, limit), (prefix, start_after, limit)
        assert backend.list_keys("p/") == ["p/a/1", "p/a/2", "p/b", "p/b0", "p/c.json", "p/z/deep/er", "p/zz"]

    def test_list_keys_pages_through_a_long_prefix(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        if hasattr(backend, "list_page"):
            monkeypatch.setattr(backend, "list_page", 3)  # several requests per call
        keys = [f"pg/{i:03d}" for i in range(11)]
        for k in keys:
            self.set_raw(backend, k, b"1")
        assert backend.list_keys("pg/") == keys
        assert backend.list_keys("pg/", limit=7) == keys[:7]
        assert backend.list_keys("pg/", start_after="pg/004", limit=5) == keys[5:10]
        assert backend.list_keys("pg/", start_after=keys[-1]) == []
        walked, after = [], ""
        while page := backend.list_keys("pg/", start_after=after, limit=4):
            walked += page
            after = page[-1]
        assert walked == keys

    def test_flat_listing_is_one_level(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        if hasattr(backend, "list_page"):
            monkeypatch.setattr(backend, "list_page", 2)  # pages made partly of folders
        for k in self.LISTED:
            self.set_raw(backend, k, k.encode())
        top = ["p/b", "p/b0", "p/c.json", "p/zz"]
        assert backend.list_keys("p/", flat=True) == top
        assert [o.key for o in backend.list("p/", flat=True)] == top
        assert [o.size for o in backend.list("p/", flat=True)] == [len(k) for k in top]
        assert backend.list_keys("p/", flat=True, start_after="p/b", limit=2) == ["p/b0", "p/c.json"]
        assert backend.list_keys("p/b", flat=True) == ["p/b", "p/b0"]
        assert backend.list_keys("p/a/", flat=True) == ["p/a/1", "p/a/2"]
        assert backend.list_keys("missing/", flat=True) == [] and backend.list("missing/", flat=True) == []

    def test_a_listing_deeper_than_the_bound_is_an_error(self, backend: Backend) -> None:
        deep = "dp/" + "d/" * (MAX_KEY_DEPTH + 1) + "x"
        backend.put(deep, [b"1"])
        backend.put("dp/top", [b"1"])
        with pytest.raises(LimitReachedError, match="deeper than"):
            backend.list("dp/")
        with pytest.raises(LimitReachedError, match="deeper than"):
            backend.list_keys("dp/")
        assert backend.list_keys("dp/", flat=True) == ["dp/top"]  # a flat listing never goes down
        ok = "dq/" + "d/" * (MAX_KEY_DEPTH - 1) + "x"  # as deep as the bound allows
        backend.put(ok, [b"1"])
        assert backend.list_keys("dq/") == [ok]

    def test_list_keys_has_no_directories_after_deletes(self, backend: Backend) -> None:
        backend.put("gk/a/x", [b"1"])
        backend.put("gk/b", [b"1"])
        backend.delete("gk/a/x")
        assert backend.list_keys("gk/") == ["gk/b"]
        assert backend.list_keys("gk/a/") == []

    def test_get_many_is_get_range_of_each_key(self, backend: Backend) -> None:
        self.set_raw(backend, "gm/a", b"alpha")
        self.set_raw(backend, "gm/sub/b", b"b" * 5000)
        self.set_raw(backend, "gm/empty", b"")
        self.set_raw(backend, "other/c", b"gamma")
        keys = ["gm/a", "gm/missing", "gm/sub/b", "gm/empty", "other/c", "gm/sub", "nope/x", "gm/a"]
        assert backend.get_many(keys, 100) == [b"alpha", None, b"b" * 100, b"", b"gamma", None, None, b"alpha"]
        assert backend.get_many(["gm/sub/b"], 6000) == [b"b" * 5000]
        assert backend.get_many([], 10) == []
        # one bound per key (a batch of records, each read up to its listed size + 1)
        assert backend.get_many(["gm/a", "gm/sub/b", "gm/missing", "other/c"], [2, 7, 3, 100]) == [
            b"al", b"b" * 7, None, b"gamma"]
