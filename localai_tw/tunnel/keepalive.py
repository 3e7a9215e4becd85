"""How fast a silent worker tunnel is declared dead, on both ends (frontend and worker).

A carrier can go silent without a FIN or an RST: a NAT entry expires, a cable is pulled, a
peer freezes.  Only the yamux keepalive sees that.  With Go's values (a ping every 30 s, 10 s
to answer) a frontend kept routing to such a tunnel for up to 40 s, and every request meanwhile
waited and failed.  Here each end pings every :data:`TUNNEL_KEEPALIVE_INTERVAL` seconds and ends
the session when a ping is not answered within :data:`TUNNEL_KEEPALIVE_TIMEOUT`: silence that
starts right after an answer is seen at the next ping's expiry, interval + timeout later, so a
dead tunnel is declared dead within :data:`DEAD_TUNNEL_DETECTION` (10 s).

Why 3 + 7 and not 5 + 5: a ping waits behind the stream data already queued on the carrier (a
large staging upload on a slow link fills the socket buffers), and its answer waits likewise on
the other side; 7 s leaves room for that on a link of a few Mbit/s.  A ping every 3 s each way costs a few dozen bytes per
worker per second.

A ping leaves only when the tunnel was quiet for an interval (``keepalive_when_quiet``,
:data:`PING_ONLY_WHEN_QUIET`): any byte from the peer (its own ping, an answer, stream data)
proves it alive as well as a pong, so an idle tunnel whose two ends both ping carries about one
ping and its answer per interval instead of two of each (a replica holding 4000 idle workers
wrote and read 5300 frames a second for them: docs/benchmarks.md, "An idle fleet").  The bound
is the same: the end that heard last pings an interval after that, and declares the tunnel dead
``timeout`` later.  What this gives up: a peer that keeps writing while it reads nothing is no
longer caught by our pings (none leave while it writes); its streams stall on their windows, and
a working peer's own keepalive ends the session when our answers stop reaching it.

The frontend pings no worker that says it pings (``X-LocalAI-Keepalive: worker-pings`` on the
upgrade request, :data:`WORKER_PINGS_HEADER`).  With both ends pinging when quiet the frontend
still pinged first whenever the worker's timer ran late, and then answered nothing less.  Such a
worker pings every :data:`WORKER_PING_INTERVAL` (5 s) **whatever it reads** (a frontend
trickling a request body to it must still hear from it) and whether or not its previous ping
was answered, and the frontend's end (``keepalive_peer_pings``) sends no keepalive ping: it ends
the session when it has read no byte for :data:`DEAD_TUNNEL_DETECTION`.  The worker's end ends
the session the same way (``keepalive_on_silence``): after :data:`DEAD_TUNNEL_DETECTION`
without a byte, not when one ping goes unanswered, so any byte counts as an answer.  That is
what lets its interval be 5 s instead of 2.8 s for the same bound: the 7 s a ping was given to
be answered (room for an answer queued behind stream data on a slow link) is not needed when
the stream data itself proves the frontend alive.  An idle tunnel carries one ping and its answer
per 5 s instead of per 2.8 s (a replica holding 4000 idle workers: 800 instead of 1430 of each a
second; docs/benchmarks.md, "An idle fleet").  The bounds, from the last byte each end read:

- frontend: exactly :data:`DEAD_TUNNEL_DETECTION` (10 s, to half a wheel tick), as before.  A
  live worker writes a ping every 5 s, so one ping may be up to 5 s late (the worker's timer
  lagging, its reactor busy) before a live tunnel is dropped.
- worker: :data:`DEAD_TUNNEL_DETECTION` likewise: a live frontend answers every ping, so it
  hears a byte at least every 5 s on an idle tunnel.
- an old worker (no header): the frontend keeps pinging when quiet, 3 s + 7 s.  A new worker on
  an old frontend: the frontend pings when 3 s pass without the worker's 5 s ping, and the
  worker answers; both bounds hold.

The receive-window auto-tuning of a tunnel's streams (``tunnel_windows``) lives here too: it is
the other setting both ends of a worker tunnel share; its round trips come from these pings and
from the tuner's own probe pings (one per measuring period, so a busy tunnel that sends no
keepalive still measures).

This module must never be used for peer links (replica to replica); they keep their own config.
"""

