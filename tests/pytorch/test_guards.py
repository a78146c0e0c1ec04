"""What would silently change the experiment is refused or reported; hostile saves are CorruptionError."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import (
    CheckpointStore,
    CkptStoreError,
    CorruptionError,
    InvalidInputError,
)
from ckptstore.backends.memory import MemoryBackend
from ckptstore.torch import (
    Checkpointer,
    CheckpointMismatchError,
    ConfigChangeWarning,
    ResumableSampler,
    save_state,
    unflatten,
)
from ckptstore.torch.codec import DTYPE_BY_NAME, flatten, tree_from_json
from ckptstore.torch.state import STATE_COMPONENT, read_save
from tests.helpers import IDENT


def model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def train(m: torch.nn.Module, o: torch.optim.Optimizer, sched: Any = None, n: int = 2) -> None:
    for _ in range(n):
        o.zero_grad()
        m(torch.randn(6, 4)).pow(2).mean().backward()
        o.step()
        if sched is not None:
            sched.step()


def saved_run(objs: dict[str, Any]) -> MemoryBackend:
    b = MemoryBackend()
    ck = Checkpointer(CheckpointStore.open(b, "r", identity=IDENT), objs, async_save=False, handle_signals=False)
    ck.save(1)
    ck.close()
    return b


def resume(b: MemoryBackend, objs: dict[str, Any], **kw: Any) -> Checkpointer:
    ck = Checkpointer(CheckpointStore.open(b, "r", identity=IDENT), objs, async_save=False, handle_signals=False, **kw)
    ck.resume()
    return ck


# ------------------------------------------------------------------ optimizer class and layout


@pytest.mark.parametrize("other", ["Adam", "SGD"])
def test_other_optimizer_class_is_refused_before_anything_is_loaded(other: str) -> None:
    m = model()
    o = torch.optim.AdamW(m.parameters(), lr=0.01)
    train(m, o)
    b = saved_run({"model": m, "optimizer": o})
    m2 = model()
    before = [p.detach().clone() for p in m2.parameters()]
    o2 = torch.optim.Adam(m2.parameters(), lr=0.01) if other == "Adam" else torch.optim.SGD(m2.parameters(), lr=0.01)
    with pytest.raises(CheckpointMismatchError, match=rf"saved by a torch\.optim\.adamw\.AdamW, this run uses a .*{other}"):
        resume(b, {"model": m2, "optimizer": o2})
    assert all(torch.equal(a, p) for a, p in zip(before, m2.parameters(), strict=True))  # nothing loaded
    assert o2.state_dict()["state"] == {}


def test_param_group_layout_is_checked() -> None:
    m = model()
    o = torch.optim.AdamW([{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}], lr=0.01)
    train(m, o)
    b = saved_run({"model": m, "optimizer": o})
    m2 = model()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.01)  # one group instead of two
    with pytest.raises(CheckpointMismatchError, match="parameters per group"):
        resume(b, {"model": m2, "optimizer": o2})
    # same counts per group, other order of parameters: shapes differ
    m3 = model()
    o3 = torch.optim.AdamW([{"params": list(m3[2].parameters())}, {"params": list(m3[0].parameters())}], lr=0.01)
    with pytest.raises(CheckpointMismatchError, match=r"group 0 parameter 0: shape \(8, 4\) saved, \(2, 8\) here"):
        resume(b, {"model": m3, "optimizer": o3})


# ------------------------------------------------------------------ hyperparameters


def test_changed_lr_is_reported_and_saved_value_kept_by_default() -> None:
    m = model()
    o = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    train(m, o)
    b = saved_run({"model": m, "optimizer": o})
    m2 = model()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.05, weight_decay=0.1)
    with pytest.warns(ConfigChangeWarning, match=r"optimizer\['param_groups'\]\[0\]\['lr'\]: saved 0.01, configured 0.05"):
        ck = resume(b, {"model": m2, "optimizer": o2})
    assert o2.param_groups[0]["lr"] == 0.01  # exact continuation
    assert [d.path for d in ck.config_diffs] == [("param_groups", 0, "lr")]
    ev = [e for e in ck.store.events() if e["event"] == "config-differs"]
    assert ev and ev[0]["payload"]["choice"] == "keep-saved"


def test_take_new_applies_the_configured_values_and_records_the_change() -> None:
    m = model()
    o = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    train(m, o)
    b = saved_run({"model": m, "optimizer": o})
    m2 = model()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.05, weight_decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = resume(b, {"model": m2, "optimizer": o2}, on_config_change="take-new")
    assert o2.param_groups[0]["lr"] == 0.05 and o2.param_groups[0]["weight_decay"] == 0.0
    assert o2.state_dict()["state"][0]["exp_avg"].abs().sum() > 0  # the moments are the saved ones
    ev = [e for e in ck.store.events() if e["event"] == "config-change"]
    assert len(ev) == 1 and {d["path"][-1] for d in ev[0]["payload"]["differences"]} == {"lr", "weight_decay"}


def test_longer_schedule_horizon_is_reported_kept_or_taken() -> None:
    def build(total: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        m = model()
        o = torch.optim.AdamW(m.parameters(), lr=0.01)
        warm = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total - 2)
        return m, o, torch.optim.lr_scheduler.SequentialLR(o, [warm, cos], milestones=[2])

    m, o, s = build(10)
    train(m, o, s, 4)
    b = saved_run({"model": m, "optimizer": o, "scheduler": s})
    m2, o2, s2 = build(20)
    with pytest.warns(ConfigChangeWarning, match=r"scheduler\['_schedulers'\]\[1\]\['T_max'\]: saved 8, configured 18"):
        resume(b, {"model": m2, "optimizer": o2, "scheduler": s2})
    assert s2.state_dict()["_schedulers"][1]["T_max"] == 8
    m3, o3, s3 = build(20)
    resume(b, {"model": m3, "optimizer": o3, "scheduler": s3}, on_config_change="take-new")
    assert s3.state_dict()["_schedulers"][1]["T_max"] == 18 and s3.last_epoch == 4
    m4, o4, s4 = build(20)
    with pytest.raises(CheckpointMismatchError, match="T_max"):
        resume(b, {"model": m4, "optimizer": o4, "scheduler": s4}, on_config_change="refuse")


def test_same_configuration_reports_nothing() -> None:
    m = model()
    o = torch.optim.AdamW(m.parameters(), lr=0.01)
    s = torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=10)
    train(m, o, s, 3)
    b = saved_run({"model": m, "optimizer": o, "scheduler": s})
    m2 = model()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.01)
    s2 = torch.optim.lr_scheduler.OneCycleLR(o2, max_lr=0.01, total_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = resume(b, {"model": m2, "optimizer": o2, "scheduler": s2})
    assert ck.config_diffs == []


def test_shape_mismatch_message_is_short() -> None:
    big = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(30)])
    b = saved_run({"model": big})
    other = torch.nn.Sequential(*[torch.nn.Linear(8, 4 if i % 2 else 8) for i in range(30)])
    with pytest.raises(CheckpointMismatchError) as ei:
        resume(b, {"model": other})
    msg = str(ei.value)
    lines = msg.splitlines()
    assert "(30 differences)" in lines[0] and lines[-1] == "  ... and 25 more"
    assert len(lines) == 7 and max(len(x) for x in lines) < 200


# ------------------------------------------------------------------ built-time validation and iterator order


def test_unsaveable_objects_are_refused_when_the_checkpointer_is_built() -> None:
    st_ = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    dl: Any = torch.utils.data.DataLoader(list(range(8)), batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="DataLoader has no state_dict.*ResumableLoader"):
        Checkpointer(st_, {"loader": dl}, handle_signals=False)
    s = ResumableSampler(8)
    dl2: Any = torch.utils.data.DataLoader(list(range(8)), batch_size=2, sampler=s)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="register its sampler instead"):
        Checkpointer(st_, {"loader": dl2}, handle_signals=False)
    with pytest.raises(InvalidInputError, match=r"progress.*complex"):  # sets are stored losslessly now
        Checkpointer(st_, {"progress": {"seen": 1 + 2j}}, handle_signals=False)
    with pytest.raises(InvalidInputError, match="reserved"):
        Checkpointer(st_, {"rng": {}}, handle_signals=False)
    o = torch.optim.AdamW(model().parameters())
    with pytest.warns(ConfigChangeWarning, match="LambdaLR with a function: its horizon"):
        Checkpointer(st_, {"sched": torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 - s / 100)},
                     handle_signals=False).close()


def test_iterator_created_before_resume_is_refused() -> None:
    s = ResumableSampler(8, seed=1)
    b = saved_run({"sampler": s})
    s2 = ResumableSampler(8, seed=1)
    it = iter(torch.utils.data.DataLoader(list(range(8)), batch_size=2, sampler=s2))  # type: ignore[arg-type]
    next(it)
    with pytest.raises(InvalidInputError, match="Call resume\\(\\) before"):
        resume(b, {"sampler": s2})
    from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]

    def sdl() -> Any:
        return StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))

    d = sdl()
    b2 = saved_run({"loader": d})
    d2 = sdl()
    iter(d2)
    with pytest.raises(InvalidInputError, match="already has an iterator"):
        resume(b2, {"loader": d2})


# ------------------------------------------------------------------ hostile storage


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(step=7), "the state says step 7, its commit says step 1"),
        (lambda d: d["trees"]["x"].update(a={"__dtype": "load"}), "malformed '__dtype' tag: 'load'"),
        (lambda d: d["trees"]["x"].update(a={"__dtype": ["float32"]}), "malformed '__dtype'"),
        (lambda d: d["trees"]["x"].update(a={"__tuple": 5}), "malformed '__tuple'"),
        (lambda d: d["trees"]["x"].update(a={"__map": [[1]]}), "malformed '__map'"),
        (lambda d: d["trees"]["x"].update(a={"__map": [[[1], 2]]}), "malformed '__map'"),
        (lambda d: d["trees"]["x"].update(a={"__float": "1e400"}), "malformed '__float'"),
        (lambda d: d["trees"]["x"].update(a={"__t": 3}), "malformed '__t'"),
        (lambda d: d["trees"]["x"].update(a={"__evil": 1, "b": 2}), "malformed '__evil'"),
        (lambda d: d["tensor_components"].update(x="../../etc"), "not a valid reference"),
    ],
)
def test_hostile_state_documents_are_corruption(edit: Any, match: str) -> None:
    """A forger who rewrote state.json *and* its commit record (digests match):
    read_save still refuses with CorruptionError, never a raw TypeError/AttributeError."""
    b = MemoryBackend()
    st_ = CheckpointStore.open(b, "r", identity=IDENT)
    ref = save_state(st_, 1, {"x": {"a": 1, "w": torch.ones(2)}})
    doc = json.loads(st_.read(ref, STATE_COMPONENT))
    assert _decode_like_read_save(json.loads(json.dumps(doc)), 1, st_, ref).trees["x"]["a"] == 1  # untouched: fine
    edit(doc)
    with pytest.raises(CorruptionError, match=match):
        _decode_like_read_save(doc, 1, st_, ref)


def _decode_like_read_save(doc: Any, step: int, real: CheckpointStore, ref: Any) -> Any:
    """read_save's checks on a document whose digests were forged to match."""

    class _Store:
        def read(self, _ref: Any, name: str) -> bytes:
            return json.dumps(doc).encode() if name == STATE_COMPONENT else real.read(ref, name)

        def component(self, _ref: Any, name: str) -> Any:
            return real.component(ref, name)

        def read_into(self, _ref: Any, name: str, out: Any) -> None:
            real.read_into(ref, name, out)

        def read_range(self, _ref: Any, name: str, start: int, end: int) -> bytes:
            return real.read_range(ref, name, start, end)

    class _Ref:
        save_id = ref.save_id

    r = _Ref()
    r.step = step  # type: ignore[attr-defined]
    return read_save(_Store(), r)  # type: ignore[arg-type]


