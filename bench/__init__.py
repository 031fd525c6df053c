"""Benchmarks: ``python -m bench`` (streaming latency and throughput against concurrency; see
``bench/__main__.py``), ``python -m bench.step_overhead`` (the served generator's per-step overhead) and
``python -m bench.responsiveness`` (how quickly a server answers, against the bounds it is meant to keep)."""
