"""Runtime start-up on the tiny model: which thread drives llama.cpp, and what a first start says."""

import concurrent.futures
import logging
import threading

import pytest

from orchestrator.engine import Engine

from .conftest import run_chat


def test_every_llama_decode_call_comes_from_the_one_engine_thread(start, monkeypatch):
    # A second thread calling llama_decode slows every call (engine_thread.EngineThread): loading, calibration and
    # serving must all decode on the worker's thread, never on the thread that called Runtime.start.
    callers: set[str] = set()
    decode, decode_step = Engine.decode, Engine.decode_step

    def spy(fn):
        def wrapped(self, *args, **kwargs):
            callers.add(threading.current_thread().name)
            return fn(self, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(Engine, "decode", spy(decode))
    monkeypatch.setattr(Engine, "decode_step", spy(decode_step))
    rt = start(parallel=2)
    run_chat(rt, [{"role": "user", "content": "hello there"}], max_tokens=4)
    assert len(callers) == 1 and threading.current_thread().name not in callers
    assert callers == {rt.scheduler._driver._thread.name}


def test_a_start_without_stored_calibration_says_it_measures_and_how_long_it_took(start, caplog):
    with caplog.at_level(logging.INFO, logger="orchestrator.calibration"):
        start()  # the tests' config keeps no calibration file: min_segment is measured
    lines = [r.getMessage() for r in caplog.records if r.name == "orchestrator.calibration"]
    assert any(m.startswith("measuring the smallest exact prefill ubatch") for m in lines)
    assert any(m.startswith("measured min_segment ") and m.endswith(" s") for m in lines)


def test_closing_twice_returns_and_the_stopped_engine_thread_refuses_calls(start):
    # Runtime.close may run twice (a test's own close, then the fixture's; a server's shutdown paths). The second
    # call once queued the MTP head's close on the engine thread the first had stopped and waited for ever.
    rt = start()
    rt.close()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(rt.close).result(timeout=30)
    with pytest.raises(RuntimeError, match="stopped"):
        rt.scheduler._driver.submit(print)
