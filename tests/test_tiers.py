"""Tiered snapshot store on the tiny model: decoupled checkpoints, byte-bounded RAM, disk spill, restarts.

Every request is also run cold (cache off) and must give the same greedy tokens and first-step logits.
"""

import random
import shutil


from orchestrator.cache.radix import CHECKPOINT, KV, LOGITS
from orchestrator.reuse import spaced_stops

from .conftest import assert_same_as_cold, run_chat

MiB = 1 << 20
WORDS = ("cache state token prefix layer model server request snapshot budget disk memory restore branch "
         "radix boundary template message system tool schema agent result function value").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def conversation(n_messages: int, words: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"[{i}] " + text(rng, words)}
            for i in range(n_messages)]


def test_edit_message_9_hits_through_message_8_and_after_20_turns_still_hits_from_disk(start, tmp_path):
    # Every message end a snapshot (snapshot_min_gap 0): the hits below are exactly at message ends.
    rt = start(cache_ram_mib=24, cache_disk_dir=tmp_path / "snap", cache_disk_mib=1024, checkpoint_interval=512,
               snapshot_min_gap=0)
    msgs = conversation(12, 1000)  # about 1,000 tokens a message
    first = assert_same_as_cold(rt, msgs, max_tokens=4)
    assert len(first.tokens) > 11_000
    edited = [dict(m) for m in msgs[:9]]
    edited[8]["content"] = "[8] this fifth user message was edited " + edited[8]["content"]
    hit = assert_same_as_cold(rt, edited, max_tokens=4)
    assert hit.result.cached_tokens == hit.boundaries.message_ends[7]
    rng = random.Random(5)
    for turn in range(20):
        msgs = msgs + [{"role": "user", "content": text(rng, 20)}]
        # Every fifth turn is also compared with a cold run (a cold 12k-token prefill is the slow part).
        t = assert_same_as_cold(rt, msgs, max_tokens=4) if turn % 5 == 4 else run_chat(rt, msgs, max_tokens=4)
        # The last assistant turn loses its <think> block once a newer user message exists: the prompt
        # diverges there, so the hit reaches the end of the user message before it.
        assert t.result.cached_tokens == t.boundaries.message_ends[-3]
        msgs = msgs + [{"role": "assistant", "content": text(rng, 20)}]
        rt.cache.check()
    stats = rt.cache.stats()
    assert stats.spills > 0 and stats.ram_bytes <= 24 * MiB
    edited[8]["content"] = "[8] edited once more " + msgs[8]["content"]
    again = assert_same_as_cold(rt, edited, max_tokens=4)
    assert again.result.cached_tokens == again.boundaries.message_ends[7]
    assert again.result.restore_source == "disk"


