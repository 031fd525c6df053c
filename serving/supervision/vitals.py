"""The supervisor's heartbeat, progress and leak rules and its pause, judged on what it saw at each poll
(:class:`Observation`, times from its own monotonic clock) with no processes, files or clocks here, so that they
are tested on hand-built observations. The rules, their numbers and why: docs/operations.md, Supervision."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

STALE_SECONDS = 3.0  # a heartbeat file unchanged this long: a wedged stub (it is touched every second)
# Every stub silent this long is an incident even though none beat (a longer stall of the whole machine is not
# one a listener survives anyway; the stall measured: docs/operations.md).
ALL_QUIET_SECONDS = 4 * STALE_SECONDS
# Requests waiting this long for a model that executes nothing: a stall. Well above the longest execute
# measured (docs/operations.md): a false stall kills every running stream.
STALL_SECONDS = 30.0
PAUSE_SECONDS = 2.0  # a gap between two polls longer than this is a pause (polls are ~0.5-1 s apart)
PENDING, EXECUTED = "nv_inference_pending_request_count", "nv_inference_exec_count"
# The generator's own progress: its streams are one request each, stepped by its engine thread, so its
# execution count moves only when a stream arrives; its steps count here (serving.stub.metric_batch.GeneratorMetrics).
STEPPED = "tts_generator_stream_steps_total"
PROGRESS = (PENDING, EXECUTED, STEPPED)  # what the supervisor reads at every poll (Observation.metrics)
# A drain waits for their sum: 0. An open text-in stream holds no place while it has nothing to say
# (serving.flow.admission) and is counted apart: its next turn's text may still come, and is spoken.
IN_FLIGHT = ("tts_requests_in_flight", "tts_ensemble_requests_in_flight", "tts_text_streams_open")
# A model whose execute waits on another's (voices registers a voice through prompt_encoder, synchronously)
# is making progress while that one executes.
WAITS_ON = {"voices": ("prompt_encoder",)}


def samples(text: str, names: Iterable[str]) -> dict[str, dict[str, float]]:
    """Prometheus text -> {name: {its ``model`` label or "": value summed over other labels}} for ``names``."""
    wanted, out = set(names), {}
    for line in text.splitlines():  # a comment's or an empty line's name is never wanted
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name not in wanted:
            continue
        start = labels.find('model="') + 7
        try:
            model = labels[start : labels.index('"', start)] if start >= 7 else ""
            number = float(value)
        except ValueError:  # not a sample line after all
            continue
        by_model = out.setdefault(name, {})
        by_model[model] = by_model.get(model, 0.0) + number
    return out


@dataclass(frozen=True)
class Incident:
    model: str  # or "tritonserver"
    how: str  # how it was detected, for the log
    dead: bool  # False: wedged or stalled

    @property
    def message(self) -> str:
        """What tts's clients read while the server is replaced."""
        state = "died" if self.dead else "stopped responding"
        what = self.model if self.model == "tritonserver" else f"{self.model} backend"
        return f"unavailable: {what} {state}; the server is restarting, retry shortly"


@dataclass(frozen=True)
class Observation:
    """What the supervisor saw at one poll."""

    at: float  # time.monotonic() when it looked
    stubs: dict[int, str]  # pid -> model of the stubs it watches
    beats: dict[int, int | None]  # pid -> mtime (ns) of the stub's heartbeat file; None: no file
    metrics: dict[str, dict[str, float]] | None  # samples() of PENDING, EXECUTED and STEPPED; None: no answer
    held: int = 0  # admission places held (serving.flow.admission), by every entry point together


