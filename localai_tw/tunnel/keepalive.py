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

This module must never be used for peer links (replica to replica); they keep their own config.
"""

from __future__ import annotations

#: Seconds between keepalive pings on a worker tunnel (each end pings).
TUNNEL_KEEPALIVE_INTERVAL = 3.0
#: Seconds a keepalive ping may go unanswered before the session is ended.
TUNNEL_KEEPALIVE_TIMEOUT = 7.0
#: The longest a silent tunnel is still taken for alive.
DEAD_TUNNEL_DETECTION = TUNNEL_KEEPALIVE_INTERVAL + TUNNEL_KEEPALIVE_TIMEOUT


def tunnel_keepalive() -> dict[str, float]:
    """The keepalive fields of a worker tunnel's ``SessionConfig``."""
    return {"keepalive_interval": TUNNEL_KEEPALIVE_INTERVAL,
            "keepalive_timeout": TUNNEL_KEEPALIVE_TIMEOUT}
