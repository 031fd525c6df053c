"""Supervision by the launcher: a backend that dies (kill -9), wedges (SIGSTOP) or stops making progress
fails the streams in flight with a message naming it, readiness drops, the server is back by itself with
no slot or vocoder state left; a dead stub no running stream uses lets the streams finish first; a pause
of everything (as a VM pause looks to the processes) is no incident; SIGTERM drains, then stops within
its grace period leaving no shared memory.

One launcher serves the whole module (each incident restarts its tritonserver); the SIGTERM test ends it.

No deadline here is a guess at this machine's speed: each is the sum of the launcher's own waits (its
options and constants) and, for a restart, a multiple of the time this module's tritonserver took to start
(the launcher measures it). A drain is tested with a stream seen running when the incident comes, timed
to end well within the drain at the pace it keeps on this machine now.
"""

from __future__ import annotations

import os
import secrets
import signal
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from client import ServerBusy, TTSError
from serving.serve import GATEWAY_STOP_SECONDS
from serving.supervision.run_folder import HEARTBEATS
from serving.supervision.supervise import (
    GDB_SECONDS,
    GRACE_SECONDS,
    METRICS_TIMEOUT,
    POLL_SECONDS,
    STOP_SECONDS,
    find_stubs,
)
from serving.supervision.vitals import STALE_SECONDS
from tests.integration.launcher import HeldStream, Launcher, ReadyWatch, Stream, gone, with_pid

pytestmark = pytest.mark.integration

LONG = {"max_patches": 400, "chunk_first": 1, "chunk_next": 1}  # a patch a chunk; about 8 s: still running when hit
# Streams that only have to be running for a while (the slots full while a fifth request waits, the generator's
# slots held while requests on their ids are refused) and then end by themselves: their end is waited for.
SHORTER = {**LONG, "max_patches": 120}
DRAIN = 8  # the SIGTERM test waits all of it (its long stream outlasts it)
# Below the default: the module's executes are short, and the pause test's 10 s pause outlasts it.
STALL, PAUSE = 8, 10.0
# One check of the supervisor: its sleep, then a read of the metrics port that may time out.
CHECK = POLL_SECONDS + METRICS_TIMEOUT
# A stream fails this soon after its backend is killed or stopped: the heartbeat rule's STALE_SECONDS, up
# to 7 checks (a dead stub is seen at the first; a loaded machine makes them slower), tts's grace to fail it.
FAIL_WITHIN = STALE_SECONDS + 7 * CHECK + GRACE_SECONDS
REQUEST_TIMEOUT = 10  # the probe request that tells a server serves
RESTART_FACTOR = 3  # a restart's start may take this many times this module's first start (load changes)
STUBS_GONE = 2  # seconds the supervisor's stop waits for the old server's stubs (Supervisor.stop)
# SIGTERM -> the launcher's exit: the drain, tts's grace for what is left, tritonserver's stop, its stubs,
# the gateway's stop.
SHUTDOWN_WITHIN = DRAIN + GRACE_SECONDS + STOP_SECONDS + STUBS_GONE + GATEWAY_STOP_SECONDS
PACE_CHUNKS = 10  # a stream's pace: over its last chunks, its first (the prefill) left out


