"""The backend conformance suite, written once (the zarr ``StoreTests`` idea).

Subclass :class:`BackendConformance` in a pytest module and provide a
``backend`` fixture that yields a fresh, empty backend (a unique prefix is
enough). Every backend ckptstore ships runs exactly this class. Tests compare
the backend with ground truth through :class:`~ckptstore.testing.raw.RawAccess`,
which reads and writes the storage without the backend's own methods.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ..backends.base import MAX_KEY_DEPTH, Backend
from ..errors import LimitReachedError, NotFoundError
from .raw import RawAccess


class BackendConformance:
    """Behaviour every :class:`Backend` must show. Needs a ``backend`` fixture."""

    def test_put_lands_as_ground_truth(self, backend: Backend) -> None:
        backend.put("g/t/obj", [b"abc", b"def"])
        assert RawAccess(backend).get("g/t/obj") == b"abcdef"

    def test_planted_object_is_seen(self, backend: Backend) -> None:
        RawAccess(backend).set("g/planted", b"xyz")
        assert backend.get("g/planted") == b"xyz"
        assert backend.size("g/planted") == 3
        assert [o.key for o in backend.list("g/")] == ["g/planted"]

    def test_create_never_replaces_a_planted_object(self, backend: Backend) -> None:
        RawAccess(backend).set("g/rec", b"theirs")
        assert backend.create("g/rec", b"ours") is False
        assert RawAccess(backend).get("g/rec") == b"theirs"

    def test_get_range_is_bounded(self, backend: Backend) -> None:
        RawAccess(backend).set("g/big", b"x" * 5000)
        assert backend.get_range("g/big", 0, 11) == b"x" * 11
        assert backend.get_range("g/big", 4990, 6000) == b"x" * 10
        assert backend.get_range("g/big", 6000, 6001) == b""

    def test_delete_removes_ground_truth(self, backend: Backend) -> None:
        RawAccess(backend).set("g/d", b"1")
        backend.delete("g/d")
        assert RawAccess(backend).get("g/d") is None

    def test_object_of_several_parts(self, backend: Backend) -> None:
        """Larger than two 16 MiB upload parts, fed in odd-sized chunks."""
        part = bytes(range(256)) * 4096  # 1 MiB
        data = part * 33 + b"tail"
        chunks = [data[i : i + 3_000_001] for i in range(0, len(data), 3_000_001)]
        backend.put("big/obj", chunks)
        assert backend.size("big/obj") == len(data)
        assert RawAccess(backend).get("big/obj") == data
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

    def test_list_after_deleting_everything_is_empty(self, backend: Backend) -> None:
        backend.put("gone/a/x", [b"1"])
        backend.delete("gone/a/x")
        assert backend.list("gone/") == []
        assert backend.list("gone/a/") == []

    def test_create_if_absent(self, backend: Backend) -> None:
        assert backend.create("c/rec.json", b"first") is True
        assert backend.create("c/rec.json", b"second") is False
        assert backend.get("c/rec.json") == b"first"

    def create_is_exclusive_under_races(self, request: pytest.FixtureRequest) -> bool:
        """Whether the server behind ``backend`` gives an atomic create-if-absent under
        concurrent requests. Override to answer False for a test double that does not
        (moto checks ``If-None-Match`` and stores without a lock): the race test then
        asserts what still holds — at least one winner, and the stored bytes are a
        winner's — instead of "exactly one"."""
        return True

    def test_create_racing_threads_one_winner(self, backend: Backend, request: pytest.FixtureRequest) -> None:
        n = 8
        results: list[tuple[int, bool]] = []
        barrier = threading.Barrier(n)
        lock = threading.Lock()

        def go(i: int) -> None:
            barrier.wait()
            ok = backend.create("race/commit.json", f"writer-{i}".encode())
            with lock:
                results.append((i, ok))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, ok in results if ok]
        assert winners, results
        if self.create_is_exclusive_under_races(request):
            assert len(winners) == 1, results
        assert backend.get("race/commit.json") in {f"writer-{i}".encode() for i in winners}, results

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
            RawAccess(backend).set(k, k.encode())
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
            RawAccess(backend).set(k, b"1")
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
            RawAccess(backend).set(k, k.encode())
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
        raw = RawAccess(backend)
        raw.set("gm/a", b"alpha")
        raw.set("gm/sub/b", b"b" * 5000)
        raw.set("gm/empty", b"")
        raw.set("other/c", b"gamma")
        keys = ["gm/a", "gm/missing", "gm/sub/b", "gm/empty", "other/c", "gm/sub", "nope/x", "gm/a"]
        assert backend.get_many(keys, 100) == [b"alpha", None, b"b" * 100, b"", b"gamma", None, None, b"alpha"]
        assert backend.get_many(["gm/sub/b"], 6000) == [b"b" * 5000]
        assert backend.get_many([], 10) == []
        # one bound per key (a batch of records, each read up to its listed size + 1)
        assert backend.get_many(["gm/a", "gm/sub/b", "gm/missing", "other/c"], [2, 7, 3, 100]) == [
            b"al", b"b" * 7, None, b"gamma"]
