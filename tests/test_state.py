"""State kinds (orchestrator/state.py) without a model: which kind a model gets; and how deep its stored entries
restore and what a new KV entry supersedes (the cache's rules for its entry kinds, cache/rules.py)."""

from orchestrator.cache.radix import CHECKPOINT, KV, RadixTree
from orchestrator.cache.rules import PrefixRules
from orchestrator.state import HybridState, KVState, state_kind


def test_the_state_kind_follows_llama_cpps_answers():
    assert isinstance(state_kind(recurrent=False, hybrid=True, n_swa=0), HybridState)  # Qwen3.5
    assert isinstance(state_kind(recurrent=True, hybrid=False, n_swa=0), HybridState)  # Mamba: empty KV part
    attn = state_kind(recurrent=False, hybrid=False, n_swa=0)
    swa = state_kind(recurrent=False, hybrid=False, n_swa=512)  # Gemma 3
    assert isinstance(attn, KVState) and not attn.swa_full
    assert isinstance(swa, KVState) and swa.swa_full
    assert HybridState.entry_kinds == {KV, CHECKPOINT} and KVState.entry_kinds == {KV}


def tree_of(*entries) -> RadixTree:
    t = RadixTree()
    for eid, (tokens, kind) in enumerate(entries, start=1):
        t.insert(tokens, kind, eid)
    return t


def test_kv_state_restores_any_prefix_of_a_kv_entry_or_of_the_live_sequence():
    t = tree_of(([1, 2, 3, 4, 5, 6], KV))
    kv = PrefixRules(KVState.entry_kinds)
    assert kv.match(t, [1, 2, 3, 9], 3, live=0) == (3, None, 1)
    assert kv.match(t, [1, 2, 3, 4, 5, 6, 7], 4, live=0) == (4, None, 1)  # capped at max_tokens
    assert kv.match(t, [1, 2, 3, 4, 5, 6, 7], 7, live=7) == (7, None, None)  # the live KV reaches further
    assert kv.match(t, [9], 1, live=0) == (0, None, None)
    assert kv.match(t, [1], -1, live=1) == (0, None, None)  # a prompt shorter than min_segment restores nothing


def test_hybrid_state_needs_a_checkpoint_at_the_position_and_kv_covering_it():
    t = tree_of(([1, 2], CHECKPOINT), ([1, 2, 3, 4], CHECKPOINT), ([1, 2, 3, 4, 5, 6], KV))
    h = PrefixRules(HybridState.entry_kinds)
    assert h.match(t, [1, 2, 3, 4, 5, 9], 5, live=0) == (4, 2, 3)
    assert h.match(t, [1, 2, 3, 4, 5, 9], 3, live=0) == (2, 1, 3)
    assert h.match(t, [1, 2, 3, 4], 4, live=4) == (4, 2, None)  # the live sequence's KV
    assert h.match(t, [1, 2, 7], 3, live=0) == (2, 1, 3)
    assert h.match(tree_of(([1, 2], CHECKPOINT)), [1, 2, 3], 3, live=0) == (0, None, None)  # no KV anywhere


def test_superseded_kv_on_the_same_path_and_dead_branch_ends():
    # Two earlier branches beyond a boundary at [1, 2]: [1, 2, 3, ...] ends with end-of-request checkpoints only,
    # [1, 2, 5, ...] has a boundary checkpoint of its own.
    t = tree_of(([1, 2], CHECKPOINT), ([1, 2, 3, 4], CHECKPOINT), ([1, 2, 3, 4, 8], KV), ([1, 2, 3, 4, 9], KV),
                ([1, 2, 5, 6], CHECKPOINT), ([1, 2, 5, 6, 7], KV), ([1, 2, 6], KV))
    boundary = {1, 5}.__contains__
    new = [1, 2, 6, 7]
    # hybrid: the same-path KV [1, 2, 6] goes; the two branches below [1, 2, 3, 4] go with their shared end
    # checkpoint (once); the branch with a boundary checkpoint stays
    assert PrefixRules(HybridState.entry_kinds).superseded(t, new, [3, 4, 6, 7], boundary) == [2, 3, 4, 7]
    # KV only: every other branch stays restorable at each of its tokens; only the prefix KV goes
    assert PrefixRules(KVState.entry_kinds).superseded(t, new, [3, 4, 6, 7], boundary) == [7]
