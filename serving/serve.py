"""Launch the Triton server for a checkpoint: ``python -m serving.serve [--checkpoint DIR] ...``.

Renders the model repository into a run folder of its own and runs tritonserver under a :class:`Supervisor`;
restarts, signals and a killed launcher: docs/operations.md, Supervision and shutdown."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import ipaddress
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine.config import cache_dir
from engine.random_weights import RANDOM_WEIGHTS_NOTE, has_random_weights
from serving.config.options import add_arguments, from_arguments
from serving.config.repository import build
from serving.fronts.front_limits import FrontLimits, HttpFrontLimits, front_wanted
from serving.fronts.front_limits import add_arguments as add_front_arguments
from serving.fronts.metrics_relay import LAUNCHER
from serving.security.admin_key import FILE as ADMIN_KEY_FILE
from serving.security.admin_key import default_state_dir, load_or_create, write_key
from serving.supervision import supervise
from serving.supervision.run_folder import STACKS
from serving.supervision.supervise import DRAIN_SECONDS, Supervisor, start_watchdog
from serving.supervision.triton_env import REPO_ROOT, Ports, TritonServer, die_with_parent, url_host
from serving.supervision.vitals import STALL_SECONDS
from serving.voices.voice_store import default_dir as default_voice_dir


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def busy_ports(host: str, ports: Ports, openai: int | None = None, triton_host: str | None = None,
               front_host: str | None = None, http_front_host: str | None = None) -> list[str]:  # fmt: skip
    """Every port that cannot be bound where it will listen, with the option that moves it (held open together:
    a port given twice is busy too). HTTP and gRPC: on ``triton_host`` (default ``host``), or their front's host."""
    triton_host = triton_host or host
    named = [("HTTP", ports.http, "--http-port", http_front_host or triton_host),
             ("gRPC", ports.grpc, "--grpc-port", front_host or triton_host),
             ("metrics", ports.metrics, "--metrics-port", host)]  # fmt: skip
    busy = []
    with contextlib.ExitStack() as stack:
        for name, port, option, at in named + ([("OpenAI", openai, "--openai-port", host)] if openai else []):
            family, kind, _, _, addr = socket.getaddrinfo(at, port, type=socket.SOCK_STREAM)[0]
            s = stack.enter_context(socket.socket(family, kind))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is no obstacle
            try:
                s.bind(addr)
            except OSError as e:
                busy.append(f"{name} port {port} on {at} is busy ({e.strerror}): move it with {option}")
    return busy


say = functools.partial(supervise.say, prefix="")  # the launcher's own lines
BACKOFF_FIRST, BACKOFF_MOST, BACKOFF_RESET = 0.5, 30.0, 60.0  # seconds: a crashing gateway's restarts
GATEWAY_STOP_SECONDS = 5.0  # SIGTERM -> SIGKILL of the gateway at shutdown
GATEWAY_RESTARTS = "tts_gateway_restarts_total"
GATEWAY_WAIT = 30.0  # seconds the launcher waits, once tritonserver is ready, for the gateway to answer


