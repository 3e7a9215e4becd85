"""Whether a backend's answer honours what the request asked of it.

What a model's backend honours is decided from its name before the call
(``localai/capabilities.py``), but a worker may run another program under that name: a LocalAI
backends directory named ``transformers`` replaces the built-in there
(``backends/directory.py``), and LocalAI's own transformers backend fills no
``Reply.logprobs``.  The frontend cannot see which program a worker will run, so it checks the
answer: a reply with text and without log probabilities, to a request that asked for them, is
:class:`CapabilityNotHonoured` (400 naming ``logprobs``), never an empty list with 200.  A
stream's replies are held until the first one with log probabilities
(:class:`HeldUntilLogprobs`), so a backend that sends none is refused before anything of the
stream is delivered.

What this module must never do: decode the reply's log probabilities (the API does) or
judge a reply without text (a stream's closing usage reply carries none).
"""

from __future__ import annotations

from twisted.internet import defer

from localai_tw.frontend.inference.interfaces import CapabilityNotHonoured


def check_reply(name: str, options, reply, node_id: str) -> None:
    """:raises CapabilityNotHonoured: ``options`` asked for log probabilities and ``reply``,
    which has text, carries none."""
    if getattr(options, "Logprobs", 0) and reply.message and not reply.logprobs:
        raise CapabilityNotHonoured(name, "logprobs", node_id)


class HeldUntilLogprobs:
    """One stream attempt's replies, held while its request asked for log probabilities and
    none came yet (a backend may send a token's entry one reply late), then delivered in
    order.  A stream that ends with text and no log probabilities delivered nothing and
    fails with :class:`CapabilityNotHonoured`.  Holding is bounded by the request's own
    ``max_tokens``; a request without ``logprobs`` is passed through untouched."""

    def __init__(self, name: str, options, node_id: str, deliver):
        self.name = name
        self.node_id = node_id
        self.deliver = deliver
        self.watching = bool(getattr(options, "Logprobs", 0))
        self.held: list = []

    def reply(self, reply):
        if not self.watching:
            return self.deliver(reply)
        if not reply.logprobs:
            self.held.append(reply)
            return None
        self.watching = False
        return self._flush(reply)

    async def end(self) -> None:
        if self.watching:
            if any(r.message for r in self.held):
                raise CapabilityNotHonoured(self.name, "logprobs", self.node_id)
            self.watching = False
            await self._flush()

    async def _flush(self, last=None) -> None:
        held, self.held = self.held, []
        for reply in held + ([last] if last is not None else []):
            outcome = self.deliver(reply)
            if isinstance(outcome, defer.Deferred) or hasattr(outcome, "__await__"):
                await outcome