@pytest.fixture(scope="module")
def launcher(nostop_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("supervised")
    args = ("--slots", "4", "--drain-seconds", str(DRAIN), "--stall-seconds", str(STALL))
    with Launcher.start(nostop_ckpt, tmp, *args) as ln:
        ln.wait_ready()
        # the launcher says how long the start took just after tritonserver answers ready
        wait_for(lambda: "[supervisor] ready in " in ln.text(), 5 * CHECK, "the launcher did not time its start")
        yield ln
    print(ln.text())


@pytest.fixture(autouse=True)
def serving(launcher):
    """Each test starts from a server that answers: one whose incident is still being repaired when the
    next test begins would fail that test for the wrong reason (and every test after it)."""
    serving_again(launcher, time.monotonic())


def test_a_generated_admin_key_is_private(launcher):
    from client.voices import VoiceClient

    key_file = launcher.run_dir.parent.parent / "state" / "admin_key"  # kept across restarts, not per run
    assert f"admin key: {key_file} (generated now" in launcher.text() and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    assert key not in launcher.text()
    with pytest.raises(TTSError, match="is not registered"):  # the voices model took the key
        VoiceClient(f"127.0.0.1:{launcher.ports.grpc}", admin_key=key).remove("nobody")


def back_within(launcher: Launcher) -> float:
    """Seconds a server may take to serve again after an incident in this run: noticing it (at most the
    progress rule's STALL and a check), a drain (a dead stub no stream uses waits for the running streams),
    tts's grace and the old server's stop, a new start (RESTART_FACTOR x this run's first start, as the
    launcher measured it: the machine's load slows both alike), and the probe request."""
    restart = RESTART_FACTOR * launcher.first_start()
    return STALL + CHECK + DRAIN + GRACE_SECONDS + STUBS_GONE + restart + REQUEST_TIMEOUT


def serving_again(launcher: Launcher, since: float) -> float:
    """Seconds from ``since`` until a new request is answered; fails after :func:`back_within`."""
    within = back_within(launcher)
    while True:
        try:
            launcher.client(timeout=REQUEST_TIMEOUT).synthesize("Back again", seed=1, parameters={"max_patches": 4})
            return time.monotonic() - since
        except (TTSError, ConnectionError, TimeoutError):
            took = f"{time.monotonic() - since:.0f} s, the first start {launcher.first_start():.1f} s"
            assert time.monotonic() - since < within, f"not serving within {within:.0f} s ({took}):\n{launcher.text()}"
            time.sleep(0.2)


def near_its_end(stream: Stream, patches: int, seconds: float) -> int:
    """Wait until ``stream`` (a patch a chunk, ``patches`` in all) has about ``seconds`` left at the pace of
    its last PACE_CHUNKS chunks -> its chunks then. It is provably running then: it has chunks to come."""
    while True:
        n, times = stream.chunks, stream.times[-PACE_CHUNKS:]
        assert not stream.done.is_set() and n < patches, f"the stream ended before its pace was known: {stream.error}"
        if n > PACE_CHUNKS and times[-1] > times[0]:
            pace = (len(times) - 1) / (times[-1] - times[0])  # chunks a second
            if (patches - n) / pace <= seconds:
                return n
        time.sleep(0.02)


def wait_for(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {within:.1f} s"
        time.sleep(0.05)


def check_recovered(launcher: Launcher, model: str, since: float, watch: ReadyWatch) -> float:
    back = serving_again(launcher, since)
    assert any(code != 200 for _, code in watch.stop()), "readiness stayed 200 throughout"
    for _ in range(50):  # the request above has just ended
        m = launcher.metrics()
        if m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0:
            break
        time.sleep(0.1)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0, m
    assert f"[supervisor] {model}: " in launcher.text()  # the incident is logged, naming the model
    return back


def aborted(launcher: Launcher, log_start: int) -> bool:
    """Whether tritonserver itself died (the supervisor says so within a poll or two of it; the deadline is
    slack for a loaded machine: the answer comes as soon as the line is there)."""
    deadline = time.monotonic() + 5 * POLL_SECONDS + 30
    while time.monotonic() < deadline:
        if "[supervisor] tritonserver: tritonserver exited" in launcher.text()[log_start:]:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize(
    "model, sig",
    [
        ("generator", signal.SIGKILL),
        ("vocoder", signal.SIGKILL),
        ("tts", signal.SIGKILL),
        ("generator", signal.SIGSTOP),
    ],
    ids=["generator-killed", "vocoder-killed", "tts-killed", "generator-wedged"],
)
def test_a_failed_backend_fails_its_streams_and_the_server_comes_back(launcher, model, sig):
    stream = Stream(launcher.client(timeout=30), "A long stream to break.", LONG)
    assert stream.started.wait(30) and stream.error is None, stream.error
    pid = launcher.stubs()[model]
    watch = ReadyWatch(launcher)
    log_start = len(launcher.text())
    t0 = time.monotonic()
    os.kill(pid, sig)
    try:
        assert stream.done.wait(FAIL_WITHIN), f"the stream had no answer {FAIL_WITHIN:.0f} s after the {sig.name}"
        assert stream.error is not None and str(stream.error), "the stream ended without a (named) error"
        named = model
        if model != "tts" and model not in str(stream.error):
            # A stub killed while it holds the Python backend's shared-memory lock makes tritonserver itself
            # abort (boost::interprocess::lock_exception, docs/operations.md): every client's connection
            # drops and the supervisor restarts the server as a whole. Anything else must name the model.
            named = "tritonserver"
            assert aborted(launcher, log_start), stream.error
        back = check_recovered(launcher, named, t0, watch)
        print(f"{model} {sig.name}: stream failed {stream.ended - t0:.2f} s after ({stream.error}); "
              f"serving again after {back:.1f} s")  # fmt: skip
    finally:
        watch.stop()
        if pid in find_stubs(launcher.run_dir / "model_repository"):  # the supervisor should have killed it
            with_pid(os.kill, pid, signal.SIGKILL)


def test_a_dead_ensemble_generator_ends_ensemble_streams_and_the_server_comes_back(launcher):
    """tts_ensemble's generation step: its running streams die with it, so the server is replaced at once;
    an ensemble client's stream breaks with the server (an ensemble carries no message naming the model)."""
    stream = Stream(launcher.client(timeout=30, model="tts_ensemble"), "An ensemble stream to break.", LONG)
    assert stream.started.wait(30) and stream.error is None, stream.error
    watch = ReadyWatch(launcher)
    t0 = time.monotonic()
    os.kill(launcher.stubs()["ensemble_generator"], signal.SIGKILL)
    try:
        assert stream.done.wait(FAIL_WITHIN) and stream.error is not None, stream.error
        back = check_recovered(launcher, "ensemble_generator", t0, watch)
        print(
            f"ensemble_generator SIGKILL: the ensemble stream ended ({stream.error}); serving again after {back:.1f} s"
        )
    finally:
        watch.stop()


def test_a_dead_prompt_encoder_fails_the_next_request_naming_it(launcher):
    ref = np.random.default_rng(0).uniform(-0.3, 0.3, 24000).astype(np.float32)
    pid = launcher.stubs()["prompt_encoder"]
    watch = ReadyWatch(launcher)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        with pytest.raises(TTSError) as failed:
            launcher.client(timeout=FAIL_WITHIN).synthesize(
                "A cloned voice.", ref_audio=ref, ref_sample_rate=24000, ref_text="a reference", parameters={"max_patches": 4}
            )  # fmt: skip
        assert "prompt_encoder" in str(failed.value)  # within FAIL_WITHIN: the client waits no longer
        back = check_recovered(launcher, "prompt_encoder", t0, watch)
        print(f"prompt_encoder SIGKILL: request failed ({failed.value}); serving again after {back:.1f} s")
    finally:
        watch.stop()


def fill_the_slots(launcher: Launcher, tag: str, parameters: dict = LONG) -> tuple[list[Stream], Stream]:
    """4 long streams running (the launcher has 4 slots) and a fifth request waiting for a slot."""
    running = [Stream(launcher.client(timeout=60), f"{tag} {i}", parameters) for i in range(4)]
    assert all(s.started.wait(30) for s in running) and not any(s.error for s in running)
    waiting = Stream(launcher.client(timeout=60), f"{tag}: waiting", {"max_patches": 4})
    deadline = time.monotonic() + 20
    while launcher.metrics().get("tts_requests_waiting", 0) < 1:
        assert time.monotonic() < deadline, "the fifth request never waited"
        time.sleep(0.1)
    return running, waiting


def first_drop(watch: ReadyWatch, since: float) -> float:
    """Seconds from ``since`` until readiness first answered other than 200."""
    return min(t for t, code in watch.stop() if code != 200 and t >= since) - since


def test_a_stopped_generator_fails_the_waiting_requests_too(launcher):
    running, waiting = fill_the_slots(launcher, "Stopped")
    pid = launcher.stubs()["generator"]
    watch = ReadyWatch(launcher)
    logged = len(launcher.text())
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        assert waiting.done.wait(FAIL_WITHIN + STALL) and "generator" in str(waiting.error), waiting.error
        assert all(s.done.wait(5) and "generator" in str(s.error) for s in running)
        back = check_recovered(launcher, "generator", t0, watch)
        # The heartbeat rule saw it (STALE_SECONDS), before the stall rule could (STALL): the rule is asserted
        # from the supervisor's own words, not from a wall-clock race it wins by seconds on a quiet machine only.
        assert f"its stub (pid {pid}) has not beaten for" in launcher.text()[logged:], launcher.text()[logged:]
        dropped = first_drop(watch, t0)  # readiness drops once the stacks are taken (gdb, at most GDB_SECONDS)
        assert dropped <= FAIL_WITHIN + GDB_SECONDS
        print(f"generator SIGSTOP with a request waiting: readiness dropped after {dropped:.1f} s, the waiting "
              f"request failed after {waiting.ended - t0:.1f} s ({waiting.error}); back after {back:.1f} s")  # fmt: skip
    finally:
        watch.stop()
        if pid in find_stubs(launcher.run_dir / "model_repository"):
            with_pid(os.kill, pid, signal.SIGKILL)


def wedge_generator(launcher: Launcher, slots: int) -> list:
    """What wedged every generator slot of Triton 2.51's iterative sequence batcher, the stub running on:
    ``slots`` streams, then a request with the correlation id of each live stream and no START (which held
    that sequence's slot for good). No client can do this (the generator answers only the pipeline, whose
    ids nobody sees): the test acts as the pipeline, on a pipe of its own, with the internal key read from
    tritonserver's environment (same user). Returns the answers to the second requests (FINISH_REASON or
    error) and the pipe, to close afterwards."""
    from serving.security.auth import INTERNAL_KEY_ENV, Keys
    from tests.integration.helpers import SILENT, GeneratorPipe

    environ = open(f"/proc/{launcher.servers()[0]}/environ", "rb").read().split(b"\0")
    key = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(INTERNAL_KEY_ENV.encode() + b"="))
    ids = [secrets.randbits(62) | (1 << 62) for _ in range(slots)]  # random 63-bit ids
    url = f"127.0.0.1:{launcher.ports.grpc}"
    pipe = GeneratorPipe(url, Keys(key).generator_model, key, launcher.run_dir / "cancel")
    for i in ids:
        pipe.send(SILENT, i, SHORTER)  # the waiting request below is served once one of them has ended
    deadline = time.monotonic() + 30
    while launcher.metrics().get("tts_generator_active_slots", 0) < slots:
        assert time.monotonic() < deadline, "the generator streams did not start"
        time.sleep(0.05)
    return [pipe.answer(pipe.send(SILENT, i, {"max_patches": 3}, start=False)) for i in ids], [pipe]


def test_admission_places_held_with_nothing_running_are_an_incident(launcher):
    """A request nothing will ever answer (Triton dropped its BLS call) holds its admission place with
    nothing queued and nothing executing; readiness stayed 200 and the supervisor silent while such
    places piled up (24 of 40 after a 10-minute soak). Here the place is taken from outside, as a lost
    request held it: the leak rule replaces the server after --stall-seconds, which frees it."""
    from serving.flow.admission import Admission

    log_start = len(launcher.text())
    watch = ReadyWatch(launcher)
    gate = Admission(launcher.run_dir / "cancel", "tts", 1000)
    assert gate.enter()
    t0 = time.monotonic()
    try:
        deadline = t0 + STALL + 30  # the rule's time, and polls and metrics reads on a busy machine
        while not (incident := [line for line in launcher.text()[log_start:].splitlines()
                                if "[supervisor] tts: " in line and "admission places held" in line]):  # fmt: skip
            assert time.monotonic() < deadline, launcher.text()[log_start:]
            time.sleep(0.5)
        assert time.monotonic() - t0 >= STALL
        back = check_recovered(launcher, "tts", t0, watch)
        assert Admission(launcher.run_dir / "cancel", None, 1).total() == 0  # the new server's gate is empty
        print(f"leak: {incident[0]}; serving again after {back:.1f} s")
    finally:
        watch.stop()


def test_the_generator_cannot_be_wedged_by_requests_on_live_ids(launcher):
    """Under Triton's iterative sequence batcher, a request on a live stream's id without START held that
    sequence's slot for good: every slot wedged, requests waited until the progress rule replaced the
    server. The generator now holds one request per stream and steps its streams itself: such a request
    is refused at once, the streams run on, and a waiting stream is served with no incident."""
    log_start = len(launcher.text())
    answers, clients = wedge_generator(launcher, 4)
    try:
        assert all("in use" in a for a in answers), answers
        waiting = Stream(launcher.client(timeout=120), "Waits for a slot", {"max_patches": 4})
        assert waiting.done.wait(60 + STALL), "the waiting request had no answer"
        assert waiting.error is None and waiting.chunks, waiting.error
        assert "[supervisor]" not in launcher.text()[log_start:], launcher.text()[log_start:]
    finally:
        for client in clients:
            client.close()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first seen, then theirs)."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(entry.parent.name)] = int(entry.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, queue = [], [pid]
    while queue:
        below = queue.pop(0)
        children = [child for child, parent in parents.items() if parent == below]
        found += children
        queue += children
    return found


