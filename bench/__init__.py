"""Benchmarks: ``python -m bench`` (streaming latency and throughput against concurrency; see
``bench/__main__.py``) and ``bench/step_overhead.py`` (generator per-step overhead under Triton)."""
