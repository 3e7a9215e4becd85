"""The frontend's end of a worker tunnel keeps what it needs of the dial, not the dial itself."""

import gc
import weakref
from datetime import datetime, timezone

from twisted.internet import task
from twisted.internet.address import IPv4Address

from localai_tw.cluster.nodes import Node, NodeStatus, NodeType
from localai_tw.tunnel.connect import WorkerTunnelAcceptor


class Request:
    def getClientAddress(self):
        return IPv4Address("TCP", "10.0.0.7", 40000)

    def getHeader(self, name):
        return None  # a worker that sends no X-LocalAI-Keepalive


def node():
    now = datetime.now(timezone.utc)
    return Node(id="n-1", name="gpu-1", node_type=NodeType.BACKEND, status=NodeStatus.HEALTHY,
                approved=True, total_vram=0, available_vram=0, total_ram=0, available_ram=0,
                total_disk=0, available_disk=0, gpu_vendor="", max_replicas_per_model=1,
                last_heartbeat=now, created_at=now, labels={"zone": "a"})


def test_a_tunnel_session_does_not_keep_the_node_it_was_authorized_as():
    acceptor = WorkerTunnelAcceptor(registry=object(), reactor=task.Clock())
    authorized = node()
    session = acceptor.build_session(Request(), authorized)
    gone = weakref.ref(authorized)
    del authorized
    gc.collect()
    assert gone() is None and session is not None