from __future__ import annotations

#: Seconds between keepalive pings on a worker tunnel (each end pings).
TUNNEL_KEEPALIVE_INTERVAL = 3.0
#: Seconds a keepalive ping may go unanswered before the session is ended.
TUNNEL_KEEPALIVE_TIMEOUT = 7.0
#: The longest a silent tunnel is still taken for alive.
DEAD_TUNNEL_DETECTION = TUNNEL_KEEPALIVE_INTERVAL + TUNNEL_KEEPALIVE_TIMEOUT
#: Ping only after an interval without a byte from the peer (see the module docstring).
PING_ONLY_WHEN_QUIET = True
#: Seconds between the pings of a worker's end (it pings whatever it reads and ends the session
#: after DEAD_TUNNEL_DETECTION without a byte: see the module docstring).
WORKER_PING_INTERVAL = 5.0


#: The header of a tunnel upgrade's answer by which a replica tells the worker that it stamps
#: the worker's heartbeat while it holds the tunnel (``cluster/liveness.py``); the worker then
#: sends its HTTP heartbeat only on a capacity change or its slow refresh (``worker/service.py``).
LIVENESS_HEADER = "X-LocalAI-Liveness"
LIVENESS_BY_TUNNEL = "tunnel"


#: The header of a tunnel upgrade request by which a worker says that it pings every interval
#: whatever it reads; the frontend then sends it no keepalive ping (see the module docstring).
WORKER_PINGS_HEADER = "X-LocalAI-Keepalive"
WORKER_PINGS = "worker-pings"


def tunnel_keepalive(worker: bool = False, peer_pings: bool = False) -> dict[str, float | bool]:
    """The keepalive fields of a worker tunnel's ``SessionConfig``.  ``worker``: the worker's
    end, which pings every :data:`WORKER_PING_INTERVAL` whatever it reads (it sends
    :data:`WORKER_PINGS_HEADER`) and ends the session after :data:`DEAD_TUNNEL_DETECTION`
    without a byte.  ``peer_pings``: the frontend's end of a tunnel whose worker sent that
    header: no ping, the session ends after :data:`DEAD_TUNNEL_DETECTION` without a byte from
    the worker."""
    if worker:
        return {"keepalive_interval": WORKER_PING_INTERVAL,
                "keepalive_timeout": DEAD_TUNNEL_DETECTION - WORKER_PING_INTERVAL,
                "keepalive_when_quiet": False,
                "keepalive_on_silence": True}
    return {"keepalive_interval": TUNNEL_KEEPALIVE_INTERVAL,
            "keepalive_timeout": TUNNEL_KEEPALIVE_TIMEOUT,
            "keepalive_when_quiet": PING_ONLY_WHEN_QUIET,
            "keepalive_peer_pings": peer_pings}


#: The largest receive window one tunnel stream grows to (``mux/autowindow.py``): twice the
#: bandwidth-delay product of a 100 MB/s link at a 150 ms round trip (a staged GGUF to a worker
#: in another region), where the fixed 256 KiB window moves 1.7 MB/s.  16 MiB reached only
#: 0.51x raw TCP on such a link in bench_long_link.py; the rule settles near 2 BDPs.
TUNNEL_STREAM_WINDOW_MAX = 32 * 1024 * 1024
#: What the streams of one tunnel session may hold above 256 KiB each, together.
TUNNEL_SESSION_WINDOW_MAX = 64 * 1024 * 1024
#: The frontend's budget for grown windows over ALL its worker tunnels (thousands of sessions
#: must not each take 64 MiB); shared through one ``WindowPool`` per process.
FRONTEND_WINDOW_BUDGET = 256 * 1024 * 1024


def tunnel_windows(pool=None) -> dict:
    """The window auto-tuning fields of a worker tunnel's ``SessionConfig``; ``pool``: the
    ``WindowPool`` shared by the sessions of this process (the frontend's), or None."""
    return {"auto_window": TUNNEL_STREAM_WINDOW_MAX, "session_window": TUNNEL_SESSION_WINDOW_MAX,
            "window_pool": pool}
