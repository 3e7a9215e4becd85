"""Benchmark: how long the reactor stalls while a big JSON request body is decoded.

Usage:  python benchmarks/bench_json_bodies.py [--mib 5]

A ``LoopingCall`` ticks every millisecond on a real reactor and records the longest gap
between ticks (the reactor's worst stall) while one body is decoded in each way:

- ``inline``: ``json.loads`` on the reactor (what every body went through before issue 21's
  last item: the C decoder holds the GIL for the whole body);
- ``offload``: ``frontend/api/jsonbody.prepare_json_body``, the replica's path for a body past
  the inline bound (the pure-Python decoder in the offload thread).

Bodies: ``numbers`` (``[1,1,...]`` token ids) and ``small arrays`` (``[[1,1,1,1,1,1,1,1],...]``,
within the 262 144-container bound).  It prints the decode time and the worst stall of each,
the ratio offload/inline of the stall, and the load average: on a machine whose load average
is above its core count, stalls are mostly the process waiting for a core.  This is a script,
not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time

from twisted.internet import defer, reactor, task

from localai_tw.frontend.api.jsonbody import prepare_json_body, read_json_object


class _Body(io.BytesIO):
    limit = 64 * 1024 * 1024


class _Request:
    def __init__(self, body: bytes):
        self.content = _Body(body)

    def getHeader(self, name: bytes):
        return b"application/json" if name.lower() == b"content-type" else None


def bodies(mib: float) -> dict[str, bytes]:
    size = int(mib * 1024 * 1024)
    return {
        "numbers": json.dumps({"tokens": [1] * (size // 2)}, separators=(",", ":")).encode(),
        "small arrays": json.dumps({"input": [[1] * 8] * min(size // 18, 262_000)},
                                   separators=(",", ":")).encode(),
    }


async def stall_of(run) -> tuple[float, float]:
    """(seconds ``run`` took, the reactor's longest gap between 1 ms ticks meanwhile)."""
    last = [time.perf_counter()]
    worst = [0.0]

    def tick():
        now = time.perf_counter()
        worst[0] = max(worst[0], now - last[0])
        last[0] = now

    ticker = task.LoopingCall(tick)
    ticker.start(0.001)
    await task.deferLater(reactor, 0.05, lambda: None)
    worst[0] = 0.0
    started = time.perf_counter()
    await run()
    took = time.perf_counter() - started
    await task.deferLater(reactor, 0.05, lambda: None)
    ticker.stop()
    return took, worst[0]


async def main(mib: float) -> None:
    print(f"load average before: {os.getloadavg()}  (cores: {os.cpu_count()})")
    for name, body in bodies(mib).items():
        async def inline():
            await task.deferLater(reactor, 0, lambda: json.loads(body))

        async def offload():
            request = _Request(body)
            await prepare_json_body(request, reactor)
            read_json_object(request)

        inline_took, inline_stall = await stall_of(inline)
        off_took, off_stall = await stall_of(offload)
        print(f"{name} ({len(body) / 1e6:.1f} MB): inline decode {inline_took:.2f} s, "
              f"worst stall {inline_stall * 1000:.0f} ms; offload decode {off_took:.2f} s, "
              f"worst stall {off_stall * 1000:.0f} ms; stall ratio offload/inline "
              f"{off_stall / inline_stall:.2f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=5.0, help="body size in MiB (default 5)")
    args = parser.parse_args()
    task.react(lambda _: defer.ensureDeferred(main(args.mib)))