def test_a_pause_of_everything_is_no_incident(launcher):
    """The launcher, tritonserver, its stubs and the gateway stopped for PAUSE seconds, as a VM pause looks
    to them: both rules would fire on the gap; none does, and streams started then all finish.

    The server is idle when it is paused: stopped one by one with streams running (a signal cannot stop
    them all in the same instant), Triton 2.51's Python backend itself failed in 7 of 8 runs here
    (SIGSEGV in its execute or boost::interprocess::lock_exception, a stub stopped mid-exchange with its
    tritonserver), which the supervisor handles as a crash, not as this rule."""
    serving_again(launcher, time.monotonic())  # not while an earlier test's restart is under way
    servers, log_start = launcher.servers(), len(launcher.text())
    pids = [launcher.proc.pid, *descendants(launcher.proc.pid)]
    assert set(launcher.stubs().values()) <= set(pids)
    for pid in pids:
        with_pid(os.kill, pid, signal.SIGSTOP)
    time.sleep(PAUSE)
    for pid in reversed(pids):
        with_pid(os.kill, pid, signal.SIGCONT)
    resumed, t0 = time.time(), time.monotonic()  # heartbeat files carry wall-clock times
    running, waiting = fill_the_slots(launcher, "After a pause", SHORTER)
    for stream in (*running, waiting):
        assert stream.done.wait(60), "a stream had no answer after the pause"
    assert launcher.client(timeout=30).synthesize("After the pause", parameters={"max_patches": 4}).size
    # The gap was judged at the first check after it, the one that says so (a restart would have followed at
    # once and failed the streams above); what is left to the rules is a stub that stays stopped: every stub
    # has beaten since, so none is.
    wait_for(lambda: "heartbeat and progress timers start over" in launcher.text()[log_start:], 4 * CHECK,
             "the supervisor did not see the pause")  # fmt: skip
    beats = launcher.run_dir / HEARTBEATS

    def beat_since(model: str, pid: int) -> bool:
        try:
            return (beats / f"{model}.{pid}").stat().st_mtime > resumed
        except FileNotFoundError:
            return False

    for model, pid in launcher.stubs().items():
        wait_for(lambda: beat_since(model, pid), STALE_SECONDS, f"the {model} stub did not beat after the pause")  # noqa: B023
    after = launcher.text()[log_start:]
    assert "no check for" in after and "heartbeat and progress timers start over" in after, after
    assert "restarting tritonserver" not in after, after
    assert launcher.servers() == servers
    outcomes = [str(s.error) if s.error else "finished" for s in (*running, waiting)]
    print(f"pause of {PAUSE:.0f} s: no restart; streams after it: {outcomes}, {time.monotonic() - t0:.1f} s to finish")
    assert not any("restarting" in outcome for outcome in outcomes), outcomes


