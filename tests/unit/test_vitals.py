"""The supervisor's rules (serving.supervision.vitals) on hand-built observations: heartbeats judged by change, the
progress rule, pauses; and the supervisor's drain and restart policy against a fake server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serving.flow.side_channel import SideChannel
from serving.supervision.supervise import DEFERRABLE, Supervisor
from serving.supervision.vitals import (
    ALL_QUIET_SECONDS,
    EXECUTED,
    IN_FLIGHT,
    PENDING,
    STALE_SECONDS,
    STEPPED,
    Incident,
    Observation,
    Vitals,
    samples,
)

MODELS = frozenset({"tts", "generator", "vocoder", "prompt_encoder", "voices"})
STUBS = {101: "tts", 102: "generator", 103: "vocoder", 104: "prompt_encoder", 105: "voices"}

TRITON_PAGE = """# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="tts_ensemble",version="1"} 0
nv_inference_exec_count{model="generator",version="1"} 1234
nv_inference_exec_count{model="generator",version="2"} 6
nv_inference_exec_count{model="tts",version="1"} 17
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="generator",version="1"} 3
nv_inference_pending_request_count{model="tts",version="1"} 0
# HELP tts_requests_in_flight tts requests being served or waiting
# TYPE tts_requests_in_flight gauge
tts_requests_in_flight 2
tts_generator_attention{fallback_reason="no CUDA device"} 1
"""


def test_samples_reads_the_named_metrics_by_model():
    got = samples(TRITON_PAGE, (PENDING, EXECUTED, *IN_FLIGHT, "tts_generator_attention"))
    assert got[EXECUTED] == {"tts_ensemble": 0.0, "generator": 1240.0, "tts": 17.0}  # versions summed
    assert got[PENDING] == {"generator": 3.0, "tts": 0.0}
    assert got["tts_requests_in_flight"] == {"": 2.0}
    assert got["tts_generator_attention"] == {"": 1.0}  # a label value with a space
    assert "tts_ensemble_requests_in_flight" not in got  # absent, not 0
    assert samples('garbage line\nnv_inference_exec_count{model="x" oops\n', (EXECUTED,)) == {}


class Run:
    """Observations every ``poll`` seconds: stubs beat (mtime changes) unless told not to."""

    def __init__(self, vitals: Vitals, poll: float = 0.5):
        self.vitals, self.poll, self.at = vitals, poll, 1000.0
        self.mtimes = {pid: 1_700_000_000_000_000_000 for pid in STUBS}
        self.quiet: set[int] = set()  # pids whose heartbeat stopped
        self.pending = {m: 0.0 for m in MODELS}
        self.executed = {m: 0.0 for m in MODELS}
        self.busy: set[str] = set()  # models that execute between polls
        self.metrics_answer = True
        self.held = 0  # admission places held

    def step(self, seconds: float | None = None) -> Incident | None:
        self.at += self.poll if seconds is None else seconds
        for pid in STUBS:
            if pid not in self.quiet:
                self.mtimes[pid] += 500_000_000
        for model in self.busy:
            self.executed[model] += 1
        metrics = {PENDING: dict(self.pending), EXECUTED: dict(self.executed)} if self.metrics_answer else None
        return self.vitals.observe(Observation(self.at, dict(STUBS), dict(self.mtimes), metrics, self.held))

    def run(self, seconds: float) -> Incident | None:
        """Poll for ``seconds``; the first incident (and when), or None."""
        end = self.at + seconds
        while self.at < end - 1e-9:
            incident = self.step()
            if incident:
                return incident
        return None


def test_beating_stubs_and_idle_models_are_no_incident():
    assert Run(Vitals(MODELS)).run(60) is None


def test_a_stub_that_stops_beating_is_wedged_after_stale_seconds():
    run = Run(Vitals(MODELS))
    run.run(5)
    run.quiet = {102}
    stopped = run.at
    assert run.run(3.0) is None  # 3 s unchanged is not yet stale
    incident = run.run(1.0)
    assert incident == Incident("generator", incident.how, dead=False)
    assert "pid 102" in incident.how and "not beaten" in incident.how and run.at - stopped <= 4.0


def test_every_stub_silent_at_once_is_the_machine_not_a_wedge():
    """A disk or CPU stall of the whole machine stops every stub's touch while the supervisor polls on (a
    soak beside a loaded `make test` saw all six silent for 3.3 s): no incident, also when they come back
    one at a time; but a stub still silent once the others beat again is wedged, within STALE_SECONDS."""
    run = Run(Vitals(MODELS))
    run.run(5)
    run.quiet = set(STUBS)
    assert run.run(2 * STALE_SECONDS) is None
    run.quiet = {102, 104}  # they come back within a second (HEARTBEAT_SECONDS), two polls
    assert run.step() is None
    run.quiet = set()
    assert run.run(30) is None
    run.quiet = set(STUBS)  # again, and this time the generator stays silent
    assert run.run(2 * STALE_SECONDS) is None
    run.quiet = {102}
    back = run.at
    incident = run.run(STALE_SECONDS + 1)
    assert incident is not None and incident.model == "generator" and "pid 102" in incident.how
    assert run.at - back <= STALE_SECONDS + 0.5  # counted from when the others beat again


def test_every_stub_silent_for_long_is_an_incident_all_the_same():
    run = Run(Vitals(MODELS))
    run.run(5)
    run.quiet = set(STUBS)
    stopped = run.at
    assert run.run(ALL_QUIET_SECONDS) is None
    incident = run.run(1.0)
    assert incident is not None and "not beaten" in incident.how and run.at - stopped <= ALL_QUIET_SECONDS + 0.5


def test_a_lone_stub_is_judged_on_its_own():
    """No other stub to compare with: all its silence counts."""
    run = Run(Vitals(frozenset({"tts"})))
    seen = [run.vitals.observe(Observation(run.at + 0.5 * i, {101: "tts"}, {101: 1}, None)) for i in range(8)]
    assert seen[:7] == [None] * 7 and seen[7] is not None and seen[7].model == "tts"  # 3.5 s silent


def test_a_wall_clock_jump_is_no_incident():
    """mtimes are wall-clock times: going back an hour (or forward a day) still changes them."""
    run = Run(Vitals(MODELS))
    run.run(2)
    for pid in STUBS:
        run.mtimes[pid] -= 3600 * 10**9
    assert run.run(10) is None
    for pid in STUBS:
        run.mtimes[pid] += 86400 * 10**9
    assert run.run(10) is None


def test_a_pause_restarts_the_heartbeat_timers():
    """A 10 s VM pause: no poll, and no beat, for 10 s. The first poll after it sees the old mtimes."""
    vitals = Vitals(MODELS)
    run = Run(vitals)
    run.run(2)
    run.quiet = set(STUBS)
    assert run.step(10.0) is None and vitals.pause == pytest.approx(10.0)
    assert run.step() is None and vitals.pause == 0
    run.quiet = set()  # the stubs beat again
    assert run.run(20) is None
    run.quiet = {101}  # and a stub that stops after the pause is still caught
    assert run.run(4.0).model == "tts"


def test_a_slow_poll_is_not_a_pause():
    vitals = Vitals(MODELS)
    run = Run(vitals)
    run.run(1)
    run.quiet = {103}
    assert run.step(1.9) is None and vitals.pause == 0
    assert run.step(1.5) is not None  # 3.4 s without a beat, in two slow polls


def test_requests_waiting_for_a_model_that_executes_nothing_is_a_stall():
    run = Run(Vitals(MODELS, stall_seconds=10))
    run.pending["generator"] = 2
    began = run.at
    incident = run.run(12)
    assert incident is not None and incident.model == "generator" and not incident.dead
    assert "requests waiting (2)" in incident.how and 10 <= run.at - began <= 10.5 + 1e-9
    assert incident.message.startswith("unavailable: generator backend stopped responding")


def test_a_model_that_executes_while_requests_wait_is_not_stalled():
    run = Run(Vitals(MODELS, stall_seconds=10))
    run.pending["generator"] = 5  # streams waiting for a slot while the running ones step
    run.busy = {"generator"}
    assert run.run(60) is None


def test_one_long_execute_below_stall_seconds_is_not_a_stall():
    """A prompt_encoder batch of 8 long references, with requests queued behind it, then done."""
    run = Run(Vitals(MODELS, stall_seconds=10))
    run.pending["prompt_encoder"] = 8
    assert run.run(9.5) is None
    run.busy = {"prompt_encoder"}
    assert run.step() is None  # it executed: the timer restarts
    run.busy = set()
    assert run.run(9.5) is None
    assert run.run(1.0).model == "prompt_encoder"


def test_the_stall_timer_restarts_when_nothing_waits():
    run = Run(Vitals(MODELS, stall_seconds=10))
    run.pending["vocoder"] = 1
    assert run.run(8) is None
    run.pending["vocoder"] = 0
    assert run.step() is None
    run.pending["vocoder"] = 1
    assert run.run(9.5) is None


def test_voices_progresses_while_prompt_encoder_executes_its_registrations():
    run = Run(Vitals(MODELS, stall_seconds=10))
    run.pending.update(voices=2, prompt_encoder=3)
    run.busy = {"prompt_encoder"}
    assert run.run(30) is None
    run.busy = set()
    assert run.run(10.5).model in ("prompt_encoder", "voices")


def test_models_without_a_stub_are_not_judged():
    run = Run(Vitals(MODELS, stall_seconds=10))
    run.pending["tts_ensemble"] = 4  # an ensemble: its steps are judged instead
    assert run.run(30) is None


def test_a_pause_restarts_the_stall_timers():
    vitals = Vitals(MODELS, stall_seconds=10)
    run = Run(vitals)
    run.pending["generator"] = 1
    run.run(5)
    assert run.step(12.0) is None and vitals.pause == pytest.approx(12.0)
    assert run.run(9.5) is None
    assert run.run(1.0).model == "generator"


def test_places_held_while_nothing_executes_are_a_leak():
    """Requests Triton dropped hold their admission places with nothing queued anywhere (16 voice designs
    on 8 slots: 8 places held for good, readiness 200, pending 0)."""
    run = Run(Vitals(MODELS, stall_seconds=30.0))
    run.held = 8
    incident = run.run(40.0)
    assert incident is not None and incident.model == "tts" and "8 admission places held" in incident.how
    assert not incident.dead and run.at >= 1000.0 + 30.0


def test_places_held_while_any_model_executes_are_no_leak():
    run = Run(Vitals(MODELS, stall_seconds=30.0))
    run.held, run.busy = 8, {"generator"}
    assert run.run(120.0) is None
    run.busy, run.held = set(), 0  # all answered: an idle server holds nothing
    assert run.run(120.0) is None


def test_places_held_while_the_generator_steps_are_no_leak_and_a_stuck_engine_is():
    """The generator takes each stream's one request at once and steps it on its engine thread: streams
    that only generate (no chunk due, no vocoder call) move no execution count, only its steps counter."""
    run = Run(Vitals(MODELS, stall_seconds=30.0))
    run.held, steps = 4, 0.0
    for _ in range(240):  # 120 s of stepping
        steps += 10
        run.at += run.poll
        metrics = {PENDING: dict(run.pending), EXECUTED: dict(run.executed), STEPPED: {"": steps}}
        assert run.vitals.observe(Observation(run.at, dict(STUBS), dict(run.mtimes), metrics, run.held)) is None
        for pid in STUBS:
            run.mtimes[pid] += 500_000_000
    incident = None
    for _ in range(80):  # the engine thread stops stepping: a leak after stall_seconds
        run.at += run.poll
        metrics = {PENDING: dict(run.pending), EXECUTED: dict(run.executed), STEPPED: {"": steps}}
        incident = incident or run.vitals.observe(Observation(run.at, dict(STUBS), dict(run.mtimes), metrics, 4))
        for pid in STUBS:
            run.mtimes[pid] += 500_000_000
    assert incident is not None and incident.model == "tts" and "4 admission places held" in incident.how


def test_places_held_behind_queued_requests_are_the_progress_rules():
    run = Run(Vitals(MODELS, stall_seconds=30.0))
    run.held, run.pending["generator"] = 4, 1  # a wedged generator: a stall, not a leak
    incident = run.run(40.0)
    assert incident is not None and incident.model == "generator" and "(stalled)" in incident.how


def test_the_leak_timer_restarts_when_the_places_are_given_back():
    run = Run(Vitals(MODELS, stall_seconds=30.0))
    run.held = 1
    assert run.run(20.0) is None
    run.held = 0
    assert run.step() is None
    run.held = 1
    assert run.run(20.0) is None


def test_a_silent_metrics_port_is_a_wedged_tritonserver():
    run = Run(Vitals(MODELS, stall_seconds=10))
    run.run(2)
    run.metrics_answer = False
    assert run.run(9.5) is None
    incident = run.run(1.0)
    assert incident.model == "tritonserver" and "metrics port" in incident.how
    assert incident.message.startswith("unavailable: tritonserver stopped responding")


def test_a_silent_metrics_port_after_a_pause_is_given_time():
    vitals = Vitals(MODELS, stall_seconds=10)
    run = Run(vitals)
    run.metrics_answer = False
    run.run(5)
    assert run.step(20.0) is None and vitals.pause
    assert run.run(9.5) is None


def test_stall_seconds_zero_turns_the_progress_rule_off():
    run = Run(Vitals(MODELS, stall_seconds=0))
    run.pending["generator"] = 3
    run.metrics_answer = False
    assert run.run(120) is None


# ---- the supervisor's drain and restart policy, against a fake tritonserver ----
class FakeServer:
    """What Supervisor uses of TritonServer; ``in_flight`` is what the metrics port says."""

    def __init__(self, tmp: Path, flags: SideChannel):
        self.model_repository = tmp / "model_repository"
        for model in MODELS:
            (self.model_repository / model / "1").mkdir(parents=True)
            (self.model_repository / model / "1" / "model.py").touch()
        self.log_path, self.flags = tmp / "tritonserver.log", flags
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.in_flight = {"tts_requests_in_flight": 0, "tts_ensemble_requests_in_flight": 0}
        self.events: list[str] = []

    def metrics_text(self, timeout: float, retry_503: float) -> str:
        self.events.append(f"refusing {self.flags.refusal()!r}, in flight {sum(self.in_flight.values())}")
        page = "".join(f"{name} {value}\n" for name, value in self.in_flight.items())
        for name in self.in_flight:  # a stream ends each time it is asked
            if self.in_flight[name]:
                self.in_flight[name] -= 1
                break
        return page

    def stop(self, timeout: float) -> None:
        self.events.append(f"stop, broken {self.flags.flag('broken', 0)!r}")
        self.proc.kill()
        self.proc.wait()

    def start(self):
        self.events.append("start")
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        return self

    def wait_ready(self, timeout: float, stopping) -> bool:
        return not stopping()


@pytest.fixture
def supervised(tmp_path):
    server = FakeServer(tmp_path, SideChannel(tmp_path / "marks", run_dir=tmp_path))  # what tts reads
    yield Supervisor(server, tmp_path, drain_seconds=5), server
    server.proc.kill()


def test_a_restarted_server_is_judged_afresh(supervised):
    """Nothing the rules saw of the old server counts against the new one."""
    supervisor, _ = supervised
    supervisor.stall_seconds = 10
    assert supervisor._start(stopping=lambda: False)
    run = Run(supervisor.vitals)
    run.pending["generator"] = 1
    run.run(9.5)
    supervisor.stop(grace=0)
    assert supervisor._start(stopping=lambda: False)
    run.vitals = supervisor.vitals
    assert run.run(9.5) is None


@pytest.mark.parametrize("model", sorted(DEFERRABLE))
def test_a_dead_stub_no_stream_uses_lets_the_running_streams_finish_first(supervised, model):
    supervisor, server = supervised
    server.in_flight.update(tts_requests_in_flight=2, tts_ensemble_requests_in_flight=1)
    supervisor.recover(Incident(model, "its stub (pid 1) exited", dead=True), stopping=lambda: False)
    drain = [e for e in server.events if e.startswith("refusing")]
    assert [e.rsplit(" ", 1)[1] for e in drain] == ["3", "2", "1", "0"]  # both metrics counted
    assert all(f"'unavailable: {model} backend died; the server restarts once" in e for e in drain)
    restarting = f"stop, broken 'unavailable: {model} backend died; the server is restarting, retry shortly'"
    assert server.events[len(drain) :] == [restarting, "start"]
    assert server.flags.refusal() is None  # cleared for the new server


@pytest.mark.parametrize("model", ["tts", "generator", "vocoder", "ensemble_generator"])
def test_a_dead_stub_running_streams_use_restarts_at_once(supervised, model):
    supervisor, server = supervised
    server.in_flight["tts_requests_in_flight"] = 3
    supervisor.recover(Incident(model, "its stub (pid 1) exited", dead=True), stopping=lambda: False)
    restarting = f"stop, broken 'unavailable: {model} backend died; the server is restarting, retry shortly'"
    assert server.events == [restarting, "start"]


def test_a_wedged_prompt_encoder_restarts_at_once(supervised):
    """Its queued requests would wait for the whole drain: restart, and they fail with the message now."""
    supervisor, server = supervised
    server.in_flight["tts_requests_in_flight"] = 3
    supervisor.recover(Incident("prompt_encoder", "stalled", dead=False), stopping=lambda: False)
    assert server.events[0].startswith("stop, broken 'unavailable: prompt_encoder backend stopped responding")


def test_the_drain_before_a_restart_ends_at_drain_seconds(supervised):
    supervisor, server = supervised
    supervisor.drain_seconds = 0.3
    server.in_flight["tts_requests_in_flight"] = 10**6  # never ends
    supervisor.recover(Incident("voices", "its stub (pid 1) exited", dead=True), stopping=lambda: False)
    restarting = "stop, broken 'unavailable: voices backend died; the server is restarting, retry shortly'"
    assert server.events[-2:] == [restarting, "start"]


def test_a_shutdown_during_the_drain_leaves_the_rest_to_the_shutdown(supervised):
    supervisor, server = supervised
    server.in_flight["tts_requests_in_flight"] = 10**6
    asked = []

    def stopping() -> bool:  # a SIGTERM arrives during the drain
        asked.append(1)
        return len(asked) > 3

    supervisor.recover(Incident("voices", "its stub (pid 1) exited", dead=True), stopping)
    assert server.events and not any(e.startswith(("stop", "start")) for e in server.events)


def test_heartbeats_are_judged_when_looked_at_not_after_the_metrics_read(supervised, monkeypatch):
    """A slow metrics read (a loaded machine) must not age the heartbeats looked at before it."""
    supervisor, server = supervised
    supervisor.stubs = {101: "tts"}
    now, read_at = [100.0], []

    def slow_read(timeout: float, retry_503: float) -> str:
        read_at.append(now[0])
        now[0] += 2.0  # the read takes 2 s
        return ""

    monkeypatch.setattr(server, "metrics_text", slow_read)
    monkeypatch.setattr("serving.supervision.supervise.time.monotonic", lambda: now[0])
    seen = supervisor._observe()
    assert read_at and seen.at <= read_at[0]


def test_a_wedge_names_the_stubs_stack_dumps(supervised, capsys):
    supervisor, _ = supervised
    (supervisor.run_dir / "stacks").mkdir()
    dump = supervisor.run_dir / "stacks" / "tts.101.txt"
    dump.write_text("Timeout (0:00:02)!\n")
    (supervisor.run_dir / "stacks" / "vocoder.102.txt").write_text("Timeout (0:00:02)!\n")
    supervisor.recover(Incident("tts", "its stub (pid 101) has not beaten for 3.1 s (wedged)", dead=False),
                       stopping=lambda: False)  # fmt: skip
    err = capsys.readouterr().err
    assert f"tts: stacks at its late heartbeats: {dump}" in err
    assert "vocoder.102" not in err


def test_a_wedge_by_heartbeat_takes_the_stubs_native_stacks_before_the_restart(supervised, monkeypatch):
    supervisor, server = supervised
    supervisor.stubs = {101: "tts", 102: "vocoder"}
    taken = []
    monkeypatch.setattr(
        "serving.supervision.supervise.native_stacks", lambda pid, path: taken.append((pid, path.name)) or True
    )
    supervisor.recover(Incident("tts", "its stub (pid 101) has not beaten for 3.1 s (wedged)", dead=False),
                       stopping=lambda: False)  # fmt: skip
    assert taken == [(101, "tts.101.gdb.txt")]
    assert server.events[-2:][1] == "start"


def test_native_stacks_are_gdbs_backtraces(tmp_path, monkeypatch):
    from serving.supervision.supervise import native_stacks

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = tmp_path / "stacks" / "tts.1.gdb.txt"
        if shutil.which("gdb") is None:
            assert not native_stacks(child.pid, path)
        else:
            assert native_stacks(child.pid, path)
            assert "sleep" in path.read_text()  # the child's one thread, in time.sleep
        monkeypatch.setattr("serving.supervision.supervise.shutil.which", lambda name: None)
        assert not native_stacks(child.pid, tmp_path / "none.txt") and not (tmp_path / "none.txt").exists()
    finally:
        child.kill()
        child.wait()