class Gateway:
    """``python -m gateway`` on ``host:port`` for this server: it dies with the launcher, which starts it again
    (and says so) if it exits on its own (docs/operations.md, Supervision and shutdown)."""

    def __init__(self, host: str, triton: str, port: int, random_weights: bool, more: list[str]):
        """``triton``: ``TritonServer.triton_grpc``; ``more``: ``--gateway-args``, checked by the launcher."""
        self.cmd = [sys.executable, "-m", "gateway", "--triton", triton, "--host", host, "--port", str(port),
                    *(["--random-weights"] if random_weights else []), *more]  # fmt: skip
        self.proc, self.started = self._start(), time.monotonic()
        self.restarts, self.backoff, self.restart_at = 0, BACKOFF_FIRST / 2, 0.0
        LAUNCHER.add(GATEWAY_RESTARTS, "times the launcher restarted the OpenAI gateway after it exited")
        self.base = f"http://{url_host(host)}:{port}"  # its /health, and the address it is announced at

    def announce(self, stopping) -> None:
        """Its addresses once it reaches the ready tritonserver (``/health`` 200; never before: a request sent
        earlier would be refused), at most GATEWAY_WAIT s later (restarting a gateway that exits meanwhile)."""
        deadline = time.monotonic() + GATEWAY_WAIT
        while not stopping():
            # refused, not ready (HTTPError 503), timed out: not yet
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                say(f"warning: the OpenAI gateway does not answer {GATEWAY_WAIT:g} s after tritonserver got ready; "
                    "its addresses:")  # fmt: skip
                break
            self.keep_up()
            time.sleep(0.1)
        say(f"OpenAI-compatible speech API: {self.base}/v1/audio/speech\nweb page: {self.base}/")

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, cwd=REPO_ROOT, preexec_fn=die_with_parent)

    def keep_up(self) -> None:
        """Restart a gateway that exited, after a wait doubled at each exit in a row (one that cannot start does
        not spin)."""
        now = time.monotonic()
        if self.proc is None:
            if now >= self.restart_at:
                self.proc, self.started = self._start(), now
            return
        if self.proc.poll() is None:
            return
        self.restarts += 1
        LAUNCHER.increment(GATEWAY_RESTARTS)
        self.backoff = BACKOFF_FIRST if now - self.started >= BACKOFF_RESET else min(2 * self.backoff, BACKOFF_MOST)
        supervise.say(f"gateway exited with {self.proc.returncode}; restarting it in {self.backoff:g} s "
            f"({self.restarts} restarts so far)")  # fmt: skip
        self.proc, self.restart_at = None, now + self.backoff

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(GATEWAY_STOP_SECONDS)
            self.proc.kill()  # nothing once it has exited


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.serve", description=__doc__.split("\n\n")[0])
    add_arguments(ap)  # the server's options (serving.config.options.ServeOptions)
    ap.add_argument("--host", default="127.0.0.1", help="where the ports listen (see --triton-host)")
    ap.add_argument("--triton-host", help="where Triton's own HTTP and gRPC ports listen (default: --host). "
                    "127.0.0.1 with a public --host exposes only the OpenAI gateway and the metrics relay (and the "
                    "fronts with --grpc-front/--http-front on), which "
                    "bound what a client may send and hold (Triton's own ports do not: docs/triton.md#T22)")  # fmt: skip
    for name, port in (("HTTP", Ports.http), ("gRPC", Ports.grpc)):
        ap.add_argument(f"--{name.lower()}-port", type=int, default=port, help=f"{name}: the bounded front when it "
                        f"is on (--{name.lower()}-front), else Triton's own")  # fmt: skip
    ap.add_argument("--metrics-port", type=int, default=Ports.metrics)
    ap.add_argument("--openai-port", type=int, default=8080, help="the OpenAI-compatible speech API (gateway/)")
    ap.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible gateway")
    ap.add_argument("--gateway-args", default="", metavar="'OPTIONS'",
                    help="more options of the gateway, as one string (python -m gateway --help lists them), e.g. "
                         "'--max-unsent-seconds 10 --agent-sockets-per-peer 8'; checked before anything starts")  # fmt: skip
    add_front_arguments(ap)  # --grpc-front, --http-front and their bounds (serving.fronts.front_limits)
    ap.add_argument("--work-dir", type=Path, help="where run folders go (default: ~/.cache/fireredtts3-triton/run)")
    key_source = ap.add_mutually_exclusive_group()
    key_source.add_argument("--admin-key", help="the key that adds and removes voices (default: the one kept in "
                            "--state-dir, generated on first use); visible in the process list: prefer "
                            "--admin-key-file")  # fmt: skip
    key_source.add_argument("--admin-key-file", type=Path, help="file whose first line is the admin key")
    ap.add_argument("--state-dir", type=Path, help="where the generated admin key and the gateway's jobs (jobs/, unless "
                    "--gateway-args gives --jobs-dir) are kept across restarts (default: "
                    f"{default_state_dir()}; rotate the key with python -m serving.security.admin_key rotate)")  # fmt: skip
    ap.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an admin key given")
    ap.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                    help="on SIGTERM, or before a restart that can wait (a dead prompt_encoder or voices), how long "
                         "running streams may finish")  # fmt: skip
    ap.add_argument("--stall-seconds", type=float, default=STALL_SECONDS,
                    help="restart tritonserver when a model has had requests waiting this long without executing "
                         "any, or its metrics port has not answered (0: never); keep it above the longest execute "
                         f"(default {STALL_SECONDS:g}: a batch of 8 references of 60 s took up to 12.8 s on 2 busy "
                         "CPU cores)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.stall_seconds < 0 or args.drain_seconds < 0:
        ap.error("--stall-seconds and --drain-seconds must be >= 0")
    if gateway_args := shlex.split(args.gateway_args):
        from gateway.__main__ import check as check_gateway_args

        if problem := check_gateway_args(gateway_args):
            ap.error(f"--gateway-args: {problem}")

    try:
        admin_key, file = args.admin_key, args.admin_key_file
        admin_key = file.read_text().partition("\n")[0].strip() if file else admin_key
    except OSError as e:
        ap.error(f"cannot read --admin-key-file: {e}")
    if admin_key == "":
        ap.error("the admin key is empty")
    triton_host = args.triton_host or args.host
    if not (is_loopback(args.host) and is_loopback(triton_host)) and admin_key is None and not args.insecure:
        ap.error(f"--host {args.host} is reachable from other machines: give --admin-key or --admin-key-file "
                 "(or --insecure to use a generated key anyway)")  # fmt: skip
    ports, public = Ports(args.http_port, args.grpc_port, args.metrics_port), not is_loopback(triton_host)
    front, http_front = front_wanted(args.grpc_front, public), front_wanted(args.http_front, public)
    busy = busy_ports(args.host, ports, None if args.no_openai else args.openai_port, triton_host,
                      args.host if front else None, args.host if http_front else None)  # fmt: skip
    if busy:  # before anything is written: a running server's files stay as they are
        say("cannot start:\n  " + "\n  ".join(busy))
        return 2
    if not args.checkpoint:  # the tiny checkpoint in the cache, written on first use
        from engine.random_checkpoint import cached_checkpoint

        args.checkpoint = cached_checkpoint("tiny", cache_dir() / "checkpoints" / "tiny-seed0")
    ckpt = args.checkpoint.resolve()
    if not ckpt.is_dir():
        ap.error(f"checkpoint folder not found: {ckpt}")
    voice_dir = (args.voice_dir or default_voice_dir()).resolve()
    try:  # checked before the run folder is made
        opts = from_arguments(args, checkpoint=str(ckpt), voice_dir=str(voice_dir))
        limits = (FrontLimits.from_flags(args).for_places(opts.slots + opts.queue, opts.text_idle_seconds)
                  if front else None)  # fmt: skip
        http_limits = HttpFrontLimits.from_flags(args) if http_front else None
    except ValueError as e:
        ap.error(str(e))
    if os.geteuid() == 0:
        say("warning: running as root, and so are tritonserver and its Python stubs, which run this repository's "
            "code for every request: run as an unprivileged user, or in the image (uid 1000)")  # fmt: skip
    # the run folder <UTC time>-<pid>, 0700 whatever the umask: its repository and logs name the generator's secret
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = ((args.work_dir or cache_dir() / "run") / f"{stamp}-{os.getpid()}").resolve()
    work.mkdir(parents=True, mode=0o700)
    work.chmod(0o700)
    say(f"run folder: {work}")
    state = (args.state_dir or default_state_dir()).resolve()
    if admin_key is None:
        try:
            admin_key, made = load_or_create(state)
        except (OSError, ValueError) as e:
            say(f"cannot start: the admin key: {e}")
            return 2
        say(f"admin key: {state / ADMIN_KEY_FILE} ({'generated now' if made else 'kept'}; the voices CLI on this "
            "machine reads it there; rotate: python -m serving.security.admin_key rotate)")  # fmt: skip
    # Triton's restricted APIs get a key of their own: Triton takes it on its command line, which any local
    # user can read (/proc/<pid>/cmdline); the operator's key reaches the models only as its digest.
    triton_key = write_key(work / "triton_admin_key")
    say(f"Triton admin key (repository index, shared memory, logging, trace): {work / 'triton_admin_key'}")
    opts = dataclasses.replace(opts, cancel_dir=str(work / "cancel"), run_dir=str(work))
    repo = build(work / "model_repository", opts)
    server = TritonServer(repo, work, ports, host=triton_host, metrics_host=args.host, log_path=work / "tritonserver.log", admin_key=admin_key,
                          triton_key=triton_key, grpc_front=limits, http_front=http_limits)  # fmt: skip
    start_watchdog(repo, server.shm_prefix)
    signals = []  # a second one cuts the drain short
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: signals.append(signum))
    say(f"starting tritonserver (checkpoint {ckpt}); log: {server.log_path}")
    if random_weights := has_random_weights(ckpt):
        say(f"note: {RANDOM_WEIGHTS_NOTE}")
    supervisor, code = Supervisor(server, work, args.stall_seconds, args.drain_seconds), 0
    # the gateway is ours: it reaches Triton's own gRPC port, behind the front when there is one
    if not any(a.split("=", 1)[0] == "--jobs-dir" for a in gateway_args):  # jobs are kept with the state
        gateway_args = [*gateway_args, "--jobs-dir", str(state / "jobs")]
    gateway = None if args.no_openai else Gateway(args.host, server.triton_grpc, args.openai_port, random_weights,
                                                  gateway_args)  # fmt: skip
    stopping = lambda: bool(signals)  # noqa: E731
    say("starting: the models load (a minute or so on a laptop CPU); the addresses follow once everything answers")

    def ready() -> None:
        if gateway is not None:
            gateway.announce(stopping)
            say("ready: every address above answers" + (" (random weights: see the note above)" * random_weights))

    try:
        supervisor.run(stopping=stopping, tick=gateway.keep_up if gateway else lambda: None, ready=ready)
    except RuntimeError as e:  # tritonserver exited before it was ready
        say(str(e))
        code = 1
    finally:
        t0 = time.monotonic()
        supervisor.shutdown(args.drain_seconds if code == 0 else 0, hurry=lambda: len(signals) > 1)
        if gateway is not None:  # after the drain: it was carrying the streams that finished
            gateway.stop()
        for dump in (work / STACKS).glob("*"):  # the stubs' stacks at late heartbeats: only those dumped stay
            dump.stat().st_size or dump.unlink()
        for entry in work.iterdir():  # keep the log and any stack dumps; the key dies with the server
            if entry.name != "tritonserver.log" and not (entry.name == STACKS and any(entry.iterdir())):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        say(f"tritonserver stopped in {time.monotonic() - t0:.1f} s")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
