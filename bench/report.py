"""Pure analysis of benchmark records: the oracle, implied cached tokens, correctness, tables and plots.

A record is a dict per (system, request) written by bench/run.py; the fields used here are
    workload, round, label, index (order in its round), system, cold_group, cold (bool), prompt_key (prompt
    identity: a cold run of the same prompt at a larger max_tokens is its reference), max_tokens,
    prompt_tokens (ours, from orchestrator's renderer), prompt_tokens_reported, cached_reported, oracle,
    ttft_s, total_s, output, ok, rss_peak_bytes.
Times are seconds, sizes tokens, memory bytes.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Iterable, Sequence

BASELINE = "orchestrator"


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists, in tokens."""
    return len(os.path.commonprefix([list(a), list(b)]))


def oracle(prompts: Sequence[Sequence[int]]) -> list[int]:
    """For each prompt, the longest prefix (tokens) it shares with any earlier prompt of the sequence."""
    out = []
    for i, p in enumerate(prompts):
        out.append(max((lcp(p, prompts[j]) for j in range(i)), default=0))
    return out


def fit_prefill(points: Iterable[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares TTFT = a + b * prompt_tokens over cold runs; returns (a seconds, b seconds per token).

    None unless the sizes span at least 1.5x (a narrower range cannot separate a from b). b is clamped > 0;
    a negative intercept is replaced by a fit through the origin.
    """
    pts = list(points)
    xs = [x for x, _ in pts]
    if len(set(xs)) < 2 or max(xs) < 1.5 * min(xs):
        return None
    n = len(pts)
    mx = sum(xs) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    b = max(sxy / sxx, 1e-6)
    a = my - b * mx
    if a < 0:  # noise tilted the line: fit through the origin instead (no negative fixed cost)
        a, b = 0.0, max(sum(x * y for x, y in pts) / sum(x * x for x in xs), 1e-6)
    return a, b


def implied_cached(prompt_tokens: int, ttft_s: float, fit: tuple[float, float] | None) -> int | None:
    """Tokens the system did not prefill, as its TTFT implies under the cold fit (clamped to [0, prompt])."""
    if fit is None:
        return None
    a, b = fit
    prefilled = (ttft_s - a) / b
    return int(round(min(max(prompt_tokens - prefilled, 0), prompt_tokens)))


def same_output(warm: dict, cold: dict) -> bool:
    """Warm output equals the cold reference; a shorter budget must be a prefix of the cold output."""
    if warm["max_tokens"] == cold["max_tokens"]:
        return warm["output"] == cold["output"]
    return cold["output"].startswith(warm["output"])


def annotate(records: list[dict]) -> dict[str, tuple[float, float] | None]:
    """Fill cached_implied, cold_ttft_s, cold_match on warm records in place; returns the fit per cold group."""
    fits: dict[str, tuple[float, float] | None] = {}
    by_group: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["cold"] and r["ok"]:
            by_group[r["cold_group"]].append(r)
    for g, rs in by_group.items():
        fits[g] = fit_prefill((r["prompt_tokens"], r["ttft_s"]) for r in rs)
    cold_of = {(r["cold_group"], r["prompt_key"]): r for rs in by_group.values() for r in rs}
    for r in records:
        if r["cold"]:
            continue
        fit = fits.get(r["cold_group"])
        r["cached_implied"] = implied_cached(r["prompt_tokens"], r["ttft_s"], fit) if r["ok"] else None
        c = cold_of.get((r["cold_group"], r["prompt_key"]))
        r["cold_ttft_s"] = c["ttft_s"] if c else None
        r["cold_match"] = (same_output(r, c) if (c and r["ok"]) else None)
    return fits


def cached_best(r: dict) -> int | None:
    """Cached tokens as reported, else as implied by the prefill time."""
    return r["cached_reported"] if r.get("cached_reported") is not None else r.get("cached_implied")


def summarize(records: list[dict], systems: Sequence[str]) -> list[dict]:
    """Per workload and system: sums, cached/oracle, correctness, peak RSS, Σ TTFT ratio to orchestrator's."""
    rows = []
    warm = [r for r in records if not r["cold"]]
    for wl in sorted({r["workload"] for r in warm}):
        base = None
        per = []
        for s in systems:
            rs = [r for r in warm if r["workload"] == wl and r["system"] == s]
            if not rs:
                continue
            ok = [r for r in rs if r["ok"]]
            rep = [r["cached_reported"] for r in ok if r.get("cached_reported") is not None]
            imp = [r["cached_implied"] for r in ok if r.get("cached_implied") is not None]
            best = [cached_best(r) for r in ok if cached_best(r) is not None]
            oracle_sum = sum(r["oracle"] for r in ok)
            compared = [r for r in ok if r.get("cold_match") is not None]
            row = {
                "workload": wl, "system": s, "requests": len(rs), "failed": len(rs) - len(ok),
                "ttft_sum_s": sum(r["ttft_s"] for r in ok), "total_sum_s": sum(r["total_s"] for r in ok),
                "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
                "cached_reported": sum(rep) if len(rep) == len(ok) and ok else None,
                "cached_implied": sum(imp) if len(imp) == len(ok) and ok else None,
                "oracle": oracle_sum,
                "cached_over_oracle": (sum(best) / oracle_sum) if oracle_sum and len(best) == len(ok) else None,
                "peak_rss_bytes": max((r.get("rss_peak_bytes") or 0) for r in rs),
                "compared": len(compared), "mismatches": sum(1 for r in compared if not r["cold_match"]),
                "prompt_token_mismatches": sum(1 for r in ok if r.get("prompt_tokens_reported") is not None
                                               and r["prompt_tokens_reported"] != r["prompt_tokens"]),
            }
            if s == BASELINE:
                base = row
            per.append(row)
        for row in per:
            row["ttft_ratio_to_orchestrator"] = (row["ttft_sum_s"] / base["ttft_sum_s"]
                                                 if base and base["ttft_sum_s"] else None)
        rows += per
    return rows


def w1_speedups(records: list[dict], systems: Sequence[str]) -> list[dict]:
    """W1 per round and label: TTFT per system and its speedup over the same system's cold run of the prompt."""
    out = []
    warm = [r for r in records if not r["cold"] and r["workload"] == "W1"]
    keys = []
    for r in warm:
        k = (r["round"], r["index"], r["label"])
        if k not in keys:
            keys.append(k)
    for rnd, idx, label in keys:
        row = {"round": rnd, "label": label}
        for s in systems:
            r = next((x for x in warm if x["round"] == rnd and x["index"] == idx and x["system"] == s), None)
            if r is None:
                continue
            row[s] = {"ok": r["ok"], "ttft_s": r["ttft_s"], "cold_ttft_s": r.get("cold_ttft_s"), "oracle": r["oracle"],
                      "prompt_tokens": r["prompt_tokens"], "cached": cached_best(r),
                      "speedup_vs_cold": (r["cold_ttft_s"] / r["ttft_s"]) if r.get("cold_ttft_s") and r["ttft_s"]
                      else None, "cold_match": r.get("cold_match")}
        out.append(row)
    return out


def cold_requests(records: list[dict], systems: Sequence[str], peer: str = "llama-server") -> list[dict]:
    """The requests nothing could be reused for (oracle 0: they share no token with any earlier request of their
    round), as served in the warm rounds (snapshots included): TTFT per system, its ratio to `peer`'s, and the
    share of orchestrator's TTFT spent saving snapshots (its server timings' snapshot_ms)."""
    out = []
    groups: dict[tuple, dict[str, dict]] = {}  # (round, index) -> system -> record, in the order first seen
    for r in records:
        if not r["cold"] and r["ok"] and r["oracle"] == 0:
            groups.setdefault((r["round"], r["index"]), {})[r["system"]] = r
    for (rnd, _), rs in groups.items():
        base = rs.get(peer)
        first = next(iter(rs.values()))
        row = {"workload": first["workload"], "round": rnd, "label": first["label"],
               "prompt_tokens": first["prompt_tokens"], "ttft_s": {}, "ratio_to_peer": {}, "snapshot_share": None}
        for s in systems:
            if s in rs:
                row["ttft_s"][s] = rs[s]["ttft_s"]
                row["ratio_to_peer"][s] = rs[s]["ttft_s"] / base["ttft_s"] if base and base["ttft_s"] else None
        timings = (rs.get(BASELINE) or {}).get("server_timings") or {}
        if timings.get("snapshot_ms") is not None and timings.get("ttft_ms"):
            row["snapshot_share"] = timings["snapshot_ms"] / timings["ttft_ms"]
        out.append(row)
    return out


def _f(v, fmt="{:.2f}", none="—") -> str:
    return none if v is None else fmt.format(v)


def markdown(summary: list[dict], w1: list[dict], records: list[dict], systems: Sequence[str], meta: dict) -> str:
    """The results as markdown: summary per workload, W1 detail, per-request table."""
    lines = [f"# Side-by-side benchmark ({meta.get('date', '')})", "",
             f"Command: `{meta.get('command', '')}`  ", f"Scale: {meta.get('scale_name')} — {meta.get('scale')}  ",
             f"Model: {meta.get('model')}; threads {meta.get('threads')}; context {meta.get('ctx_size')} tokens; "
             f"greedy, seed 1234; wall time {_f(meta.get('wall_s'), '{:.0f}')} s", "",
             "## Per workload", "",
             "Σ TTFT is the time to first token summed over the workload's requests (restore + prefill + first "
             "token): the prefill time of the issue. Cached tokens: as the system reports them, and as its TTFT "
             "implies from a linear fit of its cold runs. cached/oracle uses the reported figure when there is "
             "one. **≠ cold** counts requests whose output differs from the same system's cold run: a correctness "
             "failure, not a speed result.", "",
             "| workload | system | req | Σ TTFT s | Σ total s | prompt tok | cached (reported) | cached (implied) "
             "| oracle | cached/oracle | peak RSS MiB | ≠ cold (compared) | Σ TTFT ÷ orchestrator |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        flag = f"**{r['mismatches']}** ({r['compared']})" if r["mismatches"] else f"0 ({r['compared']})"
        fail = f" ({r['failed']} failed)" if r["failed"] else ""
        lines.append(
            f"| {r['workload']} | {r['system']}{fail} | {r['requests']} | {_f(r['ttft_sum_s'])} | "
            f"{_f(r['total_sum_s'])} | {r['prompt_tokens']:,} | {_f(r['cached_reported'], '{:,}')} | "
            f"{_f(r['cached_implied'], '{:,}')} | {r['oracle']:,} | {_f(r['cached_over_oracle'], '{:.0%}')} | "
            f"{r['peak_rss_bytes'] / 2**20:,.0f} | {flag} | {_f(r['ttft_ratio_to_orchestrator'], '{:.2f}×')} |")
    fits = meta.get("cold_fits") or {}
    if fits:
        lines += ["", "Cold prefill (linear fit of each system's cold runs, TTFT = a + n / rate): " + "; ".join(
            f"{g}: {f['tokens_per_s']:.0f} tokens/s, a = {f['a_s']:.2f} s" if f else f"{g}: —"
            for g, f in fits.items()) + "."]
    lines += ["", "## W1: TTFT per request and speedup over the same system's cold run", "",
              "| round | request | oracle | " + " | ".join(systems) + " |",
              "|---|---|---|" + "---|" * len(systems)]
    for row in w1:
        cells = []
        oracle_v = None
        for s in systems:
            c = row.get(s)
            if not c:
                cells.append("—")
                continue
            oracle_v = c["oracle"]
            if not c["ok"]:
                cells.append("failed")
                continue
            bad = " ✗" if c["cold_match"] is False else ""
            cells.append(f"{c['ttft_s']:.3f} s ({_f(c['speedup_vs_cold'], '{:.1f}×')}, {_f(c['cached'], '{}')} "
                         f"cached){bad}")
        lines.append(f"| {row['round']} | {row['label']} | {_f(oracle_v, '{}')} | " + " | ".join(cells) + " |")
    colds = cold_requests(records, systems)
    if colds:
        lines += ["", "## Cold requests", "",
                  "Requests that share no token with any earlier request of their round, so every system prefills "
                  "them whole, as served in the warm rounds (orchestrator's snapshot saves included): TTFT s and "
                  "÷ llama-server's; snapshot: the share of orchestrator's TTFT spent saving snapshots (its "
                  "`timings.snapshot_ms`).", "",
                  "| workload | round | request | prompt tok | " + " | ".join(systems) + " | snapshot |",
                  "|---|---|---|---|" + "---|" * len(systems) + "---|"]
        for row in colds:
            cells = [f"{row['ttft_s'][s]:.2f} ({_f(row['ratio_to_peer'].get(s), '{:.2f}×')})" if s in row["ttft_s"]
                     else "—" for s in systems]
            lines.append(f"| {row['workload']} | {row['round']} | {row['label']} | {row['prompt_tokens']} | "
                         + " | ".join(cells) + f" | {_f(row['snapshot_share'], '{:.1%}')} |")
    lines += ["", "## Every request", "",
              "TTFT s / cached tokens (reported, else implied `~`) per system; ✗ = output differs from cold.", "",
              "| workload | round | request | prompt tok | oracle | " + " | ".join(systems) + " |",
              "|---|---|---|---|---|" + "---|" * len(systems)]
    warm = [r for r in records if not r["cold"]]
    seen = []
    for r in warm:
        k = (r["round"], r["index"])
        if k in seen:
            continue
        seen.append(k)
        cells = []
        for s in systems:
            x = next((y for y in warm if (y["round"], y["index"]) == k and y["system"] == s), None)
            if x is None:
                cells.append("—")
            elif not x["ok"]:
                cells.append("failed")
            else:
                c = x["cached_reported"] if x.get("cached_reported") is not None else x.get("cached_implied")
                tilde = "~" if x.get("cached_reported") is None else ""
                bad = " ✗" if x.get("cold_match") is False else ""
                cells.append(f"{x['ttft_s']:.2f} / {tilde}{_f(c, '{}')}{bad}")
        lines.append(f"| {r['workload']} | {r['round']} | {r['label']} | {r['prompt_tokens']} | {r['oracle']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plots(records: list[dict], systems: Sequence[str], out_dir) -> list[str]:
    """ttft_<W>.png (TTFT per request, log scale, cold runs dashed) and cached_<W>.png (cached vs oracle)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[str] = []

    def rounds(ax, order) -> None:
        """Vertical lines between rounds, with the round's name at the top."""
        for i, (rnd, _) in enumerate(order):
            if i == 0 or order[i - 1][0] != rnd:
                if i:
                    ax.axvline(i - 0.5, color="0.6", lw=0.6, ls=":")
                ax.text(i - 0.4, 1.0, rnd, transform=ax.get_xaxis_transform(), fontsize=6, va="bottom")

    def finish(fig, ax, order, labels, title: str, name: str) -> None:
        """Label the requests on the x axis, title, legend; write `name` into out_dir and list it in `files`."""
        ax.set_xticks(range(len(order)))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set_title(title, pad=14)
        rounds(ax, order)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        files.append(name)

    warm = [r for r in records if not r["cold"]]
    for wl in sorted({r["workload"] for r in warm}):
        rs = [r for r in warm if r["workload"] == wl]
        order = []
        for r in rs:
            k = (r["round"], r["index"])
            if k not in order:
                order.append(k)
        pos = {k: i for i, k in enumerate(order)}
        labels = [next(r["label"] for r in rs if (r["round"], r["index"]) == k) for k in order]
        fig, ax = plt.subplots(figsize=(max(8, len(order) * 0.28), 4.5))
        for s in systems:
            pts = sorted((pos[(r["round"], r["index"])], r["ttft_s"], r.get("cold_ttft_s")) for r in rs
                         if r["system"] == s and r["ok"])
            if not pts:
                continue
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1, label=s)
            cold = [(p[0], p[2]) for p in pts if p[2] is not None]
            if cold:
                ax.plot([c[0] for c in cold], [c[1] for c in cold], ls="none", marker="_", ms=8,
                        color=line.get_color(), alpha=0.6)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT, s (log); dashes: same system cold")
        finish(fig, ax, order, labels, f"{wl}: time to first token per request", f"ttft_{wl}.png")

        fig, ax = plt.subplots(figsize=(max(8, len(order) * 0.28), 4.5))
        orc = [next(r["oracle"] for r in rs if (r["round"], r["index"]) == k) for k in order]
        ax.bar(range(len(order)), orc, color="0.85", label="oracle (longest shared prefix)")
        for s in systems:
            pts = sorted((pos[(r["round"], r["index"])], cached_best(r), r.get("cached_reported") is None)
                         for r in rs if r["system"] == s and r["ok"] and cached_best(r) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=0.8,
                        label=s + (" (implied from TTFT)" if pts[0][2] else ""))
        ax.set_ylabel("cached tokens")
        finish(fig, ax, order, labels, f"{wl}: cached tokens against the oracle", f"cached_{wl}.png")
    return files
