"""The CUDA check's steps (bench/cuda_check.sh, bench/device_check.py) on the CPU build: its dry run builds
nothing, runs every measuring section at toy sizes on the tiny preset, and records on the CPU what it is there
to find out on a GPU (cached equals cold, a state restored under each layout)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cuda_check_dry_run_runs_every_step_and_records_cached_equals_cold(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "DRY_OUT": str(tmp_path), "CARRY": str(tmp_path / "carry")}
    r = subprocess.run(["bash", str(ROOT / "bench" / "cuda_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "dry run: using the installed llama_cpp" in r.stdout
    assert "CPU" in (tmp_path / "devices.txt").read_text()
    result = json.loads((tmp_path / "tiny.json").read_text())
    for section in ("calibration", "shared_prefix", "save_restore", "cross_layout", "speed"):
        assert "error" not in result[section], (section, result[section])
    cal = result["calibration"]
    assert cal["min_segment"] in (2, 8) and cal["layout"]["backend"] == "CPU"
    shared = result["shared_prefix"]
    assert shared["prompts"] == 3 and shared["bit_identical_first_logits"] == 3 and shared["greedy_agreement"] == 3
    assert shared["median_cached_tokens"] > 0
    assert result["save_restore"]["state_mib"] > 0 and result["save_restore"]["restore_mib_s"] > 0
    layouts = result["cross_layout"]["layouts"]
    assert [row["layout"] for row in layouts] == ["cpu", "same"]
    assert all(row["loads"] and row["equals_cold_there"] for row in layouts)
    speed = result["speed"]
    assert speed["cold_prefill_tokens_s"] > 0 and speed["decode_tokens_s_4_slots"] > 0
    assert "device_check: exit status" not in (tmp_path / "device_check.log").read_text()
