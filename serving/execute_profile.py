"""Where a model's ``execute`` spends its time, for benchmarks: off unless $TTS_EXECUTE_PROFILE names a file.

``$TTS_EXECUTE_PROFILE=/path/prefix`` wraps the generator's ``execute``: every execute's wall time, its
batch size and the gap since the previous execute returned (Triton's own time: reschedule, batch
forming, the request copies into the stub) are summed per batch size and, with
``$TTS_EXECUTE_PROFILE_CPROFILE=1``, the Python calls inside are profiled with :mod:`cProfile`. The
summary is rewritten to ``<prefix>.<pid>.txt`` every 50 executes and at the end. Sections inside an
execute are timed by :meth:`ExecuteProfile.mark` (a no-op while profiling is off).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
from collections import defaultdict

WRITE_EVERY = 50


class ExecuteProfile:
    def __init__(self, prefix: str, with_cprofile: bool):
        self.path = f"{prefix}.{os.getpid()}.txt"
        self.profiler = cProfile.Profile() if with_cprofile else None
        self.calls = 0
        self.last_exit: float | None = None
        # batch size -> [executes, wall s, gap s, {section: s}]
        self.by_size: dict[int, list] = defaultdict(lambda: [0, 0.0, 0.0, defaultdict(float)])
        self.sections: dict[str, float] = {}
        self.section_start = 0.0
        self.engine: dict[str, list] = defaultdict(lambda: [0, 0.0])  # engine-thread section -> [calls, s]
        self.engine_start = 0.0

    @classmethod
    def from_env(cls) -> ExecuteProfile | None:
        prefix = os.environ.get("TTS_EXECUTE_PROFILE", "")
        return cls(prefix, os.environ.get("TTS_EXECUTE_PROFILE_CPROFILE") == "1") if prefix else None

    def wrap(self, execute):
        def profiled(requests):
            t0 = time.perf_counter()
            self.sections, self.section_start = {}, t0
            if self.profiler is not None:
                self.profiler.enable()
            try:
                return execute(requests)
            finally:
                if self.profiler is not None:
                    self.profiler.disable()
                t1 = time.perf_counter()
                row = self.by_size[len(requests)]
                row[0] += 1
                row[1] += t1 - t0
                row[2] += 0.0 if self.last_exit is None else t0 - self.last_exit
                for name, seconds in self.sections.items():
                    row[3][name] += seconds
                self.last_exit = t1
                self.calls += 1
                if self.calls % WRITE_EVERY == 0:
                    self.write()

        return profiled

    def mark(self, name: str) -> None:
        """The time since the previous mark (or the execute's start) goes to section ``name``."""
        now = time.perf_counter()
        self.sections[name] = self.sections.get(name, 0.0) + now - self.section_start
        self.section_start = now

    def engine_mark(self, name: str) -> None:
        """As :meth:`mark`, for the step thread's sections (``start`` opens them)."""
        now = time.perf_counter()
        if name != "start":
            row = self.engine[name]
            row[0] += 1
            row[1] += now - self.engine_start
        self.engine_start = now

    def write(self) -> None:
        lines = ["batch executes wall_ms/exec gap_ms/exec sections_ms/exec"]
        for size, (n, wall, gap, sections) in sorted(self.by_size.items()):
            parts = " ".join(f"{k}={v / n * 1e3:.3f}" for k, v in sections.items())
            lines.append(f"{size} {n} {wall / n * 1e3:.3f} {gap / n * 1e3:.3f} {parts}")
        lines += [f"engine {name}: {n} calls, {s / n * 1e3:.3f} ms each" for name, (n, s) in self.engine.items()]
        if self.profiler is not None:
            out = io.StringIO()
            pstats.Stats(self.profiler, stream=out).sort_stats("tottime").print_stats(40)
            lines.append(out.getvalue())
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\n")
