"""The terminal-escaping and redaction checks against an S3 server (moto): a
save "directory" planted with escape sequences in its name, and credentials
that must never be printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ckptstore import CheckpointStore
from tests.helpers import IDENT

pytestmark = pytest.mark.backends("moto")

EVIL = "\u202eexe.txt\u2066-\x1b[31mred\x1b]0;pwned\x07"
RAW = ("\x1b", "\x07", "\u202e", "\u2066")


# ``python -m ckptstore.cli``, with s3fs's own retry loop (5 tries, each a full
# round of botocore's retries) cut to one try: client tuning, not the store's
# logic, for a request that fails the same way every time
_ONE_S3FS_TRY = (
    "import runpy, s3fs; s3fs.S3FileSystem.retries = 1; runpy.run_module('ckptstore.cli', run_name='__main__')"
)


def _cli(*args: str, opts: dict[str, Any], one_s3fs_try: bool = False) -> subprocess.CompletedProcess[str]:
    flat = [x for k, v in opts.items() if isinstance(v, str) for x in ("-o", f"{k}={v}")]
    entry = ["-c", _ONE_S3FS_TRY] if one_s3fs_try else ["-m", "ckptstore.cli"]
    return subprocess.run(
        [sys.executable, *entry, *args, *flat], check=False, capture_output=True, text=True, timeout=120,
        env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"},
    )


def _secrets(opts: dict[str, Any]) -> list[str]:
    return [v for k, v in opts.items() if k in ("key", "secret") and isinstance(v, str)]


def test_planted_object_names_are_escaped_on_s3(backend_kind: str, object_servers: Any) -> None:
    url, opts = object_servers.url_and_options(backend_kind, f"hostile-{os.getpid()}-{id(object())}")
    st = CheckpointStore.open(url, "run", identity=IDENT, storage_options=opts)
    with st.save(1) as s:
        s.put("model", b"weights")
    st.backend.put(f"run/saves/{EVIL}/model", [b"x"])
    for command in (["ls"], ["gc", "--grace", "0"], ["latest"], ["inspect"]):
        p = _cli(command[0], url, "run", *command[1:], opts=opts)
        assert p.returncode in (0, 1), p.stderr
        out = p.stdout + p.stderr
        for ch in RAW:
            assert ch not in out, (command, out)
        for secret in _secrets(opts):
            assert secret not in out
        if "red" in p.stdout:  # a junk save name may be listed (or ignored by the catalog): then only escaped
            assert "\\u202eexe.txt\\u2066-\\x1b[31mred" in p.stdout, p.stdout
    p = _cli("ls", url, "run", "--json", opts=opts)
    assert p.returncode == 0 and not any(ch in p.stdout for ch in RAW)
    json.loads(p.stdout)


def test_refused_credentials_are_one_line_and_never_echoed(backend_kind: str, object_servers: Any) -> None:
    url, opts = object_servers.url_and_options(backend_kind, "hostile-creds")
    bad = {**opts, "secret": "wrong-secret-value-123", "key": "WRONGACCESSKEYID"}
    p = _cli("ls", url + "-missing-bucket-run", "run", opts=bad)
    assert p.returncode != 0
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "wrong-secret-value-123" not in p.stderr + p.stdout
    # an endpoint URL with a password: whatever the client makes of it, the password is never printed
    endpoint = str(opts.get("endpoint_url", ""))
    assert endpoint.startswith("http://")
    with_pw = {**opts, "endpoint_url": endpoint.replace("http://", "http://alice:hunter2pass@", 1)}
    # (aiohttp refuses credentials in the URL next to botocore's signature on
    # every request; each retry fails identically, so one s3fs try suffices)
    p = _cli("ls", url, "no-such-run", opts=with_pw, one_s3fs_try=True)
    assert p.returncode != 0
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "hunter2pass" not in p.stderr + p.stdout
