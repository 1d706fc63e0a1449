"""bench/trace.py on a 60-request excerpt of Mooncake's conversation trace (tests/fixtures/, 12 KB): the
infinite-cache ceiling, and replays through the real scheduler and cache that stay within it and reach it."""

from pathlib import Path

import pytest

from bench.trace import (BLOCK, GiB, SHAPES, ReplayConfig, Scale, TracePrompts, ceiling, load_trace, main,
                         TraceRequest, qwen35_shape, replay)

EXCERPT = Path(__file__).parent / "fixtures" / "mooncake_conversation_excerpt.jsonl"


@pytest.fixture(scope="module")
def requests():
    return load_trace(EXCERPT)


def _brute_ceiling(requests):
    hit = total = 0
    for i, r in enumerate(requests):
        best = 0
        for earlier in requests[:i]:
            k = 0
            while k < min(len(r.hash_ids), len(earlier.hash_ids)) and r.hash_ids[k] == earlier.hash_ids[k]:
                k += 1
            best = max(best, k)
        hit += min(best * BLOCK, r.input_length)
        total += r.input_length
    return hit, total


def test_ceiling_is_the_longest_block_prefix_seen_before(requests):
    assert ceiling(requests) == _brute_ceiling(requests)
    hit, total = ceiling(requests)
    assert total == sum(r.input_length for r in requests) and 0.8 < hit / total < 0.82


def test_shapes_match_the_server_and_the_published_sizes():
    # The 0.8B's as the server logs them (docs/reuse.md: 19.3 MiB checkpoints, 12 KiB of KV per token).
    assert SHAPES["0.8b"].checkpoint_bytes == 20_201_472 and SHAPES["0.8b"].kv_bytes_per_token == 12_288
    assert round(SHAPES["4b"].checkpoint_bytes / 2**20) == 50 and round(SHAPES["27b"].checkpoint_bytes / 2**20) == 150
    assert SHAPES["27b"].kv_bytes_per_token == 64 * 1024
    assert SHAPES["0.8b"].prefill_tps > SHAPES["4b"].prefill_tps > SHAPES["9b"].prefill_tps > SHAPES["27b"].prefill_tps
    # One more layer pattern of 4 adds 3 linear layers' states and one attention layer's KV.
    a, b = qwen35_shape("a", 24, 4, 2, 256, 16, 16, 128, 1024, 3584, 8), qwen35_shape("b", 28, 4, 2, 256, 16, 16, 128,
                                                                                        1024, 3584, 8)
    assert b.checkpoint_bytes - a.checkpoint_bytes == a.checkpoint_bytes // 6
    assert b.kv_bytes_per_token - a.kv_bytes_per_token == a.kv_bytes_per_token // 6


