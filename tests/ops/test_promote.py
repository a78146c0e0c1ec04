"""Promotion (issue 22): refusals with every reason, the artifact's layout and
provenance, loading it with safetensors / transformers, tampering, atomic
publication, object-store targets, DCP consolidation from two ranks."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptstore import CheckpointStore, CorruptionError
from ckptstore import protocol as P
from ckptstore.backends.local import LocalBackend
from ckptstore.cli.commands import main
from ckptstore.errors import PromotionRefusedError
from ckptstore.ops.artifact import (
    INDEX,
    PROVENANCE,
    LocalSink,
    write_artifact,
)
from ckptstore.ops.artifact_check import read_provenance, verify_artifact
from ckptstore.ops.budget import Budget
from ckptstore.ops.promote import IDENTITY_REFUSED, promote, promotion_check
from ckptstore.ops.weights import ModelSource, TensorSource, model_source
from ckptstore.protocol.auth import Keyring
from ckptstore.torch import Checkpointer, read_state
from tests.helpers import RawAccess
from tests.incremental.common import stored_at

IDENT = {"data_digest": "d-1", "code_digest": "c-1", "planned_steps": 6}
#: the "consistent-garbage" damage forges a version-2 commit record (one digest of the whole file); forging a
#: version-3 one (pieces) is tests/incremental/test_format.py's lying records
FORGED_RECORD_VERSION = 2


def train_run(url: str, run_id: str = "r", *, steps: int = 6, finish: bool = True, hidden: int = 8,
              keyring: Keyring | None = None, policy: str = "off", protocol_version: int | None = None) -> CheckpointStore:
    """A small real training run through the Checkpointer; a ``finished`` event as the drill's trainer writes."""
    torch.manual_seed(0)
    st = CheckpointStore.open(url, run_id, identity=IDENT, auth_policy=policy, keyring=keyring,
                              protocol_version=protocol_version)
    model = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ck = Checkpointer(st, {"model": model, "optimizer": opt}, every_steps=2, async_save=False, handle_signals=False)
    ck.resume()
    for step in range(steps if finish else steps - 2):
        opt.zero_grad()
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
        st.record_event("progress", {"step": step})
        ck.step_end(step)
    if finish:
        ck.finish(steps - 1)
        ref = st.latest_complete()
        st.record_event("finished", {"steps": steps, "final_manifest_digest": ref.manifest_digest,
                                     "eval_loss": 0.25, "eval_accuracy": 0.9})
    else:
        ck.close()
    return st


def reader(url: str, run_id: str = "r", **kw: Any) -> CheckpointStore:
    return CheckpointStore.open(url, run_id, mode="r", **kw)


