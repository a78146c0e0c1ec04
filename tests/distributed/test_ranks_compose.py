"""Capabilities that compose on many ranks (issue 31): authenticated records,
version-3 runs (pieces) and the Checkpointer's metrics, each through
``open_distributed`` on 2 gloo ranks (tests/workers/rank_worker.py), with every
resumed rank compared bit for bit with an uninterrupted run."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, CorruptionError, InvalidInputError, Keyring, SaveState, keyring_from_file
from ckptstore.protocol.layout import pieces_prefix
from tests.distributed.test_checkpointer_ranks import (
    STOP,
    assert_continues_exactly,
    committed_steps,
    job,
    results,
    trained,
    uninterrupted,
)

__all__ = ["uninterrupted"]  # the module fixture, shared with test_checkpointer_ranks


def key_file(path: Path, kid: str = "k1") -> str:
    path.write_text(json.dumps({"active": kid, "keys": {kid: secrets.token_hex(32)}}))
    os.chmod(path, 0o600)
    return str(path)


def reader(url: str, **kw: Any) -> CheckpointStore:
    return CheckpointStore.open(url, "run", mode="r", **kw)


# ------------------------------------------------------------------ authenticated records


def test_require_with_a_keyring_signs_resumes_exactly_and_refuses_readers_without_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: list[dict[str, Any]]
) -> None:
    monkeypatch.delenv("CKPTSTORE_AUTH_KEYS", raising=False)  # the keys come from keyring= alone
    url = str(tmp_path / "store")
    kf = key_file(tmp_path / "keys.json")
    first = trained(job(2, url, stop=5, auth_policy="require", key_file=kf))  # saves 1, 3; the job stops
    assert [o["start"] for o in first] == [0, 0]
    ring = keyring_from_file(kf)

    # every record the job wrote is tagged: a reader that requires the key selects the save
    st = reader(url, auth_policy="require", keyring=ring)
    ref = st.latest_complete(deep=True)
    assert ref is not None and ref.step == 3 and sorted(ref.record.ranks or {}) == [0, 1]
    assert ref.record.auth is not None and ref.record.auth.key_id == "k1"
    assert all(a.auth is not None for a in st.attempts())
    assert sorted(i.step for i in st.list_saves(grace_seconds=0) if i.state is SaveState.COMMITTED) == [1, 3]

    # require without a key, or with another key: the library's refusal, naming the cause
    for no_key in (None, Keyring({})):
        with pytest.raises(InvalidInputError, match='auth_policy="require" needs a key'):
            reader(url, auth_policy="require", keyring=no_key)
    with pytest.raises(CorruptionError, match="signed with unknown key 'k1'.*only authenticated runs are opened"):
        reader(url, auth_policy="require", keyring=Keyring({"k2": secrets.token_bytes(32)}))
    with pytest.raises(CorruptionError, match="bad tag \\(key 'k1'\\).*only authenticated runs are opened"):
        reader(url, auth_policy="require", keyring=Keyring({"k1": secrets.token_bytes(32)}))  # same ID, other key

    # fresh processes with the same keyring continue bit for bit
    resumed = trained(job(2, url, stop=STOP, auth_policy="require", key_file=kf))
    assert_continues_exactly(resumed, uninterrupted, 4)
    assert [o["attempt"] for o in resumed] == [2, 2] and [o["resumed"] for o in resumed] == [3, 3]
    latest = reader(url, auth_policy="require", keyring=ring).latest_complete(deep=True)
    assert latest is not None and latest.step == STOP - 1 and latest.record.auth is not None


def test_ranks_that_choose_different_auth_policies_are_refused_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTSTORE_AUTH_KEYS", raising=False)
    url = str(tmp_path / "store")
    kf = key_file(tmp_path / "keys.json")
    opens = results(job(2, url, stop=2, auth_policy=["require", "off"], key_file=kf), "open")
    assert [o.get("type") for o in opens] == ["InvalidInputError"] * 2, opens
    assert opens[0]["message"] == opens[1]["message"]
    msg = opens[0]["message"]
    assert "rank 1 has auth_policy='off', rank 0 'require'" in msg and "Nothing was opened" in msg, msg
    # the same policy, but rank 1 has no key to sign with: refused on every rank too, none left waiting
    opens = results(job(2, url, stop=2, auth_policy="require", key_file=[kf, None]), "open")
    assert [o.get("type") for o in opens] == ["InvalidInputError"] * 2, opens
    assert opens[0]["message"] == opens[1]["message"]
    assert "rank 1" in opens[0]["message"] and "needs a key" in opens[0]["message"], opens[0]["message"]
    assert not (tmp_path / "store" / "run").exists()  # no run was created


# ------------------------------------------------------------------ version 3 (pieces)


def test_protocol_version_3_creates_a_pieces_run_and_resumes_exactly(
    tmp_path: Path, uninterrupted: list[dict[str, Any]]
) -> None:
    url = str(tmp_path / "store")  # no run yet: open_distributed creates it
    res = job(2, url, stop=5, protocol_version=3)
    assert [o["protocol_version"] for o in results(res, "open")] == [3, 3]
    trained(res)
    st = reader(url)
    assert st.run_record["protocol_version"] == 3
    assert st.backend.list(pieces_prefix("run")), "no piece under pieces/"
    assert [a.number for a in st.attempts()] == [1]

    res = job(2, url, stop=STOP, protocol_version=3)
    assert [o["protocol_version"] for o in results(res, "open")] == [3, 3]
    assert_continues_exactly(trained(res), uninterrupted, 4)
    st = reader(url)
    # one attempt per job, each with its saves: no empty attempt in the history
    assert [a.number for a in st.attempts()] == [1, 2]
    by_attempt = {i.attempt for i in st.list_saves(grace_seconds=0) if i.state is SaveState.COMMITTED}
    assert by_attempt == {1, 2}
    ref = st.latest_complete(deep=True)
    assert ref is not None and ref.step == STOP - 1 and ref.attempt == 2


# ------------------------------------------------------------------ the Checkpointer's metrics


def test_checkpointer_metrics_on_two_ranks(tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    url = str(tmp_path / "store")
    metrics = str(tmp_path / "train-{rank}.prom")
    trained(job(2, url, stop=3, metrics_path=metrics))  # saves 1
    resumed = trained(job(2, url, stop=5, metrics_path=metrics))  # resumes 1, saves 3
    assert [o["start"] for o in resumed] == [2, 2]
    for r, (a, b) in enumerate(zip(uninterrupted, resumed, strict=True)):
        assert b["steps"] == {k: v for k, v in a["steps"].items() if 2 <= int(k) < 5}, r
    assert committed_steps(url, {}) == [1, 3]
    for r in range(2):
        text = (tmp_path / f"train-{r}.prom").read_text()
        assert 'ckptstore_last_complete_step{run="run"} 3' in text, text
        assert 'ckptstore_restarts{run="run"} 1' in text, text
        assert 'ckptstore_saves_completed_total{run="run"} 1' in text, text
