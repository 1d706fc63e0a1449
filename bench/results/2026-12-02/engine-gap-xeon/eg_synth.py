# As run: PYTHONPATH=<repo> python eg_synth.py --sizes 1024 --reps 6 (see README.md).
# engine-gap with synthetic token ids (1000 + 7919 i mod 100000) instead of the word filler
import sys
import bench.engine_gap as eg
eg.filler_tokens = lambda engine, n: [1000 + (i * 7919) % 100000 for i in range(n)]
sys.exit(eg.main(sys.argv[1:]))
