"""YAML loading with a bound on alias expansion ("billion laughs").

A YAML alias is a reference: ``b: &b [*a, *a]`` costs one node to parse however big ``*a`` is,
so a 422-byte model file with nested aliases under ``engine_args`` parsed at once and then
stalled the replica 2.2 s in ``json.dumps``, which walks the expanded tree (issue 21 §1).  Every
later walk (validation, JSON, a merge, writing the config back) pays the expanded size, so it
is checked once, on the composed node graph before anything is constructed: the number of
aliases (references to a node already used) and the number of nodes the document holds once
every alias is expanded, past the nodes actually written.  A recursive alias (``&a [*a]``) is
refused too: nothing here can write or walk it.

The check is linear in the nodes written (each node's expanded size is computed once).  What
this module must never do: construct a document before it is checked, or load with anything
but a safe loader.
"""

from __future__ import annotations

from typing import Any

import yaml


class AliasBombError(yaml.YAMLError):
    """A document whose aliases expand past a limit, or refer to themselves."""


class Limits:
    """How much aliases may add to a document: ``aliases`` references at most, expanding to at
    most ``extra_nodes`` nodes beyond the ones written."""

    __slots__ = ("aliases", "extra_nodes")

    def __init__(self, aliases: int, extra_nodes: int):
        self.aliases = aliases
        self.extra_nodes = extra_nodes


#: A model config (LocalAI's never need more than a handful of aliases).
MODEL_CONFIG = Limits(aliases=64, extra_nodes=10_000)
#: A gallery index: the operator's, loaded off the reactor; LocalAI's own index merges a base
#: entry (``<<: *name``) into most of its ~2000 entries.
GALLERY_INDEX = Limits(aliases=100_000, extra_nodes=2_000_000)


def _children(node: yaml.Node):
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield key
            yield value
    elif isinstance(node, yaml.SequenceNode):
        yield from node.value


def check_expansion(root: yaml.Node, limits: Limits) -> None:
    """:raises AliasBombError: when ``root``'s aliases pass ``limits`` or are recursive."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    used: set[int] = {id(root)}
    aliases = 0
    written = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        nid = id(node)
        if done:
            open_.discard(nid)
            sizes[nid] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[nid] - written > limits.extra_nodes:
                raise AliasBombError(
                    f"its aliases expand to more than {limits.extra_nodes} values beyond the "
                    f"{written} written (a YAML alias bomb?); write the values out instead")
            continue
        if nid in sizes:
            continue
        if nid in open_:
            raise AliasBombError("an alias refers to a node that contains it (a recursive "
                                 "YAML alias)")
        open_.add(nid)
        written += 1
        stack.append((node, True))
        for child in _children(node):
            cid = id(child)
            if cid in used:
                aliases += 1
                if aliases > limits.aliases:
                    raise AliasBombError(f"it uses more than {limits.aliases} YAML aliases")
            else:
                used.add(cid)
            if cid in open_:
                raise AliasBombError("an alias refers to a node that contains it (a recursive "
                                     "YAML alias)")
            if cid not in sizes:
                stack.append((child, False))


def bounded_loader(base: type, limits: Limits) -> type:
    """A subclass of the safe loader ``base`` that checks the composed document against
    ``limits`` before constructing it."""

    class Bounded(base):  # type: ignore[misc, valid-type]
        def get_single_data(self) -> Any:
            node = self.get_single_node()
            if node is None:
                return None
            check_expansion(node, limits)
            return self.construct_document(node)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


__all__ = ["AliasBombError", "GALLERY_INDEX", "Limits", "MODEL_CONFIG", "bounded_loader",
           "check_expansion"]
