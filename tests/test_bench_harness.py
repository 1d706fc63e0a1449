"""The side-by-side benchmark's pure functions: oracle, prefill fit, correctness check, summary table.

No servers, no model, no timing assertions (figures depend on the machine).
"""

import re
from pathlib import Path

import pytest

from bench import report
from bench.systems import LLAMA_SERVER, SYSTEMS, llama_server_binary, variants


def test_oracle_is_longest_prefix_shared_with_any_earlier_prompt():
    prompts = [[1, 2, 3, 4], [1, 2, 9], [7, 7], [1, 2, 3, 4, 5], [7, 7]]
    assert report.oracle(prompts) == [0, 2, 0, 4, 2]


def test_implied_cached_from_a_cold_fit():
    fit = report.fit_prefill([(1000, 4.1), (2000, 8.1), (3000, 12.1)])
    a, b = fit
    assert abs(b - 0.004) < 1e-9 and abs(a - 0.1) < 1e-9
    assert report.implied_cached(2000, 0.1 + 0.004 * 100, fit) == 1900
    assert report.implied_cached(2000, 50.0, fit) == 0          # slower than cold: nothing cached
    assert report.implied_cached(2000, 0.0, fit) == 2000        # clamped to the prompt
    assert report.fit_prefill([(1000, 1.0), (1000, 2.0)]) is None
    assert report.fit_prefill([(1000, 1.0), (1100, 2.0)]) is None   # too narrow a range to fit


def _rec(system, cold, key, out, ttft, prompt=100, oracle=0, cached=None, mt=8, label="A", index=0):
    return {"workload": "W1", "round": "W1 r", "label": label, "index": index, "system": system,
            "cold_group": system, "cold": cold, "key": key, "prompt_key": key, "max_tokens": mt, "prompt_tokens": prompt,
            "prompt_tokens_reported": prompt, "cached_reported": cached, "oracle": oracle, "ttft_s": ttft,
            "total_s": ttft + 1, "output": out, "ok": True, "rss_peak_bytes": 2**20}


def test_annotate_summary_and_markdown_flag_a_mismatch():
    recs = [
        _rec("orchestrator", False, "k1", "abc", 1.0, prompt=100, cached=0),
        _rec("orchestrator", False, "k2", "xyz", 0.1, prompt=200, oracle=100, cached=98, label="B", index=1),
        _rec("orchestrator", True, "k1", "abc", 1.0, prompt=100),
        _rec("orchestrator", True, "k2", "xyQ", 2.0, prompt=200),
        _rec("peer", False, "k1", "abc", 1.0, prompt=100),
        _rec("peer", False, "k2", "a", 2.0, prompt=200, oracle=100, mt=1, label="B", index=1),
        _rec("peer", True, "k1", "abc", 1.0, prompt=100),
        _rec("peer", True, "k2", "abc", 2.0, prompt=200),
    ]
    report.annotate(recs)
    assert recs[1]["cold_match"] is False                  # same budget, different text
    assert recs[5]["cold_match"] is True                   # shorter budget: a prefix of the cold output
    assert recs[5]["cached_implied"] == 0
    rows = {r["system"]: r for r in report.summarize(recs, ["orchestrator", "peer"])}
    assert rows["orchestrator"]["mismatches"] == 1 and rows["orchestrator"]["compared"] == 2
    assert rows["orchestrator"]["cached_over_oracle"] == 0.98
    assert abs(rows["peer"]["ttft_ratio_to_orchestrator"] - 3.0 / 1.1) < 1e-9
    md = report.markdown(report.summarize(recs, ["orchestrator", "peer"]),
                         report.w1_speedups(recs, ["orchestrator", "peer"]), recs, ["orchestrator", "peer"], {})
    assert "**1** (2)" in md and "✗" in md


def test_cold_requests_are_those_nothing_could_be_reused_for_with_ratios_and_the_snapshot_share():
    recs = [_rec("orchestrator", False, "k1", "a", 2.0, prompt=500), _rec("llama-server", False, "k1", "a", 1.6,
                                                                         prompt=500),
            _rec("orchestrator", False, "k2", "b", 0.2, oracle=400, label="B", index=1),
            _rec("llama-server", False, "k2", "b", 0.3, oracle=400, label="B", index=1),
            _rec("orchestrator", True, "k1", "a", 1.9, prompt=500)]
    recs[0]["server_timings"] = {"snapshot_ms": 20.0, "ttft_ms": 2000.0}
    rows = report.cold_requests(recs, ["orchestrator", "llama-server"])
    assert [(r["label"], r["prompt_tokens"]) for r in rows] == [("A", 500)]  # B shares a prefix; cold runs aside
    assert rows[0]["ratio_to_peer"] == {"orchestrator": 2.0 / 1.6, "llama-server": 1.0}
    assert rows[0]["snapshot_share"] == 0.01
    report.annotate(recs)
    md = report.markdown(report.summarize(recs, ["orchestrator", "llama-server"]), [], recs,
                         ["orchestrator", "llama-server"], {})
    assert "## Cold requests" in md and "| 2.00 (1.25×) | 1.60 (1.00×) | 1.0% |" in md


