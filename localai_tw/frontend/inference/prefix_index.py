"""Prefix-cache-aware routing: which loaded replica of a model most likely holds the head of a
prompt in its KV cache, and whether sending the request there would pile load onto it.

A backend (llama.cpp) reuses its KV cache up to the first token that differs from the previous
prompt.  A conversation's next turn repeats the whole history, so it is cheap on the node that
served the previous turn and expensive anywhere else.  This module guesses where a prefix is
warm from what the cluster routed (LocalAI's "guessed" provider):

- :func:`prefix_source` -- the text the chain is built from: the rendered prompt, or, when the
  backend applies the chat template itself (``UseTokenizerTemplate``), the messages written
  head-first (``role\\ncontent\\n`` per message), so a conversation's turns still share a head.
- :func:`prefix_chain` -- a chain of 64-bit hashes over fixed windows of that text, anchored at
  offset 0: ``h[0] = H(block 0)``, ``h[i] = H(h[i-1], block i)``; at most ``max_depth``
  blocks (the head: deeper prompts agreeing on the head are treated alike).  BLAKE2b, so every
  replica computes the same values.
- :class:`PrefixIndex` -- per model, hash -> the nodes that served a prompt with that
  prefix (up to four), and when; entries expire ``ttl`` seconds after they were last seen (reactor clock:
  the index is this process's memory, fed by every replica through the bus,
  ``prefix_fanout.py``), at most ``max_entries`` kept (the least recently seen go first).
- :func:`choose` -- the load guard and the choice: among the candidates, those whose in-flight
  count is within an absolute (``min + abs``) and a relative (``min * rel``) slack of the
  least loaded are eligible (so while any candidate is idle, only idle ones are: LocalAI adds
  1 to the relative bound, which lets a second call queue behind a busy warm node while
  another sits idle; a built-in backend serves one call at a time, and the idle node has the
  shared system prompt too); the eligible node with the deepest match wins when its match
  covers at least ``min_match`` of the chain (equal matches: the least loaded, so a shared
  system prompt known on both workers spreads new conversations); otherwise no preference (the chooser's usual
  least-loaded choice).  When the deepest match overall is on a node the guard excluded, the
  request is *forced away from the warm replica*: counted, and read by the replica scaler as a
  scale-up signal (:class:`Pressure`).

What this module must never do: block (hashing is bounded by ``window * max_depth`` bytes of
the prompt), grow past its bounds, prefer a node that is not a candidate (a departed or
unloaded node's entries are ignored, never dialled), or decide anything but a preference: the
call is dialled and its failures classified exactly as for any other placement.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from twisted.logger import Logger

log = Logger()

ROUND_ROBIN, PREFIX_CACHE = "round_robin", "prefix_cache"
POLICIES = (ROUND_ROBIN, PREFIX_CACHE)

#: Bytes per hashed window (LocalAI's default).
DEFAULT_WINDOW = 256
#: Windows hashed at most (the head of the prompt: 32 KiB).
DEFAULT_MAX_DEPTH = 128
#: Seconds an entry lives after it was last seen.
DEFAULT_TTL = 300.0
#: Load guard: a node may run this many more calls than the least loaded one...
DEFAULT_BALANCE_ABS = 2
#: ...and at most this many times as many.
DEFAULT_BALANCE_REL = 1.5
#: A match shorter than this share of the chain is no reason to prefer a node.
DEFAULT_MIN_MATCH = 0.3
#: Hashes kept at most, all models together (about 200 bytes each).
DEFAULT_MAX_ENTRIES = 200_000
#: Nodes kept per hash (the least recently seen goes first).
MAX_NODES_PER_HASH = 4
#: Seconds over which forced-away routings count as a scale-up signal.
DEFAULT_PRESSURE_WINDOW = 60.0

_INT64 = 2 ** 63


@dataclass(frozen=True)
class PrefixSettings:
    """The cluster-wide settings (``--distributed-prefix-cache*``)."""

    enabled: bool = True
    ttl: float = DEFAULT_TTL
    balance_abs: int = DEFAULT_BALANCE_ABS
    balance_rel: float = DEFAULT_BALANCE_REL
    min_match: float = DEFAULT_MIN_MATCH
    window: int = DEFAULT_WINDOW
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self):
        if self.ttl <= 0:
            raise ValueError("the prefix cache's ttl must be > 0")
        if self.balance_abs < 0 or self.balance_rel < 1:
            raise ValueError("the load guard needs balance_abs >= 0 and balance_rel >= 1")
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError("min_match must be within [0, 1]")
        if self.window < 1 or self.max_depth < 1:
            raise ValueError("window and max_depth must be >= 1")

    def policy(self, configured: str) -> str:
        """The model's policy: its ``route_policy`` when set, else the cluster default."""
        if configured:
            return configured
        return PREFIX_CACHE if self.enabled else ROUND_ROBIN