def test_a_dead_voices_stub_lets_the_running_stream_finish_then_the_server_restarts(launcher):
    # A text-in stream whose text goes on only when released: running for certain when voices dies, and
    # its end is the test's to choose (not a guess at this machine's pace under load).
    stream = HeldStream(launcher, after="And it goes on after the voices stub died.")
    assert stream.started.wait(30) and not stream.done.is_set(), stream.error
    at_kill = stream.chunks
    servers, run_dir = launcher.servers(), launcher.run_dir
    watch = ReadyWatch(launcher)
    t0 = time.monotonic()
    os.kill(launcher.stubs()["voices"], signal.SIGKILL)
    try:
        wait_for(lambda: (run_dir / "draining").exists(), FAIL_WITHIN, "the launcher did not start draining")
        with pytest.raises(ServerBusy, match="voices backend died") as refused:  # the kind: unavailable
            launcher.client(timeout=10).synthesize("Too late", parameters={"max_patches": 4})
        assert not stream.done.is_set(), stream.error  # the drain waits for it
        stream.release.set()  # now its text goes on and ends
        assert stream.done.wait(DRAIN) and stream.error is None, stream.error  # it finished normally
        assert stream.chunks > at_kill  # the text sent after the kill was spoken
        back = check_recovered(launcher, "voices", t0, watch)
        assert launcher.servers() != servers and "[supervisor] voices: drained in " in launcher.text()
        print(f"voices SIGKILL: the running stream finished {stream.ended - t0:.1f} s after, new requests were "
              f"refused ({refused.value}); serving again after {back:.1f} s")  # fmt: skip
    finally:
        stream.release.set()
        watch.stop()