def test_dtypes_come_from_the_table_only() -> None:
    assert unflatten({"__dtype": "bfloat16"}, {}) is torch.bfloat16
    for name in ("load", "save", "nn", "Tensor", "__class__", "float32.__class__"):
        with pytest.raises(CorruptionError):
            unflatten({"__dtype": name}, {})
    assert all(isinstance(d, torch.dtype) for d in DTYPE_BY_NAME.values())
    assert unflatten(flatten({"d": torch.float16}).tree, {}) == {"d": torch.float16}


def test_deeply_nested_document_is_corruption() -> None:
    with pytest.raises(CorruptionError):
        tree_from_json(b"[" * 100_000 + b"]" * 100_000)
    deep: Any = 1
    for _ in range(5000):
        deep = {"__tuple": [deep]}
    with pytest.raises(CorruptionError, match="nested too deeply"):
        unflatten(deep, {})


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5))
tags = st.sampled_from(["__t", "__np", "__tuple", "__map", "__float", "__dtype", "__x", "a", "__"])
json_tree = st.recursive(
    json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.one_of(tags, st.text(max_size=4)), kids, max_size=3),
        st.builds(lambda t, v: {t: v}, tags, kids),
    ),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(tree=json_tree)
def test_fuzz_state_tree_decoder_raises_only_ckptstore_errors(tree: Any) -> None:
    tensors = {"a": torch.ones(2), "b": torch.zeros(1, dtype=torch.bfloat16)}
    try:
        out = unflatten(tree, tensors)
    except CkptStoreError:
        return
    # whatever decodes is made of state values only: nothing callable
    stack = [out]
    while stack:
        x = stack.pop()
        assert not callable(x) or isinstance(x, torch.Tensor)
        if isinstance(x, dict):
            stack.extend(x.values())
            stack.extend(x.keys())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64) | json_tree.map(lambda t: json.dumps(t).encode()))
