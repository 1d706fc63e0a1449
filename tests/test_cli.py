"""`python -m orchestrator` end to end: synth-model writes a loadable GGUF, serve answers over HTTP."""

import subprocess
import sys

import httpx
import pytest

from .conftest import serve_process


def test_synth_model_cli_writes_tiny_gguf(tmp_path):
    out = tmp_path / "tiny.gguf"
    r = subprocess.run([sys.executable, "-m", "orchestrator", "synth-model", "--preset", "tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 10 * 2**20
    assert "RANDOM" in r.stderr + r.stdout


def test_serve_cli_answers_and_logs_each_request(tiny_model, tmp_path):
    proc, url = serve_process(tiny_model, tmp_path / "serve.log", "--ctx-size", "4096", "--threads", "2",
                              "--cache-ram", "256", "--cache-disk-dir", str(tmp_path / "snapshots"))
    try:
        body = {"messages": [{"role": "system", "content": "You are brief. " * 20},
                             {"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        first = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        body["messages"][1]["content"] = "hello there"
        second = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = (tmp_path / "serve.log").read_text()
    assert "snapshot RAM budget: 256 MiB" in text
    assert "RANDOM" in text  # the synthetic model's random weights are announced
    assert "cached=0" in text and "prompt=" in text and "tier=" in text and "restore_ms=" in text


def test_serve_rejects_bad_flags_before_loading_anything(tmp_path):
    for flags in (["-t", "0"], ["-c", "0"], ["-n", "-1"], ["--port", "99999"], ["--cache-ram", "-5"],
                  ["--chat-template-file", str(tmp_path / "missing.jinja")],
                  ["--cache-remote", "http://127.0.0.1:6379"], ["--cache-remote-timeout", "0"]):
        r = subprocess.run([sys.executable, "-m", "orchestrator", "serve", *flags], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "error:" in r.stderr, (flags, r.stderr)


def test_remote_tier_flags_reach_the_config():
    import argparse

    from orchestrator import cli

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    cfg = cli._config(parser.parse_args(["serve", "--cache-remote", "rediss://:pw@redis.internal:6380/2",
                                     "--cache-remote-queue", "64", "--cache-remote-timeout", "0.5",
                                     "--replica-name", "r7", "--port", "9001"]))
    assert (cfg.cache_remote, cfg.cache_remote_queue_mib, cfg.cache_remote_timeout, cfg.replica) == \
        ("rediss://:pw@redis.internal:6380/2", 64, 0.5, "r7")
    cfg.replica_name = None
    assert cfg.replica.endswith(":9001")


def test_speculation_flags_reach_the_config():
    import argparse

    from orchestrator import cli

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    cfg = cli._config(parser.parse_args(["serve"]))
    assert (cfg.speculative, cfg.draft_max, cfg.decode_rows, cfg.decode_kernels) == ("auto", 31, 1, "auto")
    cfg = cli._config(parser.parse_args(["serve", "--speculative", "ngram", "--draft-max", "3", "--decode-rows", "2"]))
    assert (cfg.speculative, cfg.draft_max, cfg.decode_rows) == ("ngram", 3, 2)
    assert cli._config(parser.parse_args(["serve", "--speculative", "mtp"])).speculative == "mtp"
    cfg = cli._config(parser.parse_args(["serve", "--model-draft", "small.gguf", "--draft-window", "512"]))
    assert (cfg.model_draft.name, cfg.draft_window, cfg.drafts) == ("small.gguf", 512, "draft")  # auto + a draft
    cfg = cli._config(parser.parse_args(["serve", "-md", "small.gguf", "--speculative", "ngram"]))
    assert cfg.drafts == "ngram"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative", "eagle"])


def test_repacking_flag_takes_auto_on_off_and_the_old_bare_flag():
    import argparse

    from orchestrator import cli

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    value = lambda *flags: cli._config(parser.parse_args(["serve", *flags])).use_extra_bufts  # noqa: E731
    assert (value(), value("--use-extra-bufts"), value("--use-extra-bufts", "off")) == ("auto", "on", "off")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--use-extra-bufts", "maybe"])
