"""Token-level radix tree that indexes snapshots by the token prefix they hold.

The tree knows tokens and snapshot ids only; bytes live in the store (`orchestrator.store`).

    root ──[151644, 8948, 198 ... 13]──▶ A (snapshot 1, depth 1834: end of the tools block)
                                        ├──[8948 ... 151645, 198]──▶ B (snapshot 2, depth 1901: end of system)
                                        └──[ 42 ... ]──▶ C (snapshot 3, depth 2210)

Each edge holds a run of tokens; a node's depth is the number of tokens from the root to it. A node holds at
most one snapshot id: the state after exactly its `depth` tokens.

Invariants (checked by `check()`):
  * children are keyed by the first token of their edge, and every edge is non-empty;
  * a non-root node has a snapshot or at least one child (no dead leaves);
  * `_by_id[sid].snapshot_id == sid` for every id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Match:
    """Result of a lookup: the deepest snapshot whose tokens prefix the query.

    n_tokens: tokens the snapshot covers (0 and snapshot_id None on a miss).
    """

    n_tokens: int = 0
    snapshot_id: int | None = None


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...]
    parent: "_Node | None"
    depth: int
    children: dict[int, "_Node"] = field(default_factory=dict)
    snapshot_id: int | None = None


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixTree:
    """Radix tree over token ids mapping prefixes to snapshot ids. Not thread-safe; the caller locks."""

    def __init__(self) -> None:
        self._root = _Node(edge=(), parent=None, depth=0)
        self._by_id: dict[int, _Node] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def insert(self, tokens: Sequence[int], snapshot_id: int) -> int | None:
        """Attach `snapshot_id` to the node for exactly `tokens` (splitting an edge if needed).

        Returns the id this replaces at the same prefix, or None. Raises ValueError for an empty prefix
        (a state after zero tokens is never worth storing) or an id already in the tree.
        """
        if not tokens:
            raise ValueError("cannot store a snapshot of an empty prefix")
        if snapshot_id in self._by_id:
            raise ValueError(f"snapshot id {snapshot_id} is already in the tree")
        node = self._root
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(edge=tuple(tokens[i:]), parent=node, depth=len(tokens))
                node.children[tokens[i]] = leaf
                node = leaf
                break
            k = _common_len(child.edge, tokens[i:])
            if k < len(child.edge):
                child = self._split(child, k)
            node = child
            i += k
        replaced = node.snapshot_id
        if replaced is not None:
            del self._by_id[replaced]
        node.snapshot_id = snapshot_id
        self._by_id[snapshot_id] = node
        return replaced

    def _split(self, child: _Node, k: int) -> _Node:
        """Split `child`'s edge after k tokens; returns the new middle node (depth = parent depth + k)."""
        parent = child.parent
        assert parent is not None and 0 < k < len(child.edge)
        mid = _Node(edge=child.edge[:k], parent=parent, depth=parent.depth + k)
        parent.children[mid.edge[0]] = mid
        child.edge = child.edge[k:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        return mid

    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> Match:
        """Deepest snapshot whose prefix equals tokens[:depth], with depth <= max_tokens (default len(tokens))."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        best = Match()
        node = self._root
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_len(child.edge, tokens[i:])
            if k < len(child.edge) or child.depth > limit:
                break
            node = child
            i += k
            if node.snapshot_id is not None:
                best = Match(node.depth, node.snapshot_id)
        return best

    def tokens_of(self, snapshot_id: int) -> tuple[int, ...]:
        """The token prefix a snapshot id is stored under. Raises KeyError for an unknown id."""
        node = self._by_id[snapshot_id]
        parts = []
        while node.parent is not None:
            parts.append(node.edge)
            node = node.parent
        return tuple(t for edge in reversed(parts) for t in edge)

    def depth_of(self, snapshot_id: int) -> int:
        """Tokens covered by a snapshot id. Raises KeyError for an unknown id."""
        return self._by_id[snapshot_id].depth

    def __contains__(self, snapshot_id: int) -> bool:
        return snapshot_id in self._by_id

    def find(self, tokens: Sequence[int]) -> int | None:
        """The snapshot id stored at exactly `tokens`, or None."""
        m = self.match(tokens)
        return m.snapshot_id if m.n_tokens == len(tokens) and tokens else None

    def remove(self, snapshot_id: int) -> None:
        """Detach a snapshot id and prune nodes left without purpose. Raises KeyError for an unknown id."""
        node = self._by_id.pop(snapshot_id)
        node.snapshot_id = None
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        while node.parent is not None and node.snapshot_id is None:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
            elif len(node.children) == 1:  # merge the only child into this edge
                (only,) = node.children.values()
                only.edge = node.edge + only.edge
                only.parent = parent
                parent.children[only.edge[0]] = only
            else:
                return
            node = parent

    def check(self) -> None:
        """Assert the invariants in the module docstring (for tests)."""
        seen = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                assert node.edge, "empty edge"
                assert node.depth == node.parent.depth + len(node.edge)
                assert node.snapshot_id is not None or node.children, "dead leaf"
            if node.snapshot_id is not None:
                assert self._by_id[node.snapshot_id] is node
                seen += 1
            for first, child in node.children.items():
                assert child.edge[0] == first and child.parent is node
                stack.append(child)
        assert seen == len(self._by_id)