def test_prompts_are_blocks_with_boundaries_where_requests_fork_or_end(requests):
    p = TracePrompts(requests, Scale(16, 4096))
    r = requests[1]
    tokens = p.tokens(r)
    assert len(tokens) == -(-r.input_length // 16) and tokens[:32] == p.block_tokens(r.hash_ids[0])
    assert p.block_tokens(1) != p.block_tokens(2)
    bounds = p.boundaries(r, len(tokens))
    assert all(0 < b < len(tokens) and b % 32 == 0 for b in bounds)
    assert set(TracePrompts(requests, Scale(16, 4096), "block").boundaries(r, len(tokens))) >= set(bounds)


def test_replays_stay_within_the_ceiling_grow_with_the_budget_and_reach_it_unbounded(requests):
    hit, total = ceiling(requests)
    rates = {}
    for ram in (1, 4, 16):
        r = replay(requests, ReplayConfig(shape="0.8b", ram_bytes=ram * GiB, policy="lru"))
        rates[ram] = r["hit_rate"]
        assert r["requests"] == len(requests) and r["input"] == total
        assert r["ram"]["held"] <= ram * GiB and r["disk"] is None
    assert rates[1] <= rates[4] <= rates[16] <= hit / total
    assert rates[16] > rates[1]
    unbounded = replay(requests, ReplayConfig(shape="0.8b", ram_bytes=1024 * GiB, policy="lru"))
    assert unbounded["evictions"] == 0
    # Every request restores its whole seen prefix but the last min_segment (2 × 16 tokens) of a prompt seen whole.
    assert hit - 32 * len(requests) <= unbounded["cached"] <= hit


def test_the_disk_tier_and_the_value_policy_add_hits_and_count_their_bytes(requests):
    base = replay(requests, ReplayConfig(shape="27b", ram_bytes=1 * GiB, policy="lru"))
    disk = replay(requests, ReplayConfig(shape="27b", ram_bytes=1 * GiB, disk_bytes=64 * GiB, policy="lru"))
    assert disk["hit_rate"] > base["hit_rate"]
    assert 0 < disk["disk"]["read"] <= disk["disk"]["written"] and disk["disk"]["held"] <= 64 * GiB
    assert disk["sources"].get("disk", 0) > 0
    value = replay(requests, ReplayConfig(shape="27b", ram_bytes=1 * GiB, policy="value"))
    assert value["hit_rate"] >= base["hit_rate"]


def test_the_command_writes_its_tables(tmp_path, capsys):
    assert main(["--trace", str(EXCERPT), "--limit", "20", "--shapes", "0.8b", "--ram-gib", "2", "--disk-gib", "0",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "infinite-cache ceiling" in out and "| mooncake_conversation_excerpt.jsonl | 0.8b | 2 | 0 | lru |" in out
    assert (tmp_path / "mooncake_conversation_excerpt.json").exists()


def test_the_budget_estimate_grows_to_the_ceiling_and_interval_checkpoints_cost_budget(requests):
    from bench.trace import lru_budget_curve

    with_interval = lru_budget_curve(requests, SHAPES["0.8b"], 512, (1, 4, 16, 1e6))
    without = lru_budget_curve(requests, SHAPES["0.8b"], 0, (1, 4, 16, 1e6))
    assert list(with_interval.values()) == sorted(with_interval.values()) and with_interval[1e6] == 1.0
    assert all(without[b] >= with_interval[b] for b in with_interval) and without[1] > with_interval[1]
    assert lru_budget_curve(requests, SHAPES["27b"], 512, (4,))[4] < with_interval[4]


def test_live_bodies_keep_the_traces_shared_prefixes_as_shared_tokens(requests, tiny_model):
    # bench trace-live turns blocks into words: the same block id must give the same text, and a prefix of
    # blocks two requests share must render (real template and tokenizer) to a shared token prefix, so the
    # slice's token ceiling is the trace's block ceiling (the excerpt's 80-82%) up to template tokens.
    from bench.render import Renderer
    from bench.trace_live import block_words, bodies, slice_ceiling

    assert block_words(7, 20) == block_words(7, 20) and block_words(7, 20) != block_words(8, 20)
    chats = bodies(requests, 32, 8)
    assert len(chats) == len(requests) and all(m["role"] == "user" for c in chats for m in c["messages"])
    assert all(1 <= c["max_tokens"] <= 8 for c in chats)
    renderer = Renderer(tiny_model)
    tokens = [renderer.tokens(c) for c in chats]
    ceilings = slice_ceiling(tokens)
    assert ceilings[0] == 0
    share = sum(ceilings) / sum(map(len, tokens))
    hit, total = ceiling(requests)
    assert abs(share - hit / total) < 0.05, (share, hit / total)
    # A request that repeats an earlier one's first blocks shares at least those blocks' messages.
    a, b = requests[0], requests[1]
    assert a.hash_ids[0] == b.hash_ids[0]
    assert chats[0]["messages"][0] == chats[1]["messages"][0]
    assert ceilings[1] > len(renderer.tokenize(chats[0]["messages"][0]["content"]))


def test_a_request_of_one_message_renders(tiny_model):
    # a request whose blocks make one message (the synthetic trace's first turns): Qwen3.5's template raises
    # "No user query found" for a conversation of a system message alone
    from bench.render import Renderer
    from bench.trace_live import bodies

    one = TraceRequest(0, 700, 10, (1, 2))
    chats = bodies([one], 32, 8)
    assert len(chats[0]["messages"]) == 1 and Renderer(tiny_model).tokens(chats[0])