def prefix_source(options, limit: int | None = None) -> bytes:
    """What a ``PredictOptions`` is hashed from: the rendered prompt, or the messages when the
    backend renders them (``UseTokenizerTemplate``).  With ``limit``, at least its first
    ``limit`` bytes (all when shorter): what the chain can use, however long the prompt."""
    if options.Prompt:
        text = options.Prompt if limit is None else options.Prompt[:limit]
        return text.encode("utf-8", "surrogatepass")
    out = bytearray()
    for m in options.Messages:
        out += f"{m.role}\n".encode("utf-8", "surrogatepass")
        content = m.content if limit is None else m.content[:limit]
        out += content.encode("utf-8", "surrogatepass") + b"\n"
        if limit is not None and len(out) >= limit:
            break
    return bytes(out)


def prefix_chain(source: bytes, window: int = DEFAULT_WINDOW,
                 max_depth: int = DEFAULT_MAX_DEPTH) -> tuple[int, ...]:
    """The cumulative hash chain of ``source`` (signed 64-bit values; empty for no text)."""
    chain = []
    prev = b""
    for i in range(min(max_depth, -(-len(source) // window))):
        digest = hashlib.blake2b(prev + source[i * window:(i + 1) * window],
                                 digest_size=8).digest()
        prev = digest
        chain.append(int.from_bytes(digest, "big", signed=True))
    return tuple(chain)


def valid_chain(value, max_depth: int) -> tuple[int, ...] | None:
    """``value`` as a chain when it is one (a list of 64-bit ints, 1..max_depth long)."""
    if not isinstance(value, list) or not 0 < len(value) <= max_depth:
        return None
    for h in value:
        if isinstance(h, bool) or not isinstance(h, int) or not -_INT64 <= h < _INT64:
            return None
    return tuple(value)


class PrefixIndex:
    """hash -> {node: last seen}, per model, with a TTL on the reactor clock and size bounds.

    Several nodes may hold the same prefix (a shared system prompt is in the cache of every
    worker that served a conversation starting with it): each hash keeps up to
    ``max_nodes`` of them (the least recently seen goes), so a match on the shared head is a
    tie that the load decides, while a conversation's own deeper windows name its worker.

    :param clock: ``seconds()`` (the reactor; ``task.Clock`` in tests)."""

    def __init__(self, clock, *, ttl: float = DEFAULT_TTL,
                 max_entries: int = DEFAULT_MAX_ENTRIES, max_nodes: int = MAX_NODES_PER_HASH):
        if ttl <= 0 or max_entries < 1 or max_nodes < 1:
            raise ValueError("the prefix index needs ttl > 0, max_entries >= 1 and "
                             "max_nodes >= 1")
        self._clock = clock
        self.ttl = float(ttl)
        self.max_entries = int(max_entries)
        self.max_nodes = int(max_nodes)
        # (model, hash) -> {node: seen}; ordered by last seen (oldest first)
        self._entries: OrderedDict[tuple[str, int], dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, model: str, chain: Sequence[int], node_id: str) -> bool:
        """``node_id`` served a prompt whose prefix chain is ``chain``.  Returns whether that
        told the index anything new (a node not known for a window yet, or known but seen
        more than a quarter of the TTL ago): what is worth telling the other replicas."""
        if not chain or not node_id:
            return False
        now = self._clock.seconds()
        refresh = now - self.ttl / 4
        news = False
        entries = self._entries
        for h in chain:
            key = (model, h)
            nodes = entries.get(key)
            if nodes is None:
                entries[key] = {node_id: now}
                news = True
                continue
            seen = nodes.pop(node_id, None)  # re-inserted last: dicts keep insertion order
            if seen is None or seen < refresh:
                news = True
            nodes[node_id] = now
            while len(nodes) > self.max_nodes:
                del nodes[next(iter(nodes))]
            entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        return news

    def matches(self, model: str, chain: Sequence[int]) -> dict[str, int]:
        """node -> the number of leading blocks of ``chain`` it is known to hold (its deepest
        unexpired entry).  A node's entry at depth d says it served those d blocks."""
        found: dict[str, int] = {}
        if not chain:
            return found
        oldest = self._clock.seconds() - self.ttl
        entries = self._entries
        for depth in range(len(chain), 0, -1):
            nodes = entries.get((model, chain[depth - 1]))
            if nodes is None:
                continue
            for node, seen in nodes.items():
                if seen > oldest and node not in found:
                    found[node] = depth
        return found

    def drop_node(self, node_id: str, model: str | None = None) -> int:
        """Forget every entry of ``node_id`` (of ``model`` only, when given)."""
        dropped = 0
        for key in list(self._entries):
            if model is not None and key[0] != model:
                continue
            nodes = self._entries[key]
            if nodes.pop(node_id, None) is not None:
                dropped += 1
                if not nodes:
                    del self._entries[key]
        return dropped

    def expire(self) -> int:
        """Drop the windows nobody was seen with within the TTL (never used meanwhile)."""
        oldest = self._clock.seconds() - self.ttl
        dropped = 0
        entries = self._entries
        while entries:
            key, nodes = next(iter(entries.items()))
            if max(nodes.values()) > oldest:
                break
            del entries[key]
            dropped += 1
        return dropped


def eligible(loads: Mapping[str, int], balance_abs: int, balance_rel: float) -> set[str]:
    """The load guard: the nodes whose in-flight count is close enough to the least loaded."""
    if not loads:
        return set()
    least = min(loads.values())
    return {node for node, n in loads.items()
            if n <= least + balance_abs and n <= least * balance_rel}


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: ``node`` (None: no preference), the match it used, and
    whether the warm node was skipped by the load guard (``forced_away``)."""

    node: str | None
    depth: int = 0
    forced_away: bool = False


def choose(chain: Sequence[int], matches: Mapping[str, int], loads: Mapping[str, int],
           settings: PrefixSettings, pick_one: Callable[[list[str]], str] = min) -> Choice:
    """The preferred node among ``loads``' keys (the candidates, with their in-flight counts)
    for a prompt whose chain is ``chain`` (module docstring).  ``pick_one`` chooses among
    equally deep, equally loaded nodes (the first by name by default; the replica passes a
    random choice)."""
    if not chain or not loads:
        return Choice(None)
    wanted = settings.min_match * len(chain)
    useful = {node: depth for node, depth in matches.items()
              if node in loads and depth >= wanted and depth > 0}
    if not useful:
        return Choice(None)
    allowed = eligible(loads, settings.balance_abs, settings.balance_rel)
    deepest = max(useful.values())
    best = [n for n, d in useful.items() if n in allowed]
    if not best:
        return Choice(None, 0, True)
    top = max(useful[n] for n in best)
    deepest_best = [n for n in best if useful[n] == top]
    least = min(loads[n] for n in deepest_best)
    node = pick_one(sorted(n for n in deepest_best if loads[n] == least))
    return Choice(node, top, top < deepest)


class Pressure:
    """A rolling per-model count of forced-away routings (the scale-up signal)."""

    def __init__(self, clock, window: float = DEFAULT_PRESSURE_WINDOW, *,
                 max_events: int = 1024):
        self._clock = clock
        self.window = float(window)
        self.max_events = max_events
        self._events: dict[str, list[float]] = {}

    def _pruned(self, model: str) -> list[float]:
        oldest = self._clock.seconds() - self.window
        kept = [t for t in self._events.get(model, ()) if t >= oldest]
        if kept:
            self._events[model] = kept[-self.max_events:]
        else:
            self._events.pop(model, None)
        return kept

    def record(self, model: str) -> None:
        self._pruned(model)
        self._events.setdefault(model, []).append(self._clock.seconds())

    def count(self, model: str) -> int:
        return len(self._pruned(model))

    def reset(self, model: str) -> None:
        self._events.pop(model, None)

    def models(self) -> Iterable[str]:
        return list(self._events)
