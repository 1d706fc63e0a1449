"""How deep stored entries restore a prompt, and what a new KV entry makes redundant: the cache's rules over its
radix tree, chosen by what the model's entry kinds can do (`EntryKind.prefix_closed`), not by the model.

A prefix-closed entry (attention KV) stored for tokens[:n] restores any tokens[:p], p <= n (a restore truncates
it: llama_memory_seq_rm). A model whose state has a part that is not prefix-closed (a recurrent checkpoint:
llama.cpp cannot rewind a recurrent state) restores position p only from an entry of that kind at exactly p,
plus KV covering p:

    KV only                 restore p:  a KV entry at depth >= p on the path, or the live KV
    with checkpoints        restore p:  a checkpoint at depth p  +  KV covering p (an entry, or the live KV)
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Protocol, Sequence

from .radix import EntryKind, RadixTree


class StoresKinds(Protocol):
    """What the cache asks of a model's state kind (state.StateKind): the kinds of entries it is stored as."""

    entry_kinds: frozenset[EntryKind]


class PrefixRules:
    """The match and supersede rules for a model that stores entries of `entry_kinds` (its StateKind's)."""

    def __init__(self, entry_kinds: Collection[EntryKind]) -> None:
        self.exact = any(not EntryKind(k).prefix_closed for k in entry_kinds)  # some part restores one p only

    def match(self, tree: RadixTree, tokens: Sequence[int], max_tokens: int,
              live: int) -> tuple[int, int | None, int | None]:
        """How deep stored entries restore `tokens`: (p, checkpoint id, kv id) for the deepest restorable
        p <= max_tokens (tokens); kv id None when the live sequence's KV (its first `live` tokens, computed by
        prefill) serves; checkpoint id None without checkpoints. (0, None, None) when nothing restores."""
        if not self.exact:
            depth, kv_id = tree.deepest_kv(tokens, max_tokens)
            if min(live, max_tokens) >= depth:
                return min(live, max_tokens), None, None
            return depth, None, kv_id
        for node in reversed(tree.path(tokens, max_tokens)):
            if node.checkpoint is None:
                continue
            if node.depth <= live:
                return node.depth, node.checkpoint, None
            kv_id = node.kv if node.kv is not None else tree.kv_covering(tokens, node.depth)
            if kv_id is not None:
                return node.depth, node.checkpoint, kv_id
        return 0, None, None

    def superseded(self, tree: RadixTree, tokens: Sequence[int], kv_ids: Iterable[int],
                   is_boundary: Callable[[int], bool]) -> list[int]:
        """Entries that a new KV entry for `tokens` makes redundant, among the KV entries `kv_ids` of `tree`
        (and the checkpoints that only they made restorable), each once, in the order to drop them.
        `is_boundary(id)`: whether a checkpoint was taken at a template boundary or interval (the others end a
        request).

        KV is prefix-closed, so a KV entry on the same path is covered outright. KV only: another branch stays
        restorable at every token of its own, so nothing else goes. With checkpoints, a KV entry E on another
        branch is superseded when every *boundary* checkpoint on E's path lies on the shared part: what E alone
        covers is then only the end of a previous request (its end-of-prompt and generated tokens, which the
        next prompt typically renders differently). E goes, with the end checkpoints in its tail, which no KV
        would cover any more; should that branch come back, it is prefilled from its last boundary checkpoint."""
        gone: dict[int, None] = {}  # ordered, once each: two dropped branches may share an end checkpoint
        walked = tree.walk(tokens)
        for eid in kv_ids:
            depth, branch, tail = tree.branch(eid, walked)  # tail: checkpoints on its path past the branch
            if branch == depth:
                gone[eid] = None
                continue
            if not self.exact:
                continue
            if any(is_boundary(c) for c in tail):
                continue
            gone.update(dict.fromkeys(tail + [eid]))
        return list(gone)