def test_a_finished_run_promotes_to_weights_only_safetensors_with_provenance(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    train_run(url)
    st = reader(url)
    res = promote(st, str(tmp_path / "art"))
    files = sorted(os.listdir(tmp_path / "art"))
    assert files == ["model.safetensors", PROVENANCE]  # no optimizer, no RNG, nothing pickled
    saved = read_state(st, res.ref)["model"]
    loaded = load_file(str(tmp_path / "art" / "model.safetensors"))
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    p = json.loads((tmp_path / "art" / PROVENANCE).read_text())
    assert (p["run_id"], p["step"], p["save_id"], p["manifest_digest"]) == ("r", 5, res.ref.save_id,
                                                                          res.ref.manifest_digest)
    assert p["files"]["model.safetensors"]["size"] == (tmp_path / "art" / "model.safetensors").stat().st_size
    assert p["identity"]["data_digest"] == "d-1" and p["identity_digest"] == st.identity_digest
    assert p["eval_metrics"] == {"eval_accuracy": 0.9, "eval_loss": 0.25}
    assert p["budget"]["stopped"] is False and p["budget"]["spent_gpu_hours"] > 0
    assert [a["attempt"] for a in p["attempts"]] == [1] and p["interruptions"] == 0
    assert p["auth"] is None  # no key configured
    assert verify_artifact(str(tmp_path / "art"), store=st).ok
    assert main(["verify-artifact", str(tmp_path / "art"), "--store", url]) == 0


def test_above_the_shard_size_the_weights_are_sharded_in_hugging_faces_layout(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    train_run(url, hidden=64)
    st = reader(url)
    res = promote(st, str(tmp_path / "art"), max_shard_bytes=1200)
    idx = json.loads((tmp_path / "art" / INDEX).read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    saved = read_state(st, res.ref)["model"]
    merged: dict[str, torch.Tensor] = {}
    for f in shards:
        part = load_file(str(tmp_path / "art" / f))
        assert all(idx["weight_map"][k] == f for k in part)
        merged.update(part)
    assert set(merged) == set(saved) and all(torch.equal(merged[k], saved[k]) for k in saved)
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved.values())
    assert verify_artifact(str(tmp_path / "art"), store=st).ok


def test_every_refusal_reason_is_listed_and_nothing_is_written(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    st = train_run(url, finish=False)
    st.record_event(IDENTITY_REFUSED, {"fields": ["feature_contract"]})
    budget = Budget(limit_gpu_hours=0.3, gpu_hours_per_step=0.1, restart_gpu_hours=0.0)
    st.record_event("budget-exhausted", {"step": 3, "spent_gpu_hours": 0.4, "limit_gpu_hours": 0.3})
    chk = promotion_check(reader(url), budget=budget)
    text = "\n".join(chk.reasons)
    assert "budget-stopped" in text and "not finished" in text and "identity change refused" in text
    with pytest.raises(PromotionRefusedError) as ei:
        promote(reader(url), str(tmp_path / "art"), budget=budget)
    assert len(ei.value.reasons) >= 3
    assert not (tmp_path / "art").exists() and [p.name for p in tmp_path.iterdir()] == ["store"]
    rc = main(["promote", url, "r", "--to", str(tmp_path / "art"), "--budget-gpu-hours", "0.3",
               "--gpu-hours-per-step", "0.1", "--restart-gpu-hours", "0", "--json"])
    assert rc == 1 and not (tmp_path / "art").exists()


def test_a_corrupted_final_save_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    st = train_run(url)
    ref = st.latest_complete()
    key, at = stored_at("r", ref, "model.safetensors", -1)  # its file; on version 3 its piece
    comp = tmp_path / "store" / key
    data = bytearray(comp.read_bytes())
    data[at] ^= 0xFF
    comp.write_bytes(bytes(data))
    chk = promotion_check(reader(url))
    assert not chk.promotable
    assert any("not complete or does not verify: step 5" in r for r in chk.reasons), chk.reasons
    assert main(["promote", url, "r", "--to", str(tmp_path / "art")]) == 1
    assert not (tmp_path / "art").exists()


def test_a_step_other_than_the_final_one_needs_a_reason_kept_in_the_provenance(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    train_run(url)
    chk = promotion_check(reader(url), step=3)
    assert not chk.promotable and any("not the run's final step" in r for r in chk.reasons)
    res = promote(reader(url), str(tmp_path / "art"), step=3, reason="step 3 evaluated better on the holdout")
    assert res.ref.step == 3
    assert read_provenance(str(tmp_path / "art"))["reason"] == "step 3 evaluated better on the holdout"


def _damage_step(url: str, store_dir: Path, step: int, how: str) -> None:
    """Damage the model of ``step``: a flipped byte (the save no longer verifies), or
    garbage with its commit record rewritten to match (it verifies, but holds no
    readable model), as anyone who can write the directory can under auth_policy=off."""
    st = reader(url)
    ref = st.get_save(step)
    if how == "flip":
        key, at = stored_at("r", ref, "model.safetensors", ref.components["model.safetensors"].size // 2)
        comp = store_dir / key  # its file; on version 3 a piece
        data = bytearray(comp.read_bytes())
        data[at] ^= 0xFF
        comp.write_bytes(bytes(data))
        return
    comp = store_dir / P.component_key("r", ref.save_id, "model.safetensors")
    data = bytearray(comp.read_bytes())
    garbage = b"\xff" * len(data)
    comp.write_bytes(garbage)
    entry = ref.record.components["model.safetensors"]
    comps = {**ref.record.components,
             "model.safetensors": dataclasses.replace(entry, size=len(garbage), blake3=P.digest_bytes(garbage))}
    forged = dataclasses.replace(ref.record, components=comps, stored_digest="", body_digest="")
    RawAccess(LocalBackend(store_dir)).set(P.LATEST_LAYOUT.commit_key("r", step, ref.attempt), forged.encode())


@pytest.mark.parametrize("how", ["flip", "consistent-garbage"])
def test_a_damaged_non_final_step_is_refused_with_the_reason(tmp_path: Path, how: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "store")
    train_run(url, protocol_version=FORGED_RECORD_VERSION if how == "consistent-garbage" else None)
    _damage_step(url, tmp_path / "store", 3, how)
    want = "does not verify" if how == "flip" else "model weights cannot be read"
    chk = promotion_check(reader(url), step=3, reason="step 3 evaluated better")
    assert not chk.promotable and any(want in r for r in chk.reasons), chk.reasons
    with pytest.raises(PromotionRefusedError) as ei:  # a refusal listing the reason, never a CorruptionError
        promote(reader(url), str(tmp_path / "art"), step=3, reason="step 3 evaluated better")
    assert any(want in r for r in ei.value.reasons), ei.value.reasons
    capsys.readouterr()
    rc = main(["promote", url, "r", "--to", str(tmp_path / "art"), "--step", "3", "--reason", "better"])
    out = capsys.readouterr()
    assert rc == 1 and "REFUSED" in out.out and want in out.out and "Traceback" not in out.err, out
    assert not (tmp_path / "art").exists() and [p.name for p in tmp_path.iterdir()] == ["store"]
    assert promotion_check(reader(url)).promotable  # the final step is untouched and still promotable


def test_tampering_with_the_artifact_or_its_provenance_is_caught(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    train_run(url)
    art = tmp_path / "art"
    promote(reader(url), str(art))
    weights = art / "model.safetensors"
    good = weights.read_bytes()
    # a flipped byte of the weights
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    rep = verify_artifact(str(art))
    assert not rep.ok and "BLAKE3" in rep.problems[0]
    assert main(["verify-artifact", str(art)]) == 1
    weights.write_bytes(good)
    # an extra file
    (art / "extra.safetensors").write_bytes(good)
    assert any("does not list" in p for p in verify_artifact(str(art)).problems)
    (art / "extra.safetensors").unlink()
    # weights replaced *and* the provenance rewritten to match: only the store can tell
    import blake3
    from safetensors.torch import save_file

    t = load_file(str(weights))
    k = sorted(t)[0]
    t[k] = t[k] + 1
    save_file(t, str(weights), metadata={"format": "pt"})
    from ckptstore.ops.artifact import tensors_digest

    p = json.loads((art / PROVENANCE).read_text())
    p["files"]["model.safetensors"] = {"size": weights.stat().st_size,
                                       "blake3": blake3.blake3(weights.read_bytes()).hexdigest()}
    p["tensors_digest"] = tensors_digest(t.items())
    (art / PROVENANCE).write_text(json.dumps(p))
    assert verify_artifact(str(art)).ok  # consistent with itself...
    rep = verify_artifact(str(art), store=reader(url))
    assert not rep.ok and "not the save's model tensors" in rep.problems[-1]  # ...but not the save's model
    assert main(["verify-artifact", str(art), "--store", url]) == 1
    # a provenance naming another save
    p["step"] = 1
    (art / PROVENANCE).write_text(json.dumps(p))
    assert not verify_artifact(str(art), store=reader(url)).ok
    # no provenance: not an artifact
    (art / PROVENANCE).unlink()
    rep = verify_artifact(str(art))
    assert not rep.ok and "no provenance.json" in rep.problems[0]


def test_under_authentication_the_provenance_is_tagged_with_the_runs_key(tmp_path: Path, monkeypatch: Any,
                                                                        capsys: Any) -> None:
    url = str(tmp_path / "store")
    ring = Keyring({"k1": b"k" * 32})
    train_run(url, keyring=ring, policy="require")
    st = reader(url, auth_policy="require", keyring=ring)
    promote(st, str(tmp_path / "art"))
    p = read_provenance(str(tmp_path / "art"))
    assert p["auth"]["key_id"] == "k1"
    rep = verify_artifact(str(tmp_path / "art"), store=st, keyring=ring, require_auth=True)
    assert rep.ok and rep.authenticated
    # a forged metric: every file still matches, the tag does not
    doc = json.loads((tmp_path / "art" / PROVENANCE).read_text())
    doc["eval_metrics"]["eval_accuracy"] = 0.99
    (tmp_path / "art" / PROVENANCE).write_text(json.dumps(doc))
    rep = verify_artifact(str(tmp_path / "art"), keyring=ring, require_auth=True)
    assert not rep.ok and "auth tag does not verify" in rep.problems[0]
    # records that were never signed, read under require: refused with the reason, nothing written
    url2 = str(tmp_path / "plain")
    train_run(url2)
    with pytest.raises(CorruptionError, match="not authenticated"):
        reader(url2, auth_policy="require", keyring=ring)
    monkeypatch.setenv("CKPTSTORE_AUTH_KEYS", "k1:" + (b"k" * 32).hex())
    assert main(["promote", url2, "r", "--to", str(tmp_path / "art2"), "--auth-policy", "require"]) == 1
    assert "not authenticated" in capsys.readouterr().err and not (tmp_path / "art2").exists()
    # the signed run, from the command line: promoted, and verify-artifact checks the tag
    assert main(["promote", url, "r", "--to", str(tmp_path / "art3"), "--auth-policy", "require"]) == 0
    assert main(["verify-artifact", str(tmp_path / "art3"), "--store", url, "--auth-policy", "require"]) == 0
    capsys.readouterr()


def test_publication_is_atomic_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    calls = []

    def boom() -> torch.Tensor:
        calls.append(1)
        raise OSError("disk full")

    src = ModelSource("test", [TensorSource("a", torch.float32, (2,), lambda: torch.ones(2)),
                               TensorSource("b", torch.float32, (2,), boom)])
    with pytest.raises(OSError):
        write_artifact(src, LocalSink(str(tmp_path / "art")), {"run_id": "r"}, run_id="r", max_shard_bytes=8)
    assert calls and list(tmp_path.iterdir()) == []  # neither the final name nor the hidden temporary
    (tmp_path / "art").mkdir()
    with pytest.raises(Exception, match="already exists"):
        LocalSink(str(tmp_path / "art"))


def test_promote_to_an_object_store_url(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    train_run(url)
    st = reader(url)
    res = promote(st, "memory://artifacts-promote-test/receipts")
    assert verify_artifact("memory://artifacts-promote-test/receipts", store=st).ok
    assert res.files and main(["verify-artifact", "memory://artifacts-promote-test/receipts", "--store", url]) == 0
    with pytest.raises(Exception, match="not empty"):  # never overwritten
        promote(st, "memory://artifacts-promote-test/receipts")


def test_register_mlflow_without_the_extra_says_which_to_install(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if the extra were not installed: find_spec says None
    url = str(tmp_path / "store")
    train_run(url)
    rc = main(["promote", url, "r", "--to", str(tmp_path / "art"), "--register", "mlflow", "--model-name", "m"])
    assert rc == 2 and "ckptstore[registry]" in capsys.readouterr().err
    assert not (tmp_path / "art").exists()  # refused before anything was written


def test_a_two_rank_dcp_save_is_consolidated_tensor_by_tensor(tmp_path: Path) -> None:
    from tests.workers.dist_launch import run_job

    worker = str(Path(__file__).parents[1] / "workers" / "dcp_worker.py")
    url = str(tmp_path / "store")
    res = run_job(2, url, "save", args={"step": 3, "async": False}, worker=worker)
    assert all(r.results.get("save", {}).get("ok") for r in res), [r.stderr[-1500:] for r in res]
    st = reader(url, "run")
    ref = st.latest_complete(deep=True)
    assert ref is not None and ref.record.world_size == 2
    src = model_source(st, ref)
    assert sorted(t.name for t in src.tensors) == ["b", "w"]  # model.* only: no optimizer state
    write_artifact(src, LocalSink(str(tmp_path / "art")), {"run_id": "run", "save_id": ref.save_id, "step": 3,
                                                         "attempt": ref.attempt,
                                                         "manifest_digest": ref.manifest_digest}, run_id="run")
    g = torch.Generator().manual_seed(3)  # tests/workers/dcp_worker.py's expected(3)
    w, b = torch.randn(12, 5, generator=g), torch.randn(5, generator=g)
    loaded = load_file(str(tmp_path / "art" / "model.safetensors"))
    assert torch.equal(loaded["w"], w) and torch.equal(loaded["b"], b)
    assert verify_artifact(str(tmp_path / "art"), store=st).ok
    # the run never finished: promote refuses it
    assert not promotion_check(st).promotable


def test_a_hugging_face_save_promotes_to_a_model_transformers_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from ckptstore.integrations.hf import publish_checkpoint_dir

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ckdir = tmp_path / "out" / "checkpoint-4"
    model.save_pretrained(str(ckdir))
    torch.save({"not": "weights"}, ckdir / "optimizer.pt")
    url = str(tmp_path / "store")
    st = CheckpointStore.open(url, "hf", identity={**IDENT, "planned_steps": 5})
    ref = publish_checkpoint_dir(st, ckdir, 4)
    st.record_event("finished", {"steps": 5, "final_manifest_digest": ref.manifest_digest})
    res = promote(reader(url, "hf"), str(tmp_path / "art"))
    names = sorted(os.listdir(tmp_path / "art"))
    assert "optimizer.pt" not in names and "config.json" in names and "model.safetensors" in names
    assert res.provenance["source_format"] == "ckptstore.hf/1"
    again = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "art"))
    want, got = model.state_dict(), again.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("kind", ["moto", "fakegcs"])
def test_promote_to_s3_and_gcs_through_the_projects_backends(kind: str, tmp_path: Path, request: Any) -> None:
    import uuid

    from tests.conftest import selected_kinds

    if kind not in selected_kinds():
        pytest.skip(f"{kind} is not among CKPT_BACKENDS")
    to, opts = request.getfixturevalue("object_servers").url_and_options(kind, f"art-{uuid.uuid4().hex[:8]}")
    url = str(tmp_path / "store")
    train_run(url)
    st = reader(url)
    res = promote(st, to, storage_options=opts)
    assert sorted(res.files) == ["model.safetensors"]
    rep = verify_artifact(to, store=st, storage_options=opts)
    assert rep.ok, rep.problems
    assert read_provenance(to, opts)["manifest_digest"] == res.ref.manifest_digest
    with pytest.raises(Exception, match="not empty"):
        promote(st, to, storage_options=opts)