def test_sigterm_drains_streams_then_stops_leaving_nothing(launcher):
    client = launcher.client(timeout=30)
    long = Stream(client, "Too long to finish.", {**LONG, "steps": 100})  # 10x the flow steps: far past DRAIN
    assert long.started.wait(30)
    short_patches = 48
    short = Stream(client, "Short enough to finish.", {**LONG, "max_patches": short_patches})
    assert short.started.wait(30)
    at_signal = near_its_end(short, short_patches, DRAIN / 3)  # running, a third of the drain left at its pace
    server, stubs, run_dir = launcher.servers(), list(launcher.stubs().values()), launcher.run_dir
    t0 = time.monotonic()
    launcher.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: (run_dir / "draining").exists(), 4 * CHECK, "the launcher did not start draining")
    with pytest.raises(TTSError, match="shutting down"):
        client.synthesize("Too late.", parameters={"max_patches": 4})
    assert launcher.proc.wait(SHUTDOWN_WITHIN) == 0
    stopped = time.monotonic() - t0
    assert short.done.wait(1) and short.error is None, short.error  # finished within the drain
    assert short.chunks >= short_patches and short.chunks > at_signal  # to its end, going on after the signal
    assert long.done.wait(1) and long.error is not None  # cut off with an error, not left hanging
    assert gone(server + stubs, 2)
    assert not list(Path("/dev/shm").glob(f"{launcher.shm_prefix}*"))
    left = {p.name for p in launcher.run_dir.iterdir()}  # and the stacks of late heartbeats, if any
    assert left - {"stacks"} == {"tritonserver.log"}
    assert "stacks" not in left or all(p.stat().st_size for p in (launcher.run_dir / "stacks").iterdir())
    print(f"SIGTERM: launcher exited 0 after {stopped:.1f} s; the long stream got: {long.error}")