def test_soak_slope_error_and_window_medians():
    from bench import soak

    rows = [{"t_s": 60.0 * m, "rss_mib": 400 + 0.5 * m + (3 if m % 2 else -3)} for m in range(20)]
    slope, err = soak.slope_with_error(rows)
    assert abs(slope - 0.5) < 0.05 and 0 < err < 0.5  # noise of ±3 MiB around 0.5 MiB/min
    flat = [{"t_s": 60.0 * m, "rss_mib": 400.0} for m in range(5)]
    assert soak.slope_with_error(flat) == (0.0, 0.0)
    assert soak.slope_with_error(flat[:2]) == (0.0, 0.0)  # too few samples to fit with an error
    assert soak.window_medians(rows, 0, 300) == [[0.0, 399.0], [5.0, 405.5], [10.0, 404.0], [15.0, 410.5]]


def test_the_bench_names_what_it_misses_before_it_starts(monkeypatch):
    import importlib.util

    from bench import run
    from bench.systems import SYSTEMS

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in ("matplotlib", "fastapi") else real(name))
    systems = [SYSTEMS["orchestrator"]]
    assert run.missing_dependencies(systems) == ["matplotlib"]
    assert "fastapi" in run.missing_dependencies(systems + [s for s in SYSTEMS.values() if s.kind == "llama-cpp-python"])


def test_variants_are_their_base_system_with_more_flags():
    gap, chunk = variants(["gap=--snapshot-min-gap 0", "c=--prefill-chunk-alone 128"], SYSTEMS["orchestrator"])
    assert (gap.name, gap.kind, gap.extra) == ("orchestrator-gap", "orchestrator", ("--snapshot-min-gap", "0"))
    assert chunk.extra == ("--prefill-chunk-alone", "128")
    (mod,) = variants(["ngram-mod=--spec-type ngram-mod"], SYSTEMS["llama-server"])
    assert (mod.name, mod.kind) == ("llama-server-ngram-mod", "llama-server")
    assert mod.flags("W4") == ("--spec-type", "ngram-mod", "-np", "3")  # llama-server's W4 slots kept
    for bad in ("nogap", "=--x", "name= "):
        with pytest.raises(ValueError):
            variants([bad], SYSTEMS["orchestrator"])


@pytest.mark.parametrize("name", ["side-by-side", "cold", "w5", "slots", "memory", "prefix", "cluster", "soak"])
def test_every_bench_subcommand_parses_its_help(name, capsys):
    from bench.__main__ import COMMANDS, main

    assert name in COMMANDS
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    usage = capsys.readouterr().out.splitlines()[0]
    assert e.value.code == 0 and usage.startswith("usage: python -m bench ") and name in usage


def test_bench_without_a_subcommand_is_the_side_by_side_one_and_lists_the_others(capsys):
    from bench.__main__ import COMMANDS, main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m bench [side-by-side]")
    assert main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(COMMANDS)
    assert main(["sok"]) == 2 and "no subcommand 'sok'" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def test_every_results_path_the_docs_cite_exists():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.rglob("README.md"))]
    cited = {(doc.relative_to(ROOT), m.group(0)) for doc in docs
             for m in re.finditer(r"bench/results/[\w./-]*\w", doc.read_text())}
    assert len(cited) > 20
    assert [(doc, path) for doc, path in sorted(cited) if not (ROOT / path).exists()] == []


