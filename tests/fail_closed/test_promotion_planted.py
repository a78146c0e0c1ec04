"""Fail closed on promotion's surfaces (issue 30, classes 7 and 8;
protocol_spec/THREATS.md §4.9.2, §4.9.3).

Class 7: whoever can write the directory that holds ``--to`` swaps the hidden
``.NAME.partial-*`` folder for a link (or a directory of theirs) at the exact
moment — a fault point, never a timing window: the first tensor written
(``on_tensor``, or ``LocalSink.write`` for the CLI), right before the rename
and right after it (``LocalSink(on_stage=...)``). Nothing may land outside the
folder promotion created, nothing may be published that it did not create,
and the artifact stays private until it is published.

Class 8: ``verify-artifact`` against planted special files (a FIFO never
hangs it, a link is never followed), against a provenance whose fields were
edited without the key (every field the store can confirm is compared; the
report names the confirmed and the unconfirmed ones), and a read-only check
creates nothing.

The store lives on memory, the local disk and moto (its path differs); the
artifacts on the local disk (and one on ``memory://``). The public API and the
CLI (in process, so ``memory://`` stores are shared) are driven alike."""

from __future__ import annotations

import json
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptstore import CheckpointStore, InvalidInputError
from ckptstore.backends.schemes import backend_from_url
from ckptstore.cli.commands import main as cli_main
from ckptstore.ops.artifact import PROVENANCE, SINGLE, LocalSink, write_artifact
from ckptstore.ops.artifact_check import ArtifactReport, verify_artifact
from ckptstore.ops.promote import promote, promotion_check, provenance_of
from ckptstore.ops.weights import TensorSource, model_source
from ckptstore.torch import Checkpointer, read_state
from tests.helpers import settle_background_writes

STORES = pytest.mark.backends("memory", "local", "moto")
IDENT = {"data_digest": "d-1", "code_digest": "c-1", "planned_steps": 4}
STEPS = 4


@dataclass
class Place:
    """A fresh store location, for the API (``url`` + ``opts``) and the CLI (``url`` + ``cli_opts``)."""

    url: str
    opts: dict[str, Any] = field(default_factory=dict)

    @property
    def cli_opts(self) -> list[str]:
        return [x for k, v in self.opts.items() if isinstance(v, str) for x in ("-o", f"{k}={v}")]

    @property
    def store_flags(self) -> list[str]:
        """``verify-artifact``'s way to name this store: ``--store URL --store-option K=V ...``."""
        return ["--store", self.url, *[x for k, v in self.opts.items() if isinstance(v, str)
                                       for x in ("--store-option", f"{k}={v}")]]

    def open(self, **kw: Any) -> CheckpointStore:
        return CheckpointStore.open(self.url, "r", storage_options=self.opts, **kw)


@pytest.fixture
def place(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    if backend_kind == "memory":
        yield Place(f"memory://promo-{uuid.uuid4().hex[:8]}")
    elif backend_kind == "local":
        yield Place(str(tmp_path / "store"))
    else:
        servers = request.getfixturevalue("object_servers")
        url, opts = servers.url_and_options(backend_kind, f"promo-{uuid.uuid4().hex[:12]}")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # client_kwargs cannot travel as -o
        yield Place(url, opts)


def finished_run(place: Place) -> None:
    """A small real training run through the Checkpointer, finished as the drill's trainer finishes one."""
    torch.manual_seed(0)
    st = CheckpointStore.open(place.url, "r", identity=IDENT, storage_options=place.opts)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ck = Checkpointer(st, {"model": model, "optimizer": opt}, every_steps=2, async_save=False, handle_signals=False)
    ck.resume()
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
        st.record_event("progress", {"step": step})
        ck.step_end(step)
    ck.finish(STEPS - 1)
    ref = st.latest_complete()
    assert ref is not None
    st.record_event("finished", {"steps": STEPS, "final_manifest_digest": ref.manifest_digest,
                                 "eval_loss": 0.25, "eval_accuracy": 0.9})


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli_main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def snapshot(top: Path) -> dict[str, tuple[str, int, bytes | str]]:
    """Every entry under ``top`` (links not followed): kind, mode, content or link target."""
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    out: dict[str, tuple[str, int, bytes | str]] = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(top))] = ("link", 0, os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[str(p.relative_to(top))] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes())
            else:
                out[str(p.relative_to(top))] = ("dir" if stat.S_ISDIR(st.st_mode) else "special",
                                                stat.S_IMODE(st.st_mode), b"")
    return out


