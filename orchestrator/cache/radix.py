"""Token-level radix tree that indexes snapshot entries by the token prefix they hold.

The tree knows tokens and entry ids only; bytes live in the tiers (`orchestrator.cache.snapshots`).

    root ──[248045, 8678, 198 ... 29]──▶ A depth 1834 {checkpoint}        (end of the tools block)
                                     ├──[ ... 248046, 198]──▶ B depth 1901 {checkpoint}   (end of system)
                                     │                         └──[...]──▶ D depth 2210 {checkpoint, kv}
                                     └──[ 42 ... ]──▶ C depth 2050 {checkpoint, kv}

A node's depth is the number of tokens from the root to it. A node holds at most one entry per kind
(`EntryKind`):
  * CHECKPOINT: a recurrent checkpoint, the recurrent state after exactly `depth` tokens;
  * LOGITS: the logits after the last of those tokens (where a prompt ended);
  * KV: the attention KV of those `depth` tokens. KV is a prefix-closed quantity (vLLM: "downward-closed"): the
        KV of D covers every position of B and A too, so a checkpoint at any ancestor plus a KV entry in its
        subtree restores that ancestor (load KV, load checkpoint, truncate the KV).

Invariants (checked by `check()`):
  * children are keyed by the first token of their edge, and every edge is non-empty;
  * a non-root node has an entry or at least one child (no dead leaves);
  * node.kv_below == number of "kv" entries in the node's subtree, itself included;
  * `_nodes[eid]` is the node that holds entry eid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterator, Sequence


class EntryKind(str, Enum):
    """What a snapshot entry holds. Values are the names used in logs, stats and disk keys."""

    CHECKPOINT = "checkpoint"  # the recurrent state at one position (llama.cpp: a PARTIAL_ONLY sequence state)
    KV = "kv"  # the attention KV of a prefix (or the whole state where it is KV only, or cannot be split)
    LOGITS = "logits"  # the logits of the last of `depth` tokens as the prefill ending there computed them
    #                    (float32, shape (n_vocab,)): stored where a prompt ends, so that a byte-identical repeat
    #                    samples its first token with no llama_decode (reuse.py)

    def __str__(self) -> str:
        return self.value

    @property
    def prefix_closed(self) -> bool:
        """Whether an entry stored for tokens[:n] also restores every shorter prefix tokens[:p] (a restore
        truncates it: llama_memory_seq_rm), as attention KV does; a recurrent checkpoint restores its own
        position only (llama.cpp cannot rewind a recurrent state)."""
        return self is EntryKind.KV

    __hash__ = str.__hash__  # a member and its value are the same dict key


CHECKPOINT, KV, LOGITS = EntryKind.CHECKPOINT, EntryKind.KV, EntryKind.LOGITS


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...]
    parent: "_Node | None"
    depth: int
    children: dict[int, "_Node"] = field(default_factory=dict)
    entries: dict[EntryKind, int] = field(default_factory=dict)
    kv_below: int = 0


@dataclass(frozen=True)
class PathNode:
    """A node on the matched path of a query: its depth (tokens) and entry ids by kind."""

    depth: int
    checkpoint: int | None
    kv: int | None
    kv_below: int  # KV entries in this node's subtree (0: no stored KV covers this depth)


def common_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (lists or tuples, in any mix)."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):  # the common case on a tree walk: the whole edge matches
        return n
    i = 0
    while i + _STRIDE <= n and tuple(a[i:i + _STRIDE]) == tuple(b[i:i + _STRIDE]):  # C-speed comparison
        i += _STRIDE
    while i < n and a[i] == b[i]:
        i += 1
    return i


_STRIDE = 64  # tokens compared at once by common_len before it goes token by token


class RadixTree:
    """Radix tree over token ids holding entry ids per node. Not thread-safe; the caller locks."""

    def __init__(self) -> None:
        self._root = _Node(edge=(), parent=None, depth=0)
        self._nodes: dict[int, _Node] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, eid: int) -> bool:
        return eid in self._nodes

    # ------------------------------------------------------------------ updates

    def insert(self, tokens: Sequence[int], kind: EntryKind, eid: int) -> int | None:
        """Attach entry `eid` of `kind` to the node for exactly `tokens`, splitting an edge if needed.

        Returns the id of the entry of the same kind it replaces there, or None. Raises ValueError for an empty
        prefix, an unknown kind or an id already in the tree.
        """
        if not tokens:
            raise ValueError("cannot store a snapshot of an empty prefix")
        kind = EntryKind(kind)  # ValueError for an unknown kind
        if eid in self._nodes:
            raise ValueError(f"entry id {eid} is already in the tree")
        node = self._root
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(edge=tuple(tokens[i:]), parent=node, depth=len(tokens))
                node.children[tokens[i]] = leaf
                node = leaf
                break
            k = common_len(child.edge, tokens[i:i + len(child.edge)])
            if k < len(child.edge):
                child = self._split(child, k)
            node = child
            i += k
        replaced = node.entries.get(kind)
        if replaced is not None:
            del self._nodes[replaced]
        elif EntryKind(kind).prefix_closed:
            self._add_kv(node, +1)
        node.entries[kind] = eid
        self._nodes[eid] = node
        return replaced

    def _add_kv(self, node: _Node | None, delta: int) -> None:
        while node is not None:
            node.kv_below += delta
            node = node.parent

    def _split(self, child: _Node, k: int) -> _Node:
        parent = child.parent
        assert parent is not None and 0 < k < len(child.edge)
        mid = _Node(edge=child.edge[:k], parent=parent, depth=parent.depth + k, kv_below=child.kv_below)
        parent.children[mid.edge[0]] = mid
        child.edge = child.edge[k:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        return mid

    def remove(self, eid: int) -> None:
        """Detach an entry and prune nodes left without purpose. Raises KeyError for an unknown id."""
        node = self._nodes.pop(eid)
        kind = next(k for k, v in node.entries.items() if v == eid)
        del node.entries[kind]
        if EntryKind(kind).prefix_closed:
            self._add_kv(node, -1)
        while node.parent is not None and not node.entries:
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

    # ------------------------------------------------------------------ queries

    def path(self, tokens: Sequence[int], max_tokens: int | None = None) -> list[PathNode]:
        """Nodes with entries whose whole prefix equals tokens[:depth], depth <= max_tokens, shallow first."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        out: list[PathNode] = []
        node = self._root
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = common_len(child.edge, tokens[i:i + len(child.edge)])
            if k < len(child.edge) or child.depth > limit:
                break
            node = child
            i += k
            if node.entries:
                out.append(PathNode(node.depth, node.entries.get(CHECKPOINT), node.entries.get(KV),
                                    node.kv_below))
        return out

    def kv_covering(self, tokens: Sequence[int], depth: int) -> int | None:
        """Id of the shallowest KV entry whose prefix extends tokens[:depth] (so its KV covers `depth`)."""
        node = self._node_at(tokens, depth)
        if node is None or node.kv_below == 0:
            return None
        while KV not in node.entries:  # descend towards the shallowest KV below
            node = min((c for c in node.children.values() if c.kv_below), key=lambda c: c.depth)
        return node.entries[KV]

    def deepest_kv(self, tokens: Sequence[int], max_tokens: int) -> tuple[int, int | None]:
        """(p, id): the deepest p <= max_tokens such that a KV entry's prefix extends tokens[:p], and the id of
        one such entry; (0, None) if none. For KV-only states, where any prefix of a KV entry is restorable."""
        limit = min(max_tokens, len(tokens))
        node, i, best = self._root, 0, 0
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None or child.kv_below == 0:
                break
            k = common_len(child.edge, tokens[i:min(limit, i + len(child.edge))])
            best = i + k
            if k < len(child.edge):
                break
            node, i = child, i + k
        return (best, self.kv_covering(tokens, best)) if best else (0, None)

    def _node_at(self, tokens: Sequence[int], depth: int) -> _Node | None:
        node = self._root
        i = 0
        while i < depth:
            child = node.children.get(tokens[i])
            if child is None:
                return None
            k = common_len(child.edge, tokens[i:min(depth, i + len(child.edge))])
            if k < min(len(child.edge), depth - i):
                return None
            if i + len(child.edge) > depth:  # depth falls inside this edge: the child's subtree covers it
                return child
            node = child
            i += k
        return node

    def find(self, tokens: Sequence[int], kind: EntryKind) -> int | None:
        """The entry of `kind` stored at exactly `tokens`, or None."""
        node = self._node_at(tokens, len(tokens)) if tokens else None
        return node.entries.get(kind) if node is not None and node.depth == len(tokens) else None

    def walk(self, tokens: Sequence[int]) -> dict[int, int]:
        """The nodes the path of `tokens` enters, as {id(node): tokens of it matched} (its depth where the whole
        edge matches, less on the last node where `tokens` ends or leaves inside the edge); the root included.
        For `branch`, which then finds where any entry's path leaves this one without building its tokens."""
        node, i = self._root, 0
        out = {id(node): 0}
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = common_len(child.edge, tokens[i:i + len(child.edge)])
            out[id(child)] = i + k
            if k < len(child.edge):
                break
            node, i = child, i + k
        return out

    def branch(self, eid: int, walked: dict[int, int]) -> tuple[int, int, list[int]]:
        """For entry `eid` and the `walk` of some tokens: (its depth, the length of the common prefix of its tokens
        and those, the checkpoint ids on its path deeper than that, shallow first). Equals
        common_len(tokens_of(eid), tokens) and the checkpoints of path(tokens_of(eid)) past it, in O(nodes)."""
        node = self._nodes[eid]
        depth, tail = node.depth, []
        while id(node) not in walked:
            if CHECKPOINT in node.entries:
                tail.append(node.entries[CHECKPOINT])
            node = node.parent
        branch = walked[id(node)]  # a node entered whole: its depth; the last node entered: the tokens matched
        if branch < node.depth and CHECKPOINT in node.entries:
            tail.append(node.entries[CHECKPOINT])
        tail.reverse()
        return depth, branch, tail

    def tokens_of(self, eid: int) -> tuple[int, ...]:
        """The token prefix an entry is stored under. Raises KeyError for an unknown id."""
        node = self._nodes[eid]
        parts = []
        while node.parent is not None:
            parts.append(node.edge)
            node = node.parent
        return tuple(t for edge in reversed(parts) for t in edge)

    def kind_of(self, eid: int) -> EntryKind:
        node = self._nodes[eid]
        return next(k for k, v in node.entries.items() if v == eid)

    def covered(self, eid: int) -> bool:
        """A KV entry with another KV entry deeper in its subtree: the deeper one covers every position."""
        node = self._nodes[eid]
        return node.kv_below > 1 and node.entries.get(KV) == eid

    def recompute_tokens(self, eid: int) -> int:
        """Tokens to prefill again if this entry were lost: a checkpoint's, from the nearest ancestor checkpoint;
        a KV entry's, those of its prefix that no other KV entry covers (from the deepest ancestor where
        another KV branch leaves its path)."""
        node = self._nodes[eid]
        kind = self.kind_of(eid)
        if EntryKind(kind).prefix_closed:  # only the part no other KV covers: beyond where another KV branch leaves
            anc = node.parent
            while anc is not None and anc.kv_below < 2:
                anc = anc.parent
            return node.depth - (anc.depth if anc is not None else 0)
        anc = node.parent
        while anc is not None and kind not in anc.entries:
            anc = anc.parent
        return node.depth - (anc.depth if anc is not None else 0)

    def stretch_below(self, eid: int, limit: int) -> int:
        """Tokens from an entry's node down its unbranched path to the first node that forks or ends (a leaf),
        or `limit` if that is further. 0 where the node itself forks or ends."""
        node, n = self._nodes[eid], 0
        while len(node.children) == 1 and n <= limit:
            (node,) = node.children.values()
            n += len(node.edge)
        return min(n, limit)

    def branches_below(self, eid: int) -> int:
        """Leaves in the subtree of an entry's node: how many distinct continuations share its prefix."""
        stack, leaves = [self._nodes[eid]], 0
        while stack:
            n = stack.pop()
            if not n.children:
                leaves += 1
            stack.extend(n.children.values())
        return leaves

    def ids(self) -> Iterator[int]:
        return iter(self._nodes)

    def check(self) -> None:
        """Assert the invariants in the module docstring (for tests)."""
        seen = 0

        def visit(node: _Node) -> int:
            nonlocal seen
            if node.parent is not None:
                assert node.edge, "empty edge"
                assert node.depth == node.parent.depth + len(node.edge)
                assert node.entries or node.children, "dead leaf"
            for eid in node.entries.values():
                assert self._nodes[eid] is node
                seen += 1
            kv = int(KV in node.entries)
            for first, child in node.children.items():
                assert child.edge[0] == first and child.parent is node
                kv += visit(child)
            assert node.kv_below == kv, "kv_below out of date"
            return kv

        visit(self._root)
        assert seen == len(self._nodes)
