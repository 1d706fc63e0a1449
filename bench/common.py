"""What the `python -m bench` subcommands share: their model options and where their results go
(bench/results/<date>/, one JSON file per run, printed as `wrote PATH`)."""

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

