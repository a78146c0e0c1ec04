"""Say, in every run, which peer suites did not run because their upstream
test files are absent (tests/peer/README.md explains why they are not in the
repository). Without this, a missing Lightning or HF file collects nothing and
the run would be silent about it."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
UPSTREAM = [
    "lightning/tests_pytorch/checkpointing/test_model_checkpoint.py",
    "lightning/tests_pytorch/checkpointing/test_trainer_checkpoint.py",
    "lightning/tests_pytorch/trainer/connectors/test_checkpoint_connector.py",
    "hf/test_trainer_resume.py",
]


@pytest.mark.parametrize("rel", UPSTREAM)
def test_upstream_peer_file(rel: str) -> None:
    if not (HERE / rel).is_file():
        pytest.skip(f"peer suite not run: tests/peer/{rel} is absent (see tests/peer/README.md)")
    assert (HERE / rel).stat().st_size > 0