@dataclass
class Vitals:
    """The heartbeat, progress and leak rules over successive observations of one tritonserver."""

    models: frozenset[str]  # the models with a stub, which the progress rule watches (not ensembles)
    stall_seconds: float = STALL_SECONDS  # 0: no progress or leak rule
    pause: float = 0.0  # the gap the last observe() took for a pause, 0 if none
    _last: float | None = None  # when the last observation was made
    _answered: float | None = None  # when the metrics port last answered (or supervision began)
    # what -> (its value, since when it stands): ("beat", pid) a stub's heartbeat mtime, ("wait", model) a model's
    # and its callees' execution counts while it has requests waiting, "held" every execution while places are held
    _since: dict = field(default_factory=dict)
    _silent: dict[int, float] = field(default_factory=dict)  # pid -> seconds silent while another stub beat

    def _stood(self, what, value, at: float) -> float:
        """How long ``what`` has had ``value`` (0: new or changed now)."""
        if (last := self._since.get(what)) is None or last[0] != value:
            self._since[what] = (value, at)
            return 0.0
        return at - last[1]

    def observe(self, seen: Observation) -> Incident | None:
        at = seen.at
        gap = 0.0 if self._last is None else at - self._last
        self.pause, self._last = (gap if gap > PAUSE_SECONDS else 0.0), at
        if self.pause or self._answered is None:  # the first look, or a pause (what was quiet was paused with us):
            self._since, self._silent = {what: (value, at) for what, (value, _) in self._since.items()}, {}
            self._answered = at  # every timer starts over
        return self._heartbeats(seen, 0.0 if self.pause else gap) or self._progress(seen) or self._leak(seen)

    def _heartbeats(self, seen: Observation, gap: float) -> Incident | None:
        """``gap``: the time since the previous observation (0 at the first, and after a pause)."""
        quiet = {pid: self._stood(("beat", pid), seen.beats.get(pid), seen.at) for pid in seen.stubs}
        beat = {pid for pid, q in quiet.items() if not q}  # since the last look
        silent = {}
        for pid, model in seen.stubs.items():
            if pid in beat:
                continue
            counted = bool(beat) or len(seen.stubs) == 1  # another stub beat meanwhile, or it has none
            silent[pid] = self._silent.get(pid, 0.0) + (gap if counted else 0.0)
            if silent[pid] > STALE_SECONDS or quiet[pid] > ALL_QUIET_SECONDS:
                how = (
                    "has no heartbeat file" if seen.beats.get(pid) is None else f"has not beaten for {quiet[pid]:.1f} s"
                )
                return Incident(model, f"its stub (pid {pid}) {how} (wedged)", dead=False)
        self._silent = silent
        return None

    def _progress(self, seen: Observation) -> Incident | None:
        if not self.stall_seconds:
            return None
        if seen.metrics is None:
            if (silent := seen.at - self._answered) >= self.stall_seconds:
                return Incident("tritonserver", f"its metrics port has not answered for {silent:.1f} s", dead=False)
            return None
        self._answered = seen.at
        pending, executed = seen.metrics.get(PENDING, {}), seen.metrics.get(EXECUTED, {})
        for model in sorted(self.models):
            if pending.get(model, 0.0) <= 0:
                self._since.pop(("wait", model), None)
                continue
            counts = tuple(executed.get(m, 0.0) for m in (model, *WAITS_ON.get(model, ())))
            if (stalled := self._stood(("wait", model), counts, seen.at)) >= self.stall_seconds:
                how = f"requests waiting ({pending[model]:.0f}), no execution for {stalled:.1f} s (stalled)"
                return Incident(model, how, dead=False)
        return None

    def _leak(self, seen: Observation) -> Incident | None:
        if not self.stall_seconds or seen.metrics is None:
            return None
        if seen.held <= 0 or any(v > 0 for v in seen.metrics.get(PENDING, {}).values()):
            self._since.pop("held", None)  # nothing held, or requests queued: the progress rule watches those
            return None
        executed = sum(seen.metrics.get(EXECUTED, {}).values()) + sum(seen.metrics.get(STEPPED, {}).values())
        if (idle := self._stood("held", executed, seen.at)) >= self.stall_seconds:
            how = f"{seen.held} admission places held while no model executed for {idle:.1f} s (requests lost)"
            return Incident("tts", how, dead=False)
        return None