def test_two_conversations_alternate_under_a_six_snapshot_budget_and_keep_the_shared_prefix(start):
    probe = start(cache_ram_mib=256)
    system = {"role": "system", "content": text(random.Random(1), 1500)}
    first = assert_same_as_cold(probe, [system, {"role": "user", "content": "hello"}], max_tokens=2)
    n = len(first.tokens)
    snapshot = len(probe.engine.save_state(0))  # whole state after the ~1,500-token prefix
    logits = 4 * probe.engine.n_vocab  # the prompt end's logits, stored with every request
    probe.close()
    rt = start(cache_ram_mib=max(1, 6 * (snapshot + logits) // MiB), snapshot_min_gap=0)  # a stop at every message end
    convs = {"a": [system], "b": [system]}
    rng = random.Random(2)
    shared_end = None
    for turn in range(4):
        for name in ("a", "b"):
            msgs = convs[name]
            if turn:
                msgs.append({"role": "assistant", "content": text(rng, 30)})
            msgs.append({"role": "user", "content": f"{name} {turn} " + text(rng, 40)})
            t = assert_same_as_cold(rt, msgs, max_tokens=4)
            shared_end = t.boundaries.system_end
            if turn:
                assert t.result.cached_tokens == t.boundaries.message_ends[-3]
            elif name == "b":
                assert t.result.cached_tokens == shared_end
            assert (CHECKPOINT, "ram", tuple(t.tokens[:shared_end])) in rt.cache.entries()
            rt.cache.check()
    assert n > 1500 and rt.cache.stats().evictions > 0


def test_spilled_conversation_survives_a_restart(start, tmp_path):
    kw = dict(cache_ram_mib=4, cache_disk_dir=tmp_path / "snap", cache_disk_mib=512)
    rt = start(**kw)
    msgs = conversation(5, 150, seed=3)  # ends with a user message, as a request does
    assert_same_as_cold(rt, msgs, max_tokens=4)
    turn = msgs + [{"role": "assistant", "content": "short answer"}, {"role": "user", "content": "and then?"}]
    from_ram = assert_same_as_cold(rt, turn, max_tokens=4)
    assert from_ram.result.cached_tokens > 0
    # Two other conversations push this one's newest entries (its KV among them) out of the 4 MiB RAM tier.
    for seed in (4, 5):
        run_chat(rt, conversation(5, 150, seed=seed), max_tokens=4)
    assert rt.cache.stats().spills > 0
    rt.close()
    rt2 = start(**kw)
    assert rt2.cache.stats().disk_entries > 0
    from_disk = assert_same_as_cold(rt2, turn, max_tokens=4)
    # The same prompt again: restored whole from its prompt end (checkpoint and logits) on disk.
    assert from_disk.result.cached_tokens == len(from_disk.tokens) > from_ram.result.cached_tokens
    assert from_disk.result.restore_source == "disk"
    # An edited earlier assistant message hits through the message before it.
    edited = [dict(m) for m in turn]
    edited[3]["content"] = "an edited assistant reply"
    e = assert_same_as_cold(rt2, edited, max_tokens=4)
    assert e.result.cached_tokens == e.boundaries.message_ends[2]
    rt2.cache.check()


def test_snapshots_from_another_ctx_size_or_model_are_rejected(start, tmp_path, tiny_model):
    disk = tmp_path / "snap"
    rt = start(cache_ram_mib=2, cache_disk_dir=disk, cache_disk_mib=512)
    msgs = conversation(4, 200, seed=4)
    assert_same_as_cold(rt, msgs, max_tokens=4)
    assert_same_as_cold(rt, conversation(4, 200, seed=5), max_tokens=4)  # pushes the first one to disk
    assert rt.cache.stats().disk_entries > 0
    rt.close()
    other_ctx = start(cache_ram_mib=2, cache_disk_dir=disk, cache_disk_mib=512, ctx_size=8192)
    assert other_ctx.cache.stats().disk_entries == 0  # rejected at start (fingerprint), and deleted
    assert assert_same_as_cold(other_ctx, msgs, max_tokens=4).result.cached_tokens == 0
    other_ctx.close()
    # The same snapshots under another model file (same shapes, one weight byte changed) are rejected too.
    rt = start(cache_ram_mib=2, cache_disk_dir=disk, cache_disk_mib=512)
    assert_same_as_cold(rt, msgs, max_tokens=4)
    assert_same_as_cold(rt, conversation(4, 200, seed=6), max_tokens=4)
    assert rt.cache.stats().disk_entries > 0
    rt.close()
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_model, other)
    with open(other, "r+b") as f:
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([b[0] ^ 1]))
    other_model = start(model=other, cache_ram_mib=2, cache_disk_dir=disk, cache_disk_mib=512)
    assert other_model.cache.stats().disk_entries == 0


def test_interval_checkpoints_serve_a_divergence_inside_a_long_message(start):
    rt = start(cache_ram_mib=512, checkpoint_interval=256)
    doc = text(random.Random(9), 1500)  # a long tool output or document
    a = [{"role": "user", "content": "Summarise: " + doc + " END-A"}]
    assert_same_as_cold(rt, a, max_tokens=2)
    words = doc.split()
    b = [{"role": "user", "content": "Summarise: " + " ".join(words[:1000]) + " CHANGED " + " ".join(words[1000:])}]
    hit = assert_same_as_cold(rt, b, max_tokens=2)
    shared = next(i for i, (x, y) in enumerate(zip(hit.tokens, rt.prompts.chat(a, None, {}).tokens)) if x != y)
    assert shared > 1000 and hit.result.cached_tokens == (shared // 256) * 256
    kinds = {k for k, _tier, _t in rt.cache.entries()}
    assert kinds == {CHECKPOINT, KV, LOGITS}


def test_short_messages_do_not_each_stop_the_prefill_and_the_next_turn_still_hits_by_the_rewrite_point(start):
    rt = start()  # the default snapshot_min_gap (256 tokens)
    msgs = conversation(7, 12)  # seven ~20-token messages, the last a user message
    first = assert_same_as_cold(rt, msgs, max_tokens=4)
    n = len(first.tokens)
    ends = [e for e in first.boundaries.message_ends if e and e < n]
    stops = spaced_stops(first.boundaries, n, rt.config.snapshot_min_gap)
    # two stops for the whole run of short messages: the last message end and the one before it (where the
    # latest message starts, kept whatever the gap: Boundaries.split)
    assert len(ends) >= 3 and stops == ends[-2:]
    # The next turn: Qwen3.5's template drops the answer's <think> block once a newer user message exists, so
    # the prompt diverges at the end of the last user message. That end was no stop of its own turn's prefill
    # (the repeat point, min_segment earlier, stood in for it), nor of this one: the hit is within min_segment.
    msgs = msgs + [{"role": "assistant", "content": "[7] " + text(random.Random(7), 12)},
                   {"role": "user", "content": "[8] " + text(random.Random(8), 12)}]
    t = assert_same_as_cold(rt, msgs, max_tokens=4)
    rewrite = t.boundaries.message_ends[-3]
    assert rewrite - rt.engine.min_segment <= t.result.cached_tokens <= rewrite