def test_fuzz_state_document_bytes(data: bytes) -> None:
    try:
        unflatten(tree_from_json(data), {})
    except CkptStoreError:
        pass


def test_saved_tree_is_checked_against_the_live_state_dict_before_loading() -> None:
    from ckptstore.torch.restore import check_fit
    from ckptstore.torch.state import SavedState

    m = model()
    o = torch.optim.AdamW(m.parameters(), lr=0.01)
    s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)
    good = s.state_dict()

    class Ref:
        save_id, step = "s", 1

    def fit(tree: Any) -> None:
        check_fit({"scheduler": s}, SavedState({"scheduler": tree}, {}), Ref())  # type: ignore[arg-type]

    fit(dict(good))  # fine
    with pytest.raises(CheckpointMismatchError, match=r"\['T_max'\]: saved a string, this object has a number"):
        fit({**good, "T_max": "10"})
    with pytest.raises(CheckpointMismatchError, match=r"\['eta_min'\]: missing from the save"):
        fit({k: v for k, v in good.items() if k != "eta_min"})
    with pytest.raises(CheckpointMismatchError, match=r"\['extra'\]: in the save, unknown"):
        fit({**good, "extra": 1})
    with pytest.raises(CheckpointMismatchError, match="is not a state value"):
        fit({**good, "base_lrs": [print]})
    with pytest.raises(CheckpointMismatchError, match="top-level keys"):
        check_fit({"optimizer": o}, SavedState({"optimizer": {**o.state_dict(), "x": 1}}, {}), Ref())  # type: ignore[arg-type]
    assert s.state_dict() == good  # nothing was loaded


