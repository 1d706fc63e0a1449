"""Models the project makes itself: synthetic GGUFs with real architectures, vocabulary and template and random
weights (`synth.py`), for tests, benchmarks and demos without a model hub."""
