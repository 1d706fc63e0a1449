"""Restore at the floor: snapshot restore speed against this machine's memcpy bandwidth (issue 12, item 6).

    python -m bench restore                  # synthetic qwen3.5-0.8b, 2 threads, a 2,000-token prefix
    python -m bench restore --model my.gguf --tokens 4000 --reps 9

In one process, interleaved, medians of --reps:
  * memcpy: numpy copy of a 256 MiB buffer into a buffer already written (the bandwidth floor, GiB/s; the
    target's yardstick), of a buffer of the restore's size (what glibc's memcpy does at that size: on these VMs it
    believes the L3 is 256 MiB and uses non-temporal stores only from 192 MiB up, so copies of a restore's size
    pay a read of every destination line), and into fresh memory (what a copy that allocates pays: page faults);
  * RAM restore: the state kind's restore (orchestrator/state.py: KV entry + checkpoint into a sequence, the
    truncation included) of a --tokens prefix from bytes in memory, in MiB/s of the bytes restored;
  * disk restore: the same after reading both entries back from the disk tier (orchestrator/cache/disk.py,
    checks included) while the files are in the page cache, in MiB/s;
  * warm TTFT model: a prompt of that prefix plus a --tail-token tail, restored and prefilled, against
    1.2 × (restore bytes ÷ memcpy bandwidth + tail ÷ the cold prefill rate measured on the prefix);
  * and checks that the restored sequence's next logits equal the cold ones (bit-identical).
Targets (issue 12): RAM restore ≥ 50% of memcpy bandwidth, disk restore ≥ 1 GiB/s, warm TTFT ≤ the model.
llama.cpp copies a restore into its tensors with memcpy, so glibc's non-temporal threshold decides its speed:
`GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 python -m bench restore` measures the
same with non-temporal stores from 1 MiB (x86-64 glibc; the tunable is read at process start).
Writes bench/results/<date>/restore.json. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


from bench.common import add_model_args, filler_tokens, load_engine, results_dir, write_json
from orchestrator.cache.disk import DiskTier
from orchestrator.cache.radix import EntryKind

MiB = 1 << 20


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=2000, help="prefix restored")
    ap.add_argument("--tail", type=int, default=32, help="tokens prefilled after the restore")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    path, engine = load_engine(a.model, a.threads, max(4096, a.tokens + a.tail + 64), n_seq_max=2,
                               calibrate="off")
    kind = engine.state
    tokens = filler_tokens(engine, a.tokens + a.tail)
    prefix, tail = tokens[: a.tokens], tokens[a.tokens:]

    # The prefix prefilled once, cold (its rate is the model's cold rate), and its entries saved.
    engine.clear(0)
    cold_s = timed(lambda: engine.decode(0, prefix, 0, want_logits=False))
    cold_rate = len(prefix) / cold_s
    entries = kind.save(engine, 0, frozenset({EntryKind.KV, EntryKind.CHECKPOINT}))
    kv, ckpt = entries.get(EntryKind.KV), entries.get(EntryKind.CHECKPOINT)
    restored_bytes = len(kv or b"") + len(ckpt or b"")
    engine.decode(0, tail, len(prefix))
    reference = engine.logits().copy()

    disk_dir = Path(tempfile.mkdtemp(prefix="bench-restore-"))
    disk = DiskTier(disk_dir, 4 * restored_bytes + 64 * MiB, b"bench-restore".ljust(32, b"\0"))
    for k, payload in entries.items():
        disk.put(k.value, prefix, k, payload)

    src = np.ones(256 * MiB, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    small_src, small_dst = src[:restored_bytes], dst[:restored_bytes]
    rows: dict[str, list[float]] = {"memcpy_GiBps": [], "memcpy_same_size_GiBps": [], "memcpy_fresh_GiBps": [],
                                    "ram_MiBps": [], "disk_MiBps": [], "warm_ttft_s": []}

    def restore_ram() -> None:
        kind.restore(engine, 1, len(prefix), kv, ckpt)

    def restore_disk() -> None:
        got = {k: disk.get(k.value) for k in entries}
        kind.restore(engine, 1, len(prefix), got.get(EntryKind.KV) and got[EntryKind.KV].payload,
                     got.get(EntryKind.CHECKPOINT) and got[EntryKind.CHECKPOINT].payload)

    def warm() -> None:
        restore_ram()
        engine.decode(1, tail, len(prefix))

    for rep in range(a.reps + 1):  # the first round warms up and is not counted
        t_copy = timed(lambda: np.copyto(dst, src))
        t_small = timed(lambda: np.copyto(small_dst, small_src))  # its lines left the caches during the copy above
        t_fresh = timed(lambda: src.copy())
        t_ram = timed(restore_ram)
        t_disk = timed(restore_disk)
        t_warm = timed(warm)
        if not np.array_equal(engine.logits(), reference):
            print("restored state's logits differ from the cold run's", file=sys.stderr)
            return 1
        if rep:
            rows["memcpy_GiBps"].append(src.nbytes / t_copy / (1 << 30))
            rows["memcpy_same_size_GiBps"].append(restored_bytes / t_small / (1 << 30))
            rows["memcpy_fresh_GiBps"].append(src.nbytes / t_fresh / (1 << 30))
            rows["ram_MiBps"].append(restored_bytes / t_ram / MiB)
            rows["disk_MiBps"].append(restored_bytes / t_disk / MiB)
            rows["warm_ttft_s"].append(t_warm)
    disk.close()

    med = {k: statistics.median(v) for k, v in rows.items()}
    memcpy_MiBps = med["memcpy_GiBps"] * 1024
    model_s = 1.2 * (restored_bytes / MiB / memcpy_MiBps + len(tail) / cold_rate)
    summary = {
        "prefix_tokens": len(prefix), "tail_tokens": len(tail), "restored_MiB": restored_bytes / MiB,
        "kv_MiB": len(kv or b"") / MiB, "checkpoint_MiB": len(ckpt or b"") / MiB, "cold_tok_s": cold_rate,
        **{f"{k}_median": v for k, v in med.items()},
        "ram_vs_memcpy": med["ram_MiBps"] / memcpy_MiBps, "disk_GiBps": med["disk_MiBps"] / 1024,
        "warm_ttft_model_s": model_s, "warm_vs_model": med["warm_ttft_s"] / model_s,
        "load_average": os.getloadavg()[0], "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }
    print(f"{len(prefix)}-token prefix: {restored_bytes / MiB:.1f} MiB restored (KV {summary['kv_MiB']:.1f}, "
          f"checkpoint {summary['checkpoint_MiB']:.1f}); cold prefill {cold_rate:.0f} tok/s; {a.reps} reps; "
          f"bit-identical; load {summary['load_average']:.1f}")
    print(f"memcpy            {med['memcpy_GiBps']:6.2f} GiB/s (of {restored_bytes / MiB:.0f} MiB: "
          f"{med['memcpy_same_size_GiBps']:.2f}; into fresh memory {med['memcpy_fresh_GiBps']:.2f})"
          + (f"; GLIBC_TUNABLES={summary['glibc_tunables']}" if summary["glibc_tunables"] else ""))
    print(f"RAM restore       {med['ram_MiBps'] / 1024:6.2f} GiB/s = {summary['ram_vs_memcpy']:.0%} of memcpy "
          f"(target >= 50%)")
    print(f"disk restore      {summary['disk_GiBps']:6.2f} GiB/s (page cache; target >= 1 GiB/s)")
    print(f"warm TTFT         {med['warm_ttft_s'] * 1e3:6.1f} ms vs model {model_s * 1e3:.1f} ms "
          f"= {summary['warm_vs_model']:.2f} (target <= 1.0: 1.2 x (bytes / memcpy + {len(tail)} tokens / cold rate))")
    write_json(a.out or results_dir() / "restore.json",
               {"model": str(path), "threads": a.threads, "reps": a.reps, "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