def victim_dir(tmp_path: Path) -> Path:
    """Another user's directory the attacker wants the weights in (or wants damaged)."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "notes.txt").write_text("the attacker's own files")
    os.chmod(d, 0o777)
    return d


def umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def the_partial(parent: Path, name: str) -> Path:
    found = [p for p in parent.iterdir() if p.name.startswith(f".{name}.partial-")]
    assert len(found) == 1, found
    return found[0]


def swap_for_link(parent: Path, name: str, target: Path, aside: str = ".stolen") -> Path:
    """What the attacker does: move the temporary folder aside, put a link in its place."""
    tmp = the_partial(parent, name)
    os.rename(tmp, parent / aside)
    tmp.symlink_to(target, target_is_directory=True)
    return tmp


def assert_same_model(store: CheckpointStore, art: Path) -> None:
    ref = store.latest_complete(deep=True)
    assert ref is not None
    saved = read_state(store, ref)["model"]
    loaded = load_file(str(art / SINGLE))
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)


def bounded(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a thread; a hang is a failure (the call is bounded by construction, this only reports it)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the call blocked"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


# -- class 7: promotion's temporary folder -----------------------------------------------------------------------


@STORES
def test_the_temporary_folder_swapped_for_a_link_while_promote_writes_sends_no_byte_outside(
    place: Place, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    finished_run(place)
    victim = victim_dir(tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    before = snapshot(victim)
    seen: list[tuple[int, list[int]]] = []

    def attack(_t: TensorSource) -> None:
        if seen:
            return
        tmp = the_partial(models, "v1")
        # private while written: the folder 0700, every file in it 0600
        seen.append((stat.S_IMODE(tmp.stat().st_mode), [stat.S_IMODE(p.stat().st_mode) for p in tmp.iterdir()]))
        swap_for_link(models, "v1", victim)

    with pytest.raises(InvalidInputError) as ei:
        promote(place.open(mode="r"), str(models / "v1"), on_tensor=attack)
    msg = str(ei.value)
    assert "replaced while the artifact was written" in msg and "only you can write" in msg, msg
    assert seen and seen[0][0] == 0o700 and all(m == 0o600 for m in seen[0][1]), seen
    assert snapshot(victim) == before  # not a byte of the weights in the other user's directory
    assert not os.path.lexists(models / "v1")  # nothing published, least of all a link
    link = the_partial(models, "v1")
    assert link.is_symlink() and os.readlink(link) == str(victim)  # the planted link: never removed
    stolen = models / ".stolen"  # the folder promotion created, moved aside: emptied, still private
    assert list(stolen.iterdir()) == [] and stat.S_IMODE(stolen.stat().st_mode) == 0o700

    # the CLI: the same swap at the first file written
    real_write = LocalSink.write
    calls: list[str] = []

    def swapping_write(self: LocalSink, name: str, chunks: Any) -> tuple[int, str]:
        if not calls:
            swap_for_link(models, "v2", victim, ".stolen-2")
        calls.append(name)
        return real_write(self, name, chunks)

    monkeypatch.setattr(LocalSink, "write", swapping_write)
    rc, out, err = cli(capsys, "promote", place.url, "r", *place.cli_opts, "--to", str(models / "v2"))
    assert rc == 2 and "replaced while the artifact was written" in err and "Traceback" not in err, (out, err)
    assert calls and snapshot(victim) == before and not os.path.lexists(models / "v2")
    monkeypatch.setattr(LocalSink, "write", real_write)

    # the run itself is untouched: it promotes, bit for bit, with the published modes
    rc, out, err = cli(capsys, "promote", place.url, "r", *place.cli_opts, "--to", str(models / "v3"))
    assert rc == 0, (out, err)
    art = models / "v3"
    assert not art.is_symlink() and stat.S_IMODE(art.stat().st_mode) == 0o755 & ~umask()
    assert {stat.S_IMODE(p.stat().st_mode) for p in art.iterdir()} == {0o644 & ~umask()}
    assert_same_model(place.open(mode="r"), art)
    rc, out, _ = cli(capsys, "verify-artifact", str(art), *place.store_flags)
    assert rc == 0 and "ARTIFACT OK" in out, out


@pytest.mark.parametrize("planted", ["link", "foreign directory", "link after the rename", "entry at the name"])
def test_what_is_published_is_the_folder_promotion_created(tmp_path: Path, planted: str) -> None:
    place = Place(str(tmp_path / "store"))
    finished_run(place)
    st = place.open(mode="r")
    chk = promotion_check(st)
    assert chk.promotable and chk.ref is not None
    victim = victim_dir(tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    before = snapshot(victim)

    def at(stage: str) -> None:
        if planted in ("link", "foreign directory") and stage == "checked":
            tmp = the_partial(models, "v1")  # between the identity check and the rename
            os.rename(tmp, models / ".stolen")
            if planted == "link":
                tmp.symlink_to(victim, target_is_directory=True)
            else:
                os.rename(victim, tmp)  # the attacker's own directory, renamed in
        elif planted == "link after the rename" and stage == "renamed":
            os.rename(models / "v1", models / ".stolen")
            (models / "v1").symlink_to(victim, target_is_directory=True)
        elif planted == "entry at the name" and stage == "checked":
            (models / "v1").mkdir()  # an empty directory appears at the final name

    sink = LocalSink(str(models / "v1"), on_stage=at)
    with pytest.raises(InvalidInputError) as ei:
        write_artifact(model_source(st, chk.ref), sink, provenance_of(st, chk), run_id="r")
    msg = str(ei.value)
    stolen = models / ".stolen"
    if planted == "entry at the name":
        assert "appeared while the artifact was written" in msg, msg
        assert (models / "v1").is_dir() and list((models / "v1").iterdir()) == []  # never replaced
        assert not any(p.name.startswith(".v1.partial-") for p in models.iterdir())  # the temporary removed
    else:
        # the entry swapped in was renamed to v1 (or put there): refused, left as found, named in the message
        assert "is not the directory this promotion created" in msg and "only you can write" in msg, msg
        assert str(models / "v1") in msg, msg
        assert list(stolen.iterdir()) == [] and stat.S_IMODE(stolen.stat().st_mode) == 0o700  # emptied, private
    if planted in ("link", "link after the rename"):
        assert (models / "v1").is_symlink() and os.readlink(models / "v1") == str(victim)
    if planted == "foreign directory":
        assert not victim.exists()
        victim = models / "v1"  # the attacker's own directory: its content and modes untouched
    assert snapshot(victim) == before
    # a clean promotion of the same run still works
    res = promote(place.open(mode="r"), str(models / "clean"))
    assert res.verified.ok and res.verified.directory_id == (os.stat(models / "clean").st_dev,
                                                             os.stat(models / "clean").st_ino)
    assert_same_model(st, models / "clean")


def test_an_artifact_path_that_is_a_link_is_never_verified_through(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    place = Place(str(tmp_path / "store"))
    finished_run(place)
    promote(place.open(mode="r"), str(tmp_path / "art"))
    (tmp_path / "alias").symlink_to(tmp_path / "art", target_is_directory=True)
    rep = verify_artifact(str(tmp_path / "alias"), store=place.open(mode="r"))
    assert not rep.ok and "symbolic link, not an artifact directory" in rep.problems[0], rep.problems
    rc, out, _ = cli(capsys, "verify-artifact", str(tmp_path / "alias"), "--store", place.url)
    assert rc == 1 and "symbolic link" in out
    assert verify_artifact(str(tmp_path / "art"), store=place.open(mode="r")).ok


# -- class 8: verify-artifact --------------------------------------------------------------------------------------


def test_a_fifo_or_a_link_in_the_artifact_is_refused_without_blocking(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    place = Place(str(tmp_path / "store"))
    finished_run(place)
    art = tmp_path / "art"
    promote(place.open(mode="r"), str(art))
    weights = art / SINGLE
    good = weights.read_bytes()
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(good)
    for planted, needle in (("fifo", "a FIFO, not a regular file"), ("link", "symbolic link")):
        weights.unlink()
        if planted == "fifo":
            os.mkfifo(weights)
        else:
            weights.symlink_to(copy)  # the same bytes, through a link: still never followed
        rep: ArtifactReport = bounded(lambda: verify_artifact(str(art), store=place.open(mode="r")))
        assert not rep.ok and any(needle in p for p in rep.problems), rep.problems
        rc, out, err = bounded(lambda: cli(capsys, "verify-artifact", str(art), "--store", place.url))
        assert rc == 1 and needle in out and "Traceback" not in err, (out, err)
    weights.unlink()
    weights.write_bytes(good)
    # a FIFO where the provenance belongs: the CLI reads it first (for the run ID), and does not hang either
    prov = (art / PROVENANCE).read_bytes()
    (art / PROVENANCE).unlink()
    os.mkfifo(art / PROVENANCE)
    rc, out, err = bounded(lambda: cli(capsys, "verify-artifact", str(art), "--store", place.url))
    assert rc == 1 and "FIFO" in out and "Traceback" not in err, (out, err)
    rc, out, err = bounded(lambda: cli(capsys, "verify-artifact", str(art)))
    assert rc == 1 and "FIFO" in out, (out, err)
    (art / PROVENANCE).unlink()
    (art / PROVENANCE).write_bytes(prov)
    assert verify_artifact(str(art), store=place.open(mode="r")).ok


EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "eval_metrics": lambda p: p["eval_metrics"].update(eval_accuracy=0.99),
    "identity": lambda p: p["identity"].update(data_digest="d-clean"),
    "attempts": lambda p: p["attempts"][0].update(wasted_steps=0, executed_steps=1, ended="finished", last_step=0),
    "final_step": lambda p: p.update(final_step=999),
    "identity_digest": lambda p: p.update(identity_digest="0" * 64),
    "lineage": lambda p: p.update(lineage={"parent": "a-better-run"}),
    "interruptions": lambda p: p.update(interruptions=0 if p["interruptions"] else 3),
    "restarts": lambda p: p.update(restarts=5),
    "budget": lambda p: p["budget"].update(spent_gpu_hours=0.0001),
}


@STORES
def test_without_a_key_every_field_the_store_can_confirm_is_compared(
    place: Place, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finished_run(place)
    art = tmp_path / "art"
    promote(place.open(mode="r"), str(art))
    good = json.loads((art / PROVENANCE).read_text())
    store_args = place.store_flags
    # the genuine artifact: OK, naming what the store confirmed and what it could not
    rep = verify_artifact(str(art), store=place.open(mode="r"))
    assert rep.ok, rep.problems
    assert {"run_id", "save_id", "step", "attempt", "manifest_digest", "files", "tensors", "tensors_digest",
            "source_format", *EDITS} <= set(rep.confirmed), rep.confirmed
    assert set(rep.unconfirmed) == {"reason", "promoted_at", "promoted_on", "store", "budget.parameters"}
    rc, out, err = cli(capsys, "verify-artifact", str(art), *store_args, "--json")
    assert rc == 0 and json.loads(out)["unconfirmed"] == rep.unconfirmed, (out, err)
    rc, out, _ = cli(capsys, "verify-artifact", str(art), *store_args)
    assert rc == 0 and "ARTIFACT OK" in out and "unconfirmed" in out and "promoted_on" in out
    assert "confirmed by the store's records" in out and "eval_metrics" in out
    # without the store, nothing about the run is confirmed, and the report says so
    plain = verify_artifact(str(art))
    assert plain.ok and plain.confirmed == [] and {"identity", "eval_metrics", "attempts"} <= set(plain.unconfirmed)
    # every edit made without the key: files still match, the provenance is consistent with itself, and the
    # store's records contradict the field (by name), from the API and the CLI
    for name, edit in EDITS.items():
        doc = json.loads(json.dumps(good))
        edit(doc)
        (art / PROVENANCE).write_text(json.dumps(doc))
        assert verify_artifact(str(art)).ok, name  # self-consistent: only the store can tell
        rep = verify_artifact(str(art), store=place.open(mode="r"))
        assert not rep.ok and any(p.startswith(f"{name}: the provenance says") for p in rep.problems), \
            (name, rep.problems)
        assert name not in rep.confirmed
        rc, out, err = cli(capsys, "verify-artifact", str(art), *store_args)
        assert rc == 1 and "ARTIFACT INVALID" in out and f"{name}: the provenance says" in out, (name, out, err)
    # a field the format does not define is never "confirmed": it is listed as the provenance's word
    (art / PROVENANCE).write_text(json.dumps({**good, "approved_by": "security-team"}))
    rep = verify_artifact(str(art), store=place.open(mode="r"))
    assert rep.ok and "approved_by" in rep.unconfirmed
    rc, out, _ = cli(capsys, "verify-artifact", str(art), *store_args)
    assert rc == 0 and "approved_by" in out.split("unconfirmed", 1)[1]
    # the promoter's budget parameters decide the figures: edited, the figures no longer follow from the records
    doc = json.loads(json.dumps(good))
    doc["budget"]["parameters"]["gpu_hours_per_step"] *= 7
    (art / PROVENANCE).write_text(json.dumps(doc))
    rep = verify_artifact(str(art), store=place.open(mode="r"))
    assert not rep.ok and any(p.startswith("budget: the provenance says") for p in rep.problems), rep.problems
    doc["budget"]["parameters"] = {"gpu_hours_per_step": "lots"}
    (art / PROVENANCE).write_text(json.dumps(doc))
    rep = verify_artifact(str(art), store=place.open(mode="r"))
    assert not rep.ok and any("budget.parameters is not a budget" in p for p in rep.problems), rep.problems
    (art / PROVENANCE).write_text(json.dumps(good))
    assert verify_artifact(str(art), store=place.open(mode="r")).ok
    assert_same_model(place.open(mode="r"), art)


def test_an_edited_provenance_on_an_object_store_artifact_is_caught(tmp_path: Path) -> None:
    place = Place(str(tmp_path / "store"))
    finished_run(place)
    to = f"memory://promo-art-{uuid.uuid4().hex[:8]}/v1"
    promote(place.open(mode="r"), to)
    backend = backend_from_url(to)
    doc = json.loads(backend.get(PROVENANCE))
    doc["eval_metrics"]["eval_loss"] = 0.01
    doc["attempts"] = doc["attempts"][:0]
    backend.put(PROVENANCE, [json.dumps(doc).encode()])
    rep = verify_artifact(to, store=place.open(mode="r"))
    assert not rep.ok
    assert {p.split(":")[0] for p in rep.problems} >= {"eval_metrics", "attempts"}, rep.problems
    assert verify_artifact(to).ok  # consistent with itself


@STORES
def test_a_read_only_check_creates_nothing(place: Place, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    finished_run(place)
    art = tmp_path / "art"
    promote(place.open(mode="r"), str(art))
    # a mistyped store path: refused, naming it; the directory is not created
    missing = tmp_path / "nowhere" / "store"
    (tmp_path / "nowhere").mkdir()
    before = snapshot(tmp_path / "nowhere")
    rc, out, err = cli(capsys, "verify-artifact", str(art), "--store", str(missing))
    assert rc == 1 and str(missing) in err and "creates nothing" in err, (out, err)
    rc, out, err = cli(capsys, "verify-artifact", str(art), "--store", f"file://{missing}")
    assert rc == 1 and str(missing) in err, (out, err)
    rc, out, err = cli(capsys, "ls", str(missing), "r")
    assert rc == 1 and str(missing) in err, (out, err)
    assert snapshot(tmp_path / "nowhere") == before and not missing.exists()
    # the real store, local or remote: the check lists and reads, and writes nothing
    keys = sorted(o.key for o in backend_from_url(place.url, storage_options=place.opts).list(""))
    art_before = snapshot(art)
    tree = snapshot(tmp_path)
    rc, out, err = cli(capsys, "verify-artifact", str(art), *place.store_flags)
    assert rc == 0 and "ARTIFACT OK" in out, (out, err)
    assert verify_artifact(str(art), store=place.open(mode="r")).ok
    assert sorted(o.key for o in backend_from_url(place.url, storage_options=place.opts).list("")) == keys
    assert snapshot(art) == art_before and snapshot(tmp_path) == tree
