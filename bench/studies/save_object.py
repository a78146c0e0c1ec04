"""Save+commit of N MiB to each loopback object store next to a plain upload of
the same bytes with the same client (s3fs / gcsfs ``open(..., "wb")``).

    ./dev bench study save_object [--mib 256] [--repeat 3] [--servers seaweedfs,moto,fakegcs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ckptstore import CheckpointStore  # noqa: E402
from ckptstore.backends.fsspec_base import PART_SIZE  # noqa: E402
from ckptstore.backends.schemes import backend_from_url as object_store_backend  # noqa: E402
from devservers.servers import BUCKET, SERVERS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--servers", default="seaweedfs,moto,fakegcs")
    a = ap.parse_args()
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    data = memoryview(bytearray(os.urandom(1 << 20)) * a.mib)
    for name in a.servers.split(","):
        srv = SERVERS[name]().start()
        try:
            scheme = "gs" if name == "fakegcs" else "s3"
            url = f"{scheme}://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
            b = object_store_backend(url, storage_options=srv.storage_options())
            plain, ours = [], []
            for r in range(a.repeat):
                t = time.perf_counter()
                with b.fs.open(f"{b.root}/plain-{r}.bin", "wb", block_size=PART_SIZE) as f:
                    for i in range(0, len(data), 8 << 20):
                        f.write(data[i : i + (8 << 20)])
                plain.append(time.perf_counter() - t)
                b.fs.rm_file(f"{b.root}/plain-{r}.bin")
                st = CheckpointStore.open(b, f"bench{r}", identity={"data_digest": "b"})
                t = time.perf_counter()
                with st.save(1) as s:
                    s.put("model", data)
                ours.append(time.perf_counter() - t)
                b.fs.rm(f"{b.root}/bench{r}", recursive=True)
            mp, mo = statistics.median(plain), statistics.median(ours)
            print(f"{name}: {a.mib} MiB, median of {a.repeat}: plain upload {mp:.2f} s, "
                  f"ckptstore save+commit {mo:.2f} s, ratio {mo / mp:.2f}x")
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
