"""Property tests (hypothesis) of the boundary detector, the radix tree and the snapshot cache.

* Random Qwen3.5 conversations (roles, lengths, tools and tool calls, thinking on or off, edits of earlier
  messages, extensions, prefixes) run through the scheduler: every response equals the cold response bit for bit,
  and cached_tokens never exceeds the longest prefix shared with an earlier request (its prompt and output).
* Random cache operations with salts against a brute-force model: a plan is the deepest restorable prefix of
  its own salt, and the tree and tiers stay consistent within the budget.
* Prefill chunking (chunks.py): chunks cover the tokens in order within n_batch, none shorter than min_segment
  unless the whole is, and with odd ubatches every chunk of a long enough stretch is odd.

Bounded: few examples, no deadline (the model runs on shared CPUs).
"""

from __future__ import annotations

import tempfile

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from orchestrator.cache.snapshots import SnapshotCache
from orchestrator.cache.disk import DiskTier
from orchestrator.cache.radix import CHECKPOINT, KV, common_len
from orchestrator.cache.tiers import RamTier
from orchestrator.chunks import chunk_sizes

from .conftest import run_chat

WORDS = ("the cache restores state tokens a prefix of every request, tool call result 42 {\"ok\": true} 数据 "
         "🙂 def f(x): return x\n\n- item").split(" ")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the tests.", "parameters": {
        "type": "object", "properties": {"selector": {"type": "string"}}}}},
]

text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=40).map(" ".join)


@st.composite
def assistant_turn(draw, tools):
    """An assistant message, or an assistant tool call with its tool result(s) and a closing answer."""
    msg = {"role": "assistant", "content": draw(text)}
    if draw(st.booleans()):
        msg["reasoning_content"] = draw(text)
    if not tools or not draw(st.booleans()):
        return [msg]
    n = draw(st.integers(1, 2))
    calls = [{"id": f"call_{i}", "type": "function", "function": {
        "name": draw(st.sampled_from([t["function"]["name"] for t in tools])),
        "arguments": {"city": draw(text)}}} for i in range(n)]
    out = [{**msg, "content": "", "tool_calls": calls}]
    out += [{"role": "tool", "tool_call_id": c["id"], "content": draw(text)} for c in calls]
    return out


@st.composite
def conversation(draw):
    tools = draw(st.sampled_from([None, TOOLS[:1], TOOLS]))
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(text)})
    for i in range(draw(st.integers(1, 3))):
        if i:
            msgs += draw(assistant_turn(tools))
        msgs.append({"role": "user", "content": draw(text)})
    return msgs, tools


@st.composite
def request_sequence(draw):
    """A first conversation, then up to three requests derived from earlier ones."""
    msgs, tools = draw(conversation())
    seq = [(msgs, tools, draw(st.booleans()))]
    for _ in range(draw(st.integers(1, 3))):
        base, tools, _thinking = seq[draw(st.integers(0, len(seq) - 1))]
        op = draw(st.sampled_from(["extend", "edit", "prefix", "fresh"]))
        if op == "extend":
            new = base + draw(assistant_turn(tools)) + [{"role": "user", "content": draw(text)}]
        elif op == "edit":
            i = draw(st.integers(0, len(base) - 1))
            new = [dict(m) for m in base]
            if new[i].get("tool_calls"):
                new[i]["reasoning_content"] = draw(text)
            else:
                new[i]["content"] = draw(text)
        elif op == "prefix":
            users = [i for i, m in enumerate(base) if m["role"] == "user"]
            new = base[: draw(st.sampled_from(users)) + 1]
        else:  # another conversation with the same system message and tools
            fresh, _ = draw(conversation())
            new = [m for m in base[:1] if m["role"] == "system"] + [m for m in fresh if m["role"] != "system"]
        seq.append((new, tools, draw(st.booleans())))
    return seq


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request_sequence())
def test_random_conversations_equal_cold_and_never_over_report_cached_tokens(runtime, seq):
    rt = runtime
    rt.cache.clear()
    earlier: list[tuple[list[int], bool]] = []  # (prompt + completion, ended by an end-of-generation token)
    prompt_lengths: list[int] = []  # of the earlier prompts: their prompt ends are restorable
    earlier_positions: set[int] = set()  # checkpoints earlier requests stored at their own boundaries
    for msgs, tools, thinking in seq:
        warm = run_chat(rt, msgs, tools, True, 4, enable_thinking=thinking)
        cold = run_chat(rt, msgs, tools, False, 4, enable_thinking=thinking)
        assert warm.result.completion_tokens == cold.result.completion_tokens
        assert np.array_equal(warm.result.first_logits, cold.result.first_logits)
        bound = 0
        for full, eog in earlier:
            shared = common_len(warm.tokens, full)
            bound = max(bound, shared + (1 if eog and shared == len(full) else 0))  # the stored end-of-turn token
        assert warm.result.cached_tokens <= bound
        event("hit" if warm.result.cached_tokens else "miss")
        n = len(warm.tokens)  # at least min_segment (2 here) prefilled, unless an earlier prompt was this one
        assert warm.result.cached_tokens <= n - 2 or (warm.result.cached_tokens == n and n in prompt_lengths)
        if warm.result.cached_tokens:
            assert warm.result.cached_tokens in set(warm.boundaries.positions(n)) | {
                len(f) for f, _ in earlier} | {len(f) + 1 for f, _ in earlier} | set(prompt_lengths) | (
                earlier_positions)
        full = warm.tokens + warm.result.completion_tokens
        earlier.append((full, warm.result.finish_reason == "stop"))
        prompt_lengths.append(len(warm.tokens))
        earlier_positions.update(warm.boundaries.positions(len(warm.tokens)))
    rt.scheduler.drain()
    rt.cache.check()


