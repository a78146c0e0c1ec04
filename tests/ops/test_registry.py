"""Registering a promoted artifact in a real MLflow registry (the ``registry``
extra; a sqlite tracking store in the test's folder, no server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow
import pytest

from ckptstore.cli.commands import main
from ckptstore.errors import InvalidInputError, PromotionRefusedError
from ckptstore.ops.artifact_check import read_provenance
from ckptstore.ops.promote import promote
from ckptstore.ops.registry import TAGS, mlflow_registrar
from tests.ops.test_promote import reader, train_run


def _uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


def test_cli_registers_a_model_version_whose_tags_are_the_artifacts_provenance(tmp_path: Path, capsys: Any) -> None:
    url, art, uri = str(tmp_path / "store"), tmp_path / "art", _uri(tmp_path)
    train_run(url)
    rc = main(["promote", url, "r", "--to", str(art), "--register", "mlflow", "--model-name", "ranker",
               "--tracking-uri", uri])
    out = capsys.readouterr().out
    assert rc == 0 and "registered: ranker version 1" in out
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    mv = client.get_model_version("ranker", "1")
    prov = read_provenance(str(art))
    assert mv.source == "file://" + str(art.resolve())
    assert set(TAGS) <= set(mv.tags)
    for k in ("run_id", "save_id", "step", "manifest_digest"):
        assert mv.tags[k] == str(prov[k]), k
    assert mv.tags["manifest_digest"] == reader(url).latest_complete().manifest_digest

    # a second promotion of the same run is a second version of the same registered model
    assert main(["promote", url, "r", "--to", str(tmp_path / "art2"), "--register", "mlflow",
                 "--model-name", "ranker", "--tracking-uri", uri, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["registered"]["version"] == "2" and doc["registered"]["model"] == "ranker"
    assert sorted(str(v.version) for v in client.search_model_versions("name='ranker'")) == ["1", "2"]


def test_nothing_is_registered_for_a_refused_promotion(tmp_path: Path) -> None:
    url, uri = str(tmp_path / "store"), _uri(tmp_path)
    train_run(url, finish=False)  # no finished event: not promotable
    with pytest.raises(PromotionRefusedError):
        promote(reader(url), str(tmp_path / "art"), register=mlflow_registrar("ranker", tracking_uri=uri))
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert client.search_registered_models() == []
    assert not (tmp_path / "art").exists()


def test_a_model_name_is_required(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="--model-name"):
        mlflow_registrar("", tracking_uri=_uri(tmp_path))
