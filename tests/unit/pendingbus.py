"""A bus whose subscriptions stay on their way until the test settles them: for the services
that must stop quietly while they subscribe (gallery, claim consumer).  What is published is
kept in ``published`` (nobody else hears it)."""

from __future__ import annotations

from twisted.internet import defer


class PendingBus:
    def __init__(self):
        self.pending: list[defer.Deferred] = []
        self.published: list[tuple[str, object]] = []

    def subscribe(self, subject, handler) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        self.pending.append(d)
        return d

    def publish(self, subject, payload) -> defer.Deferred:
        self.published.append((subject, payload))
        return defer.succeed(None)


class Subscription:
    unsubscribed = False

    def unsubscribe(self) -> None:
        self.unsubscribed = True
