"""Registering a promoted artifact in a model registry (optional extra).

``ckptstore promote URL RUN --to DIR --register mlflow --model-name NAME``
creates an MLflow model version whose ``source`` is the artifact and whose
tags hold the run ID, save ID, step and manifest digest (and the tensor
digest), after the artifact verified against the store, never before
(:func:`ckptstore.ops.promote.promote` calls the registrar last).

MLflow is not a dependency: it is the ``registry`` extra
(``pip install 'ckptstore[registry]'``); without it the registrar raises
:class:`~ckptstore.errors.ExtraRequiredError` naming that line, before
anything is promoted. The tracking store is whatever ``tracking_uri`` (or
``MLFLOW_TRACKING_URI``) names, e.g. a local ``file:`` / ``sqlite:`` store.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from ..errors import ExtraRequiredError, InvalidInputError

#: tags every model version carries
TAGS = ("run_id", "save_id", "step", "manifest_digest", "tensors_digest")


def require_mlflow() -> None:
    if importlib.util.find_spec("mlflow") is None:
        raise ExtraRequiredError("--register mlflow", "registry", "mlflow")


def mlflow_registrar(model_name: str, *, tracking_uri: str | None = None) -> Callable[[Any], dict[str, Any]]:
    """A ``register=`` callable for :func:`~ckptstore.ops.promote.promote`.
    Checks now that MLflow is installed (so nothing is promoted in vain)."""
    if not model_name or not isinstance(model_name, str):
        raise InvalidInputError("--register mlflow needs --model-name")
    require_mlflow()

    def register(promotion: Any) -> dict[str, Any]:
        mlflow: Any = importlib.import_module("mlflow")  # the optional extra: no stubs needed
        MlflowException = importlib.import_module("mlflow.exceptions").MlflowException  # noqa: N806

        client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        try:
            client.create_registered_model(model_name)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
        p = promotion.provenance
        source = promotion.location if "://" in promotion.location else "file://" + os.path.abspath(promotion.location)
        tags = {k: str(p.get(k)) for k in TAGS}
        mv = client.create_model_version(model_name, source=source, tags=tags,
                                         description=f"ckptstore run {p['run_id']} step {p['step']}")
        return {"registry": "mlflow", "model": model_name, "version": str(mv.version), "source": source, "tags": tags}

    return register