def _valid_safetensors() -> bytes:
    from ckptstore.torch.safetensors_io import safetensors_stream

    _n, chunks = safetensors_stream({"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.int64)})
    return b"".join(bytes(c) for c in chunks)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=256) | st.tuples(st.integers(0, 400), st.binary(min_size=1, max_size=8)).map(
    lambda iv: (lambda raw: raw[: iv[0] % len(raw)] + iv[1] + raw[iv[0] % len(raw) + len(iv[1]) :])(_valid_safetensors())
))
def test_fuzz_safetensors_path_raises_only_corruption(data: bytes) -> None:
    """The tensor half of a save: garbage and mutated files (header length,
    JSON header, offsets, dtypes) come out as CorruptionError, never a crash."""
    from ckptstore.torch.safetensors_io import load_safetensors

    try:
        out = load_safetensors(data)
    except CorruptionError:
        return
    assert all(isinstance(t, torch.Tensor) for t in out.values())


def test_safetensors_header_claiming_more_than_the_file_is_corruption() -> None:
    import struct

    from ckptstore.torch.safetensors_io import load_safetensors

    raw = _valid_safetensors()
    for claimed in (2**63 - 1, 2**40, len(raw)):
        with pytest.raises(CorruptionError):
            load_safetensors(struct.pack("<Q", claimed) + raw[8:])
