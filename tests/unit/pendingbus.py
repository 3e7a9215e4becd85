"""A bus whose subscriptions stay on their way until the test settles them: for the services
that must stop quietly while they subscribe (gallery, claim consumer)."""

from __future__ import annotations

from twisted.internet import defer


class PendingBus:
    def __init__(self):
        self.pending: list[defer.Deferred] = []

    def subscribe(self, subject, handler) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        self.pending.append(d)
        return d


class Subscription:
    unsubscribed = False

    def unsubscribe(self) -> None:
        self.unsubscribed = True
