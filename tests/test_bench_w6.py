"""W6's plan and summary (bench/w6.py) without servers: W5's Claude Code session with longer tool results, and
the flatness fit that tells a TTFT driven by the new tokens from one driven by the session's length."""

from __future__ import annotations

import random

from bench import w5, w6


def tokenize(text: str) -> list[int]:  # about a token a word: sizes only steer the tool results' lengths
    return text.split()


def test_the_session_is_w5s_claude_code_session_with_results_of_200_to_5000_tokens():
    bodies = w6.bodies(tokenize, 12, 8, 200, 5000)
    assert bodies[0]["messages"] == w5.load_capture(w5.CLAUDE)["messages"]
    for before, after in zip(bodies, bodies[1:]):
        assert after["messages"][:len(before["messages"])] == before["messages"]
        assert len(after["messages"]) == len(before["messages"]) + 2
        result = after["messages"][-1]["content"][0]
        assert result["type"] == "tool_result" and 200 <= len(tokenize(result["content"])) <= 5000
    assert all(b["max_tokens"] == 8 and b["stream"] for b in bodies)
    lengths = [w6.result_tokens(random.Random(i)) for i in range(2000)]
    assert min(lengths) >= 200 and max(lengths) <= 5000 and 800 < sorted(lengths)[1000] < 1250  # log-uniform


def test_flatness_separates_new_tokens_from_the_sessions_length():
    def rows(ttft):
        out = [{"ok": True, "cached_tokens": 0, "new_tokens": 12000, "prompt_tokens": 12000, "ttft_s": 60.0}]
        total = 12000
        for i in range(30):
            new = 300 + 137 * (i % 7) ** 2
            total += new
            out.append({"ok": True, "cached_tokens": total - new, "new_tokens": new, "prompt_tokens": total,
                        "ttft_s": ttft(new, total)})
        return out

    # a new token's prefill grows with the context it attends to; the session's length costs nothing by itself
    flat = w6.flatness(rows(lambda new, total: 0.2 + 0.005 * new + 4e-7 * new * (total - new)))
    assert abs(flat["b_s_per_1k_new"] - 5.0) < 1e-6 and abs(flat["q_s_per_1k_new_per_1k_context"] - 0.4) < 1e-6
    assert abs(flat["r_s_per_1k_context"]) < 1e-6 and abs(flat["r_share_of_last_ttft"]) < 1e-6 and flat["r2"] > 0.999
    grows = w6.flatness(rows(lambda new, total: 0.2 + 0.005 * new + 4e-7 * new * (total - new) + 1e-4 * total))
    assert abs(grows["r_s_per_1k_context"] - 0.1) < 1e-6 and grows["r_share_of_last_ttft"] > 0.2


def test_the_ram_budget_is_a_quarter_of_what_the_session_is_expected_to_store():
    est = w6.stored_estimate(65536, 40, 19 << 20, 12 << 10)
    assert est == (128 + 80) * (19 << 20) + 65536 * (12 << 10)