# ---------------------------------------------------------------- cache model (no llama.cpp)

ops = st.lists(st.tuples(
    st.sampled_from(["put_rec", "put_kv", "plan"]),
    st.sampled_from(["", "a", "b"]),
    st.lists(st.integers(0, 3), min_size=1, max_size=8),  # small alphabet: many shared prefixes
), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_cache_plans_are_the_deepest_restorable_prefix_of_their_own_salt(operations):
    cache = SnapshotCache([RamTier(1 << 30)])  # no eviction: the model below is exact
    model: dict[str, dict[str, set[tuple[int, ...]]]] = {}
    for op, salt, tokens in operations:
        entries = model.setdefault(salt, {CHECKPOINT: set(), KV: set()})
        if op == "put_rec":
            assert cache.put(tokens, CHECKPOINT, b"r" * len(tokens), salt=salt)
            entries[CHECKPOINT].add(tuple(tokens))
        elif op == "put_kv":
            assert cache.put(tokens, KV, b"k" * len(tokens), salt=salt)
            # Storing KV may drop KV it supersedes (SnapshotCache._drop_superseded): read back what is left.
            entries[KV] = {k for kind, _tier, k in cache.entries(salt=salt) if kind == KV}
            entries[CHECKPOINT] = {k for kind, _tier, k in cache.entries(salt=salt) if kind == CHECKPOINT}
        else:
            plan = cache.plan(tokens, len(tokens), salt=salt)
            best = 0
            for p in range(len(tokens), 0, -1):
                prefix = tuple(tokens[:p])
                if prefix in entries[CHECKPOINT] and any(k[:p] == prefix for k in entries[KV]):
                    best = p
                    break
            assert plan.n_tokens == best
            if best:
                data = cache.load(plan)
                assert data is not None and data[1] == b"r" * best  # its own checkpoint, of its own length
                assert len(data[0]) >= best
        cache.check()




@settings(max_examples=40, deadline=None)
@given(ops, st.integers(8, 64), st.integers(0, 1200))
def test_cache_under_a_small_budget_stays_consistent_and_never_crosses_salts(operations, budget, disk_budget):
    """With a RAM budget and a disk tier that both evict (a disk file is 59 + 5 bytes per token here), the index
    stays what the tiers hold (`check`), within budget, and bytes read back are the salt's own."""
    with tempfile.TemporaryDirectory() as d, DiskTier(d, disk_budget, b"f" * 32) as disk:
        cache = SnapshotCache([RamTier(budget), disk])
        for op, salt, tokens in operations:
            if op == "plan":
                plan = cache.plan(tokens, len(tokens), salt=salt)
                if plan.n_tokens:
                    got = cache.load(plan)
                    if got is not None:
                        assert got[1] == (salt.encode() or b"-") * plan.n_tokens
            else:
                kind = CHECKPOINT if op == "put_rec" else KV
                cache.put(tokens, kind, (salt.encode() or b"-") * len(tokens), salt=salt)  # salt-marked bytes
            s = cache.stats()
            assert s.ram_bytes <= budget and s.disk_bytes <= disk_budget
            assert len(cache.entries()) <= s.ram_entries + s.disk_entries  # nothing indexed that no tier holds
            cache.check()


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 2000), n_batch=st.integers(8, 600), half=st.integers(1, 11), odd=st.booleans())
def test_chunks_cover_in_order_and_keep_the_segment_rule(n, n_batch, half, odd):
    half = half | 1 if odd else half  # odd ubatches: min_segment twice an odd number
    m = 2 * half
    if n_batch < 2 * m - 1:
        return
    chunks = chunk_sizes(n, n_batch, m, odd)
    assert [s for s, _ in chunks] == [0] + [s + k for s, k in chunks[:-1]]
    assert sum(k for _, k in chunks) == n and all(0 < k <= n_batch for _, k in chunks)
    if n < m:
        assert chunks == [(0, n)]
    elif odd:
        assert all(k % 2 == 1 and k >= half for _, k in chunks)
    else:
        assert all(k >= m for _, k in chunks)
