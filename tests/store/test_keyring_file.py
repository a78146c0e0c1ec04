"""The public key-file loader, ``ckptstore.keyring_from_file``: the keyring a
store signs and checks with, loaded with the CLI's strict checks (THREATS.md
§2.2, §4.10): no link followed, the owner's file only, bounded, never a key in
a message."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ckptstore
from ckptstore import CheckpointStore, InvalidInputError, Keyring, keyring_from_file
from ckptstore.backends.memory import MemoryBackend
from tests.helpers import IDENT

HEX1, HEX2 = "a1" * 32, "b2" * 32


def _key_file(path: Path, doc: object, mode: int = 0o600) -> Path:
    path.write_text(json.dumps(doc))
    os.chmod(path, mode)
    return path


def test_the_loader_is_public_and_its_keyring_signs_and_verifies(tmp_path: Path) -> None:
    assert "keyring_from_file" in ckptstore.__all__
    kf = _key_file(tmp_path / "keys.json", {"active": "k2", "keys": {"k1": HEX1, "k2": HEX2}})
    ring = keyring_from_file(kf)
    assert isinstance(ring, Keyring) and ring.key_ids == ["k1", "k2"] and ring.active == "k2"
    backend = MemoryBackend()
    st = CheckpointStore.open(backend, "run", identity=IDENT, auth_policy="require", keyring=ring)
    with st.save(1) as w:
        w.put("m", b"weights")
    # the same keys, built in Python, verify what the file's keyring signed
    same = Keyring({"k1": bytes.fromhex(HEX1), "k2": bytes.fromhex(HEX2)}, active="k1")
    again = CheckpointStore.open(backend, "run", identity=IDENT, auth_policy="require", keyring=same, mode="r")
    ref = again.latest_complete()
    assert ref is not None and ref.step == 1 and again.read(ref, "m") == b"weights"
    # a keyring without the signing key does not accept the run
    other = Keyring({"k9": b"\x09" * 32})
    with pytest.raises(ckptstore.CkptStoreError):
        CheckpointStore.open(backend, "run", identity=IDENT, auth_policy="require", keyring=other, mode="r")


def _refusals(tmp_path: Path) -> list[tuple[Path, str]]:
    good = {"active": "k1", "keys": {"k1": HEX1}}
    target = _key_file(tmp_path / "real.json", good)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo, 0o600)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"keys": {"k1": HEX1}, "pad": "x" * (1 << 16)}))
    os.chmod(big, 0o600)
    return [
        (link, "symbolic link"),
        (fifo, "not a regular file"),
        (_key_file(tmp_path / "open.json", good, 0o644), "chmod 600"),
        (_key_file(tmp_path / "group.json", good, 0o620), "chmod 600"),
        (big, "larger than"),
        (_key_file(tmp_path / "short.json", {"keys": {"k1": "a1" * 8}}), "at least"),
        (_key_file(tmp_path / "active.json", {"active": HEX2, "keys": {"k1": HEX1}}), '"active"'),
        (_key_file(tmp_path / "swapped.json", {"keys": {HEX1: "k1"}}), "not shown"),
        (tmp_path / "missing.json", "No such file"),
    ]


def test_the_loader_refuses_links_foreign_modes_big_files_and_bad_keys_naming_only_the_cause(tmp_path: Path) -> None:
    before = {p.name: (p.lstat().st_mode, p.lstat().st_size) for p in tmp_path.iterdir()}
    cases = _refusals(tmp_path)
    for path, cause in cases:
        with pytest.raises(InvalidInputError) as info:
            keyring_from_file(path)
        msg = str(info.value)
        assert str(path) in msg and cause in msg, (path, msg)
        assert HEX1 not in msg and HEX2 not in msg and "a1a1a1a1" not in msg, msg  # never key material
    after = {p.name: (p.lstat().st_mode, p.lstat().st_size) for p in tmp_path.iterdir()}
    assert {k: v for k, v in after.items() if k in before} == before  # the loader changed nothing
