"""The engine thread: the one thread of the server's process that calls llama_decode."""

from __future__ import annotations

import concurrent.futures
import queue
import threading


class EngineThread:
    """The one thread that calls llama_decode: a daemon thread running the calls given to `submit` in order.

    llama.cpp's CPU backend computes each graph on an OpenMP team (libgomp) of the thread that calls
    llama_decode. Calls from two threads slowed every call: on the 0.8b with 2 threads, one-token decode steps
    took 35 ms instead of 23 once calibration had decoded on the main thread and the scheduler decoded on its
    own (bench/results/2026-12-01/quiet/). So the server loads and calibrates the model on this thread and
    then runs the scheduler's worker loop on it (`Runtime.start`). A daemon, like the worker thread it replaces:
    a process that never closes its runtime still exits.
    """

    def __init__(self, name: str = "orchestrator-worker") -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(e)

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Queue `fn(*args, **kwargs)`; its result or exception arrives in the returned future. Raises
        RuntimeError after `shutdown` (nothing would run it: waiting on its future would hang)."""
        if self._stopped:
            raise RuntimeError("the engine thread is stopped")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def run(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on this thread, waiting for its result (its exception is raised here)."""
        return self.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        """Stop the thread after the calls queued so far; a second call does nothing."""
        if not self._stopped:
            self._stopped = True
            self._calls.put(None)
