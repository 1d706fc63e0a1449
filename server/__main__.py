"""`python -m orchestrator` and `python -m server`: the command line (orchestrator/cli.py), whose `serve` starts
the runtime and runs this package's HTTP API under uvicorn until interrupted.
"""

from __future__ import annotations

import logging
import signal
import sys

from orchestrator import cli
from orchestrator.config import Config


def serve(cfg: Config, log_level: str = "info") -> int:
    """Start the runtime and run uvicorn until interrupted."""
    import uvicorn

    from orchestrator.errors import OrchestratorError
    from orchestrator.memory import limit_malloc_arenas
    from orchestrator.runtime import Runtime

    from .app import create_app

    limit_malloc_arenas(1)  # before any thread starts: one heap to fragment instead of one per thread
    log = logging.getLogger("orchestrator")
    if cfg.cache_enabled:
        log.info("snapshot RAM budget: %d MiB", cfg.cache_ram_mib)
    else:
        log.info("snapshot cache off: every request is prefilled cold")
    try:
        rt = Runtime.start(cfg)
    except (OrchestratorError, ValueError) as e:
        log.error("%s", getattr(e, "message", e))
        return 2
    warning = cli.bind_warning(cfg)
    if warning:
        log.warning("%s", warning)
    # uvicorn shuts down on SIGTERM and then raises the signal again with the handler it found: the default one
    # ends the process at once, without the `finally` below, and the RAM tier's snapshots never reach the disk
    # tier (SnapshotCache.close). This handler turns that second SIGTERM into an orderly exit.
    previous = signal.signal(signal.SIGTERM, _exit_after_shutdown)
    try:
        uvicorn.run(create_app(rt), host=cfg.host, port=cfg.port, log_level=log_level, access_log=False)
    except SystemExit:
        pass
    finally:
        rt.close()
        signal.signal(signal.SIGTERM, previous)
    return 0


def _exit_after_shutdown(signum: int, frame) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """The command line (`cli.main`) with `serve` above; returns the exit status."""
    return cli.main(serve, argv)


if __name__ == "__main__":
    sys.exit(main())
