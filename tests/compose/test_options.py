"""The one options object (issue 31 item 2): every entry point takes the same
:class:`OpenOptions`; the flat keywords of earlier releases map onto it with a
DeprecationWarning; each entry point's own parameters stay few."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest

from ckptstore import AuthOptions, CheckpointStore, OpenOptions, PieceTiming, TierOptions
from ckptstore.distributed import open_distributed
from ckptstore.options import FLAT_KEYWORDS, options_from_keywords
from ckptstore.protocol.auth import Keyring
from ckptstore.torch import Checkpointer

IDENT = {"model": "tiny"}
KEYS = Keyring({"k1": bytes(range(32))}, active="k1")


def test_every_entry_point_takes_the_one_options_object_and_few_parameters() -> None:
    for fn, limit in ((CheckpointStore.open, 10), (open_distributed, 11), (Checkpointer.open, 9)):
        params = inspect.signature(fn).parameters
        assert "options" in params, fn
        named = [p for p in params.values() if p.kind is not p.VAR_KEYWORD and p.name != "cls"]
        assert len(named) <= limit, (fn, [p.name for p in named])


def test_each_flat_keyword_names_a_field_of_the_options() -> None:
    for name, path in FLAT_KEYWORDS.items():
        cls: type = OpenOptions if len(path) == 1 else {"auth": AuthOptions, "tiers": TierOptions}[path[0]]
        assert path[-1] in cls.__dataclass_fields__, name


def test_the_flat_keywords_map_onto_the_same_object_with_a_warning(tmp_path: Path) -> None:
    timing = PieceTiming(window=1.0)
    want = OpenOptions(protocol_version=3, pieces=timing, resume_verify="cheap",
                       auth=AuthOptions("warn", KEYS),
                       tiers=TierOptions(tmp_path / "nvme", keep=3, replicate_every=2, max_lag=4,
                                         close_flush_seconds=1.0))
    with pytest.warns(DeprecationWarning, match="options=OpenOptions") as got:
        o = options_from_keywords(None, {
            "protocol_version": 3, "piece_timing": timing, "resume_verify": "cheap", "auth_policy": "warn",
            "keyring": KEYS, "local_tier": tmp_path / "nvme", "local_keep": 3, "replicate_every": 2,
            "max_replication_lag": 4, "close_flush_seconds": 1.0}, "CheckpointStore.open", stacklevel=2)
    assert o == want
    assert "tiers.max_lag" in str(got[0].message) and "auth.policy" in str(got[0].message)
    # the tier knobs without a local tier stay one tier, as they always did
    with pytest.warns(DeprecationWarning):
        assert options_from_keywords(None, {"local_tier": None, "local_keep": 3}, "x", stacklevel=2).tiers is None


def test_an_unknown_keyword_is_a_type_error_and_nothing_is_opened(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'local_tiers'"):
        CheckpointStore.open(tmp_path / "s", "run", identity=IDENT, local_tiers=tmp_path / "nvme")
    assert not (tmp_path / "s").exists()
    with pytest.raises(TypeError, match="'evry_steps'"):
        Checkpointer.open(tmp_path / "s", "run", IDENT, {}, evry_steps=3)


def test_the_same_options_reach_the_store_through_each_entry_point(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    o = OpenOptions(protocol_version=3, auth=AuthOptions("require", KEYS),
                    tiers=TierOptions(tmp_path / "nvme", keep=1, close_flush_seconds=5.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new spelling warns about nothing
        with CheckpointStore.open(tmp_path / "a", "run", identity=IDENT, options=o) as s:
            with s.save(0) as w:
                w.put("x", b"abc")
            assert s.tiered and s.auth_policy.value == "require" and s.run_record["protocol_version"] == 3
            assert s.flush(10)
        model = torch.nn.Linear(2, 2)
        with Checkpointer.open(tmp_path / "b", "run", IDENT, {"model": model}, options=o, async_save=False) as ck:
            assert ck.resume() == 0
            ck.save(0)
            st = ck.store
            assert isinstance(st, CheckpointStore)
            assert st.tiered and st.auth_policy.value == "require" and st.run_record["protocol_version"] == 3
            # Checkpointer.open verifies while it restores: the store's own check is the cheap one
            assert st.options.resume_verify == "cheap" and st.options.tiers == o.tiers
    with CheckpointStore.open(tmp_path / "b", "run", mode="r", options=OpenOptions(auth=AuthOptions("require", KEYS))) as r:
        ref = r.latest_complete(deep=True)
        assert ref is not None and ref.step == 0
