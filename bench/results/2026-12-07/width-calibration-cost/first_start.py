"""The whole first start of a runtime in the layout `--speculative auto` verifies in on x86 (`-ctk q8_0`, reference
decode kernels; bench.speculative's start_runtime: one slot, cache off, repacking probed), then a second start
from the calibration file it wrote, at --draft-max DRAFT_MAX, on the qwen3.5-0.8b preset.

    PYTHONPATH=. python bench/results/2026-12-07/width-calibration-cost/first_start.py DRAFT_MAX"""
import sys, time, tempfile
from pathlib import Path
import bench.speculative
from bench.speculative import start_runtime
from orchestrator.models.synth import ensure_model
bench.speculative.CALIBRATION = Path(tempfile.mkdtemp()) / "calibration.json"
for attempt in ("first", "second"):
    t = time.perf_counter()
    rt = start_runtime(ensure_model("qwen3.5-0.8b"), "auto", 2, int(sys.argv[1]))
    print(attempt, "start", round(time.perf_counter() - t, 1), "s; widths", rt.scheduler.speculation.widths, flush=True)
    rt.close()
