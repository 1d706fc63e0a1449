"""What the `python -m bench` subcommands share: their model options, the engine they measure, the filler prompt
and where their results go (bench/results/<date>/, one JSON file per run, printed as `wrote PATH`)."""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def add_model_args(ap: argparse.ArgumentParser, threads: int = 2) -> None:
    """--model (a GGUF; default the synthetic qwen3.5-0.8b) and --threads."""
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the synthetic qwen3.5-0.8b)")
    ap.add_argument("--threads", type=int, default=threads)


def results_dir() -> Path:
    """bench/results/<today>/: the default --out of every subcommand."""
    return RESULTS / str(date.today())


def write_json(path: Path, data: dict) -> Path:
    """Write `data` as indented JSON to `path` (its folder made if missing) and say so; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
    return path


def load_engine(model: Path | None, threads: int, n_ctx: int, n_batch: int = 512, n_seq_max: int = 1,
                calibrate: str | None = None):
    """(model path, Engine) for `model` (None: the synthetic qwen3.5-0.8b, built once); with `calibrate`
    ("auto" or "off": orchestrator/calibration.py's decode-batching mode) min_segment is measured, or read from
    the calibration file, as `serve` does."""
    from orchestrator import calibration
    from orchestrator.config import Config
    from orchestrator.engine import Engine
    from orchestrator.runtime import model_file_digest, resolve_model

    cfg = Config(model=model, threads=threads)
    path = resolve_model(cfg)
    engine = Engine(path, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads, n_seq_max=n_seq_max)
    if calibrate is not None:
        calibration.calibrate(engine, calibration.CalibrationFile(cfg.calibration_file, model_file_digest(path),
                                                                  n_batch, False), calibrate)
    return path, engine


def filler_tokens(engine, n: int) -> list[int]:
    """The first `n` tokens of a prompt of generated words ("w12 item34"), the same in every subcommand."""
    return engine.tokenize(" ".join(f"w{i % 997} item{i}" for i in range(n)))[:n]