def test_every_results_folder_has_a_readme_and_a_row_in_the_index():
    """A run's folder (<date>/ or <date>/<run>/) has its own README; a folder inside a run (one variant of it, its
    logs) may be described by the run's README instead, by name. Folders git ignores (llama-server's `logs/`,
    .gitignore) are not part of the results: a fresh clone has none."""
    index = (RESULTS / "README.md").read_text()
    for folder in sorted({p.parent for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md"}):
        if folder == RESULTS or "logs" in folder.relative_to(RESULTS).parts:
            continue
        rel = folder.relative_to(RESULTS).as_posix()
        if rel.count("/") <= 1:
            assert (folder / "README.md").is_file(), f"bench/results/{rel}/ has no README.md"
            assert f"]({rel}/)" in index, f"bench/results/README.md has no row for {rel}/"
        elif not (folder / "README.md").is_file():
            assert f"{folder.name}/" in (folder.parent / "README.md").read_text(), f"nothing describes {rel}/"


def test_llama_server_binary_is_the_file_llama_server_names_else_the_install_scripts_build(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    assert llama_server_binary() == LLAMA_SERVER
    other = tmp_path / "llama-server"
    other.write_text("")
    monkeypatch.setenv("LLAMA_SERVER", str(other))
    assert llama_server_binary() == other
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="LLAMA_SERVER"):
        llama_server_binary()


def test_cold_bench_compares_repeats_and_variants_with_the_right_cold_answer():
    from bench.cold import answer_checks, summarize

    def run(rnd, system, kind, ttft, output):
        return {"round": rnd, "request": "r1 A", "system": system, "kind": kind, "ttft_s": ttft,
                "prompt_tokens": 507, "output": output}
    runs = [run(1, "orchestrator", "cold", 4.0, "abc"), run(1, "orchestrator", "repeat", 0.05, "abc"),
            run(1, "orchestrator-nocache", "cold", 4.2, "abc"), run(1, "llama-server", "cold", 3.9, "xyz"),
            run(1, "llama-server", "repeat", 0.1, "xyz"),
            run(2, "orchestrator", "cold", 4.4, "abd"), run(2, "orchestrator", "repeat", 0.03, "abX"),
            run(2, "orchestrator-nocache", "cold", 4.1, "abd"), run(2, "llama-server", "cold", 4.1, "xyz"),
            run(2, "llama-server", "repeat", 0.2, "xyz")]
    systems = ["orchestrator", "orchestrator-nocache", "llama-server"]
    rows = {(r["kind"], r["system"]): r for r in summarize(runs, systems)}
    assert set(rows) == {("cold", "orchestrator"), ("cold", "orchestrator-nocache"), ("repeat", "orchestrator")}
    rep = rows[("repeat", "orchestrator")]
    assert rep["ratio_min"] == pytest.approx(0.03 / 0.2) and rep["ratio_max"] == pytest.approx(0.5)
    assert rep["ratio_of_sums"] == pytest.approx(0.08 / 0.3)
    assert rows[("cold", "orchestrator")]["ratio"] == pytest.approx(4.2 / 4.0)
    checks = {(c["kind"], c["system"], c["against"]): (c["answers"], c["differ"]) for c in answer_checks(runs, systems)}
    # round 2's repeat answered "abX" where its own cold answer was "abd"; the variant matched orchestrator's
    # cold answer in each round (a different one per round), and llama-server's answers are its own
    assert checks == {("repeat", "orchestrator", "orchestrator"): (2, 1),
                      ("cold", "orchestrator-nocache", "orchestrator"): (2, 0),
                      ("repeat", "llama-server", "llama-server"): (2, 0)}


def test_bench_speculative_refuses_an_out_that_names_a_file(capsys):
    from bench.speculative import main

    with pytest.raises(SystemExit) as e:
        main(["--out", "results.json"])
    assert e.value.code == 2 and "--out is a directory" in capsys.readouterr().err


def test_bench_speculative_variants_name_classes_and_sum_per_class():
    from bench.speculative import aggregate, compare, generation_class, prompts

    one, four = prompts(30), prompts(30, 4)
    assert list(one) == ["tool", "edit", "free"]
    assert all(four[k] == v for k, v in one.items())  # the first prompt of each class is the one runs used
    assert len(set(four.values())) == 12 and {generation_class(g) for g in four} == {"tool", "edit", "free"}
    with pytest.raises(ValueError):
        prompts(30, 5)
    run = lambda n, s, d=0, a=0: {"completion_tokens": n, "decode_s": s, "decode_tps": (n - 1) / s,
                                  "drafted": d, "accepted": a}
    # Σ (tokens - 1) / Σ seconds, not the mean of the runs' rates: 10 s at 10 tokens/s and 1 s at 100
    row = {"off": aggregate([run(101, 10.0), run(101, 1.0)]), "on": aggregate([run(101, 2.0, 90, 80)]),
           "peer-a": aggregate([run(101, 4.0)]), "peer-b": aggregate([run(101, 1.0)])}
    assert row["off"]["decode_tps_sum"] == pytest.approx(200 / 11) and row["off"]["spread"] == (10.0, 100.0)
    line = compare(row, ["on"], ["peer-a", "peer-b"])
    assert row["best_peer"] == "peer-b" and row["on"]["vs_best_peer"] == pytest.approx(0.5)
    assert row["on"]["speedup_vs_off"] == pytest.approx(50 / (200 / 11)) and "(80/90)" in line
