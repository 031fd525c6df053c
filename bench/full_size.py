"""The released sizes on this machine: ``bench/full_size.sh`` (or ``python -m bench.full_size``).

What a GPU user meets in their first minute, on CPU: it writes the ``full`` preset (2.66 B parameters)
with random weights ONCE in the official layout, in the release's dtype (float32: the published
``fireredtts3_base`` is 8.5 GB for 2.12 B parameters), Base only, sharded with an index as
``save_pretrained`` does, into ``cache/full_size/`` (ignored by git); then serves it with the launcher
(``python -m serving.serve --models base``) and prints one table: each Triton model's time to ready (from
``tritonserver.log``), the resident memory of every process (tritonserver, each Python backend stub, the
gateway), the KV pool the generator reports, and one short request end to end through tritonserver (the
gRPC client, tritonclient) and through the gateway's ``/v1/audio/speech``: first audio and total.

Memory: the writer holds one shard (2 GB) at a time (the model is built with its large layers left
unallocated, each layer filled when its shard is written); the server loads each network once per process
(float32 files on CPU: no cast, one copy). Before each step the free memory is checked against what the
step needs, and the run refuses with both numbers when it is short. Not part of ``make test``: minutes.
Past 300 lines on purpose: one first-start check (bench/full_size.sh), whose writer, memory guard, process
watch and report share the checkpoint's sizes and end in one table; docs/gpu.md has the measured run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from engine.checkpoint import CAMPP_FILE, CORE_DIR, REDAE_DIR, TOKENIZER_DIR, RedAE, count_parameters
from engine.config import PRESETS, Preset, nostop
from engine.models.campp import save_campp
from engine.models.core import FireRedTTS3Core
from engine.random_checkpoint import random_campp, randomize
from engine.text import write_tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "cache" / "full_size"
# Bumped whenever write_checkpoint writes different files; part of the folder name (never reuse an old one).
LAYOUT = 1
GIB = 1 << 30
RANDOM = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)  # the layers engine.random_checkpoint.randomize fills


@contextlib.contextmanager
def unallocated_layers() -> Iterator[None]:
    """Build modules without initialising their large layers: their weights stay ``torch.empty`` (memory
    the OS maps only when written), filled later by :func:`randomize`; norms and tokens keep their init."""
    saved = {cls: cls.reset_parameters for cls in RANDOM}
    try:
        for cls in RANDOM:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def networks(p: Preset) -> dict[str, Callable[[], nn.Module]]:
    """The official layout's safetensors folders (Base only) and how to build each network."""
    return {CORE_DIR: lambda: FireRedTTS3Core(p.core), REDAE_DIR: lambda: RedAE(p.redae)}


def shard_plan(module: nn.Module, shard_bytes: int, dtype: torch.dtype) -> list[list[str]]:
    """The module's state-dict names cut into shards of at most ``shard_bytes`` (a larger tensor alone),
    in state-dict order; ``module`` may be on the meta device."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in module.state_dict().items():
        n = t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_names(count: int) -> list[str]:
    """Hugging Face's shard file names (``model-00001-of-00004.safetensors``); one shard: model.safetensors."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_index(folder: Path, module: nn.Module, shards: list[list[str]], dtype: torch.dtype, cfg: dict) -> None:
    """``config.json`` and (for several shards) ``model.safetensors.index.json``: the layout without data."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if len(shards) > 1:
        state = module.state_dict()
        total = sum(state[n].numel() * dtype.itemsize for s in shards for n in s)
        weight_map = {n: f for s, f in zip(shards, shard_names(len(shards)), strict=True) for n in s}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


@torch.no_grad()
def write_network(
    folder: Path, build: Callable[[], nn.Module], cfg: dict, scale: float, dtype: torch.dtype,
    shard_bytes: int, stop_bias: float | None = None, progress: Callable[[str], None] = lambda s: None,
) -> int:  # fmt: skip
    """Write one network with random weights (engine.random_checkpoint's init), a shard at a time: each
    layer is filled when its shard is written and dropped after. Returns its parameter count."""
    with torch.device("meta"):
        meta = build()
    shards = shard_plan(meta, shard_bytes, dtype)
    write_index(folder, meta, shards, dtype, cfg)
    with unallocated_layers():
        model = build()
    owner = {f"{m}.{n}" if m else n: (mod, n) for m, mod in model.named_modules() for n, _ in
             [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]}  # fmt: skip
    stop = getattr(model, "stop_head", None)
    filled: set[int] = set()
    params = count_parameters(model)
    for i, (names, fname) in enumerate(zip(shards, shard_names(len(shards)), strict=True)):
        tensors = {}
        for name in names:
            mod, attr = owner[name]
            if isinstance(mod, RANDOM) and id(mod) not in filled:
                randomize(mod, scale)
                if mod is stop and stop_bias is not None:
                    mod.bias.fill_(stop_bias)
                filled.add(id(mod))
            t = getattr(mod, attr).detach()
            tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
        if folder.name == REDAE_DIR and i == len(shards) - 1:  # the published layout carries this buffer
            tensors["decoder.istft_head.istft.window"] = torch.hann_window(4 * model.cfg.audio_patch_size).to(dtype)
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        for name in names:  # give the shard's memory back
            mod, attr = owner[name]
            getattr(mod, attr).data = torch.empty(0)
        del tensors
        progress(f"  {folder.name}/{fname}: {len(names)} tensors ({i + 1}/{len(shards)})")
    return params


def write_checkpoint(
    out: Path, preset: str | Preset = "full", seed: int = 0, dtype: torch.dtype = torch.float32, shard_gb: float = 2.0,
    progress: Callable[[str], None] = lambda s: None,
) -> Path:  # fmt: skip
    """``preset``'s Base checkpoint with random weights in the official layout (``fireredtts3_base/``,
    ``redae/``, CAM++, the tiny tokenizer) at ``out``; same seed, same files. Written into a temporary
    folder beside ``out`` and renamed: a half-written checkpoint is never seen."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    builds = networks(p)
    cfgs = {CORE_DIR: p.core.to_json(), REDAE_DIR: p.redae.to_json()}
    for sub, build in builds.items():
        t0 = time.perf_counter()
        n = write_network(tmp / sub, build, cfgs[sub], p.init_std_scale, dtype, int(shard_gb * 1e9),
                          p.stop_bias if sub == CORE_DIR else None, progress)  # fmt: skip
        progress(f"{sub}: {n / 1e9:.2f} B parameters written in {time.perf_counter() - t0:.0f} s")
    campp = random_campp(p)
    (tmp / CAMPP_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_campp(campp, tmp / CAMPP_FILE)
    write_tiny_tokenizer(tmp / TOKENIZER_DIR)
    os.replace(tmp, out)
    return out


def full_checkpoint(dtype: str = "float32", stop: bool = True, progress=lambda s: None) -> Path:
    """The full preset's Base checkpoint in ``cache/full_size/`` (``stop`` False: a stop head that never
    fires, every utterance exactly ``max_patches`` long, for ``bench.ceiling --preset full``), written on
    first use."""
    ckpt = CACHE / f"checkpoint-{dtype}{'' if stop else '-nostop'}-layout{LAYOUT}"
    if not (ckpt / TOKENIZER_DIR / "tokenizer.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        write_checkpoint(ckpt, PRESETS["full"] if stop else nostop("full"), dtype=getattr(torch, dtype),
                         progress=progress)  # fmt: skip
    return ckpt


def checkpoint_bytes(preset: str = "full", dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes of each network's weights in ``dtype`` (meta device: nothing allocated)."""
    p = PRESETS[preset]
    with torch.device("meta"):
        sizes = {sub: count_parameters(build()) * dtype.itemsize for sub, build in networks(p).items()}
        redae = RedAE(p.redae)
    sizes["encoder"] = count_parameters(redae.encoder) * dtype.itemsize
    sizes["decoder"] = count_parameters(redae.decoder) * dtype.itemsize
    return sizes


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def need_for_serving(sizes: dict[str, int], kv_gib: float) -> int:
    """Memory the server needs at its peak on CPU (float32): the generator's core and KV pool; the prompt
    encoder and the vocoder each read the whole RedAE file before keeping their half (Triton loads the models
    at once); 4 GiB for the processes' own runtime (tritonserver, 5 Python stubs with torch, the gateway)."""
    return sizes[CORE_DIR] + int(kv_gib * GIB) + 2 * sizes[REDAE_DIR] + 4 * GIB


def refuse_if_short(need: int, what: str) -> None:
    have = available_bytes()
    print(f"memory: {what} needs about {need / 1e9:.1f} GB; {have / 1e9:.1f} GB available", file=sys.stderr)
    if have < need:
        raise SystemExit(
            f"refusing: {what} needs about {need / 1e9:.1f} GB of free memory and this machine has "
            f"{have / 1e9:.1f} GB available (MemAvailable; no swap is assumed). Stop other work or use a larger machine."
        )


# --- serving it ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def label(pid: int) -> str | None:
    """What a process of the server is: tritonserver, a model's stub, the gateway, the launcher."""
    try:
        cmd = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")).decode(errors="replace")
    except OSError:
        return None
    if "triton_python_backend_stub" in cmd:
        m = re.search(r"model_repository/([A-Za-z_]+)", cmd)
        return f"stub: {m.group(1) if m else '?'}"
    if "tritonserver" in cmd.split(" ", 1)[0]:
        return "tritonserver"
    if "gateway" in cmd:
        return "gateway"
    if "serving.serve" in cmd:
        return "launcher"
    return None


def rss(pid: int) -> tuple[int, int]:
    """Resident bytes of ``pid``: (private: RssAnon + RssShmem, file-mapped: RssFile). On CPU the float32
    weights stay views of the mmapped safetensors files: file-mapped pages, read on first use, shared by
    every process that maps the same file, given back (and re-read) under memory pressure."""
    got = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return got.get("RssAnon", 0) + got.get("RssShmem", 0), got.get("RssFile", 0)


class MemoryWatch:
    """Samples the RSS of every process under ``pid`` every second: the peak and the latest, by label, and
    the lowest MemAvailable."""

    def __init__(self, pid: int):
        self.pid, self.peak, self.now, self.low = pid, {}, {}, available_bytes()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def sample(self) -> dict[str, tuple[int, int]]:
        now: dict[str, tuple[int, int]] = {}
        for p in descendants(self.pid):
            name = label(p)
            if name:
                a, f = now.get(name, (0, 0))
                b, g = rss(p)
                now[name] = (a + b, f + g)
        return now

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.now = self.sample()
            self.low = min(self.low, available_bytes())
            for k, (a, f) in self.now.items():
                self.peak[k] = max(self.peak.get(k, 0), a + f)


def load_times(log: str) -> dict[str, tuple[float, float]]:
    """Each model's (start, ready) in seconds after tritonserver's first log line, from its log."""

    def at(line: str) -> float:
        t = re.match(r"[IWE]\d{4} (\d+):(\d+):([\d.]+)", line)
        return int(t[1]) * 3600 + int(t[2]) * 60 + float(t[3]) if t else math.nan

    lines = [ln for ln in log.splitlines() if re.match(r"[IWE]\d{4} ", ln)]
    t0 = at(lines[0]) if lines else 0.0
    start, done = {}, {}
    for ln in lines:
        if m := re.search(r'"loading: ([\w-]+):\d+"', ln):
            start[m[1].split("-")[0]] = at(ln) - t0
        elif m := re.search(r"\"successfully loaded '([\w-]+)'\"", ln):
            done[m[1].split("-")[0]] = at(ln) - t0
    return {k: (start[k], done[k]) for k in done if k in start}


def speech_request(port: int, text: str, max_patches: int, timeout: float) -> tuple[float, float, float, None]:
    """POST /v1/audio/speech (streamed 24 kHz 16-bit PCM): seconds to the first audio bytes, to the end,
    seconds of audio, no error."""
    body = json.dumps({"input": text, "voice": "default", "response_format": "pcm", "max_patches": max_patches,
                       "seed": 7}).encode()  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/audio/speech", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    first, n = None, 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        while chunk := r.read1(65536):
            first = first if first is not None else time.perf_counter() - t0
            n += len(chunk)
    return first if first is not None else math.nan, time.perf_counter() - t0, n / 2 / 24000, None


def serve_and_measure(ckpt: Path, args: argparse.Namespace, sizes: dict[str, int]) -> list[str]:
    from bench.load import one_stream
    from client import TTSClient

    work = CACHE / "run"
    ports = {k: free_port() for k in ("http", "grpc", "metrics", "openai")}
    cmd = [sys.executable, "-m", "serving.serve", "--checkpoint", str(ckpt), "--models", "base",
           "--slots", str(args.slots), "--kv-memory-gb", str(args.kv_gib), "--work-dir", str(work),
           "--voice-dir", str(CACHE / "voices"), "--state-dir", str(CACHE / "state"),
           "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
           "--metrics-port", str(ports["metrics"]), "--openai-port", str(ports["openai"])]  # fmt: skip
    print("$ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    work.mkdir(parents=True, exist_ok=True)
    before = set(work.glob("*/tritonserver.log"))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watch = MemoryWatch(proc.pid)
    out: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            out.append(line)
            print(f"  [serve +{time.perf_counter() - t0:5.0f} s] {line.rstrip()}", file=sys.stderr, flush=True)
            if line.startswith("ready:"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        while not ready.wait(15):
            if proc.poll() is not None:
                raise SystemExit(f"the launcher exited with status {proc.returncode} before it was ready")
            if time.perf_counter() - t0 > args.ready_timeout:
                raise SystemExit(f"not ready after {args.ready_timeout:.0f} s")
            mem = ", ".join(f"{k} {sum(v) / GIB:.1f}" for k, v in sorted(watch.now.items()))
            avail = available_bytes() / 1e9
            print(f"  ... loading, {time.perf_counter() - t0:.0f} s; RSS GiB: {mem}; {avail:.1f} GB available",
                  file=sys.stderr, flush=True)  # fmt: skip
            if avail < 0.8:
                raise SystemExit(f"stopping: only {avail:.1f} GB available while loading")
        t_ready = time.perf_counter() - t0
        at_ready = watch.sample()
        client = TTSClient(f"127.0.0.1:{ports['grpc']}", timeout=args.request_timeout)
        params = {"parameters": {"max_patches": args.patches}}
        runs = []
        for path in ("tritonserver, gRPC (tritonclient), first request", "tritonserver, gRPC (tritonclient), again",
                     "gateway, POST /v1/audio/speech (pcm)"):  # fmt: skip
            print(f"request: {path} ...", file=sys.stderr, flush=True)
            if path.startswith("gateway"):
                try:
                    runs.append((path, *speech_request(ports["openai"], args.text, args.patches, args.request_timeout)))
                except Exception as e:
                    runs.append((path, math.nan, math.nan, 0.0, f"{type(e).__name__}: {e}"))
            else:
                r = one_stream(client, args.text, seed=7, request=params)
                runs.append((path, r.first_chunk or math.nan, r.total, r.audio, r.error))
            print(f"  {runs[-1]}", file=sys.stderr, flush=True)
        after = watch.sample()
    finally:
        watch.stop.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    logs = sorted(set(work.glob("*/tritonserver.log")) - before)
    log = logs[-1].read_text(errors="replace") if logs else ""
    return report(args, sizes, t_ready, load_times(log), at_ready, after, watch, log + "".join(out), runs, cmd)


def report(args, sizes, t_ready, loads, at_ready, after, watch, log, runs, cmd) -> list[str]:
    kv = next((m[1] for m in re.finditer(r"(KV cache: [^\n]*)", log)), "KV cache: (not in the log)")

    def mem(d: dict, key: str) -> str:
        a, f = d.get(key, (0, 0))
        return f"{a / GIB:.2f} + {f / GIB:.2f}"

    lines = [
        f"- machine: {platform.node()}, {os.cpu_count()} CPUs, {_total_ram() / 1e9:.0f} GB RAM, no GPU, torch "
        f"{torch.__version__}, {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; checkpoint: full preset, random "
        f"weights, float32, Base only ({sizes[CORE_DIR] / 1e9:.2f} GB core + {sizes[REDAE_DIR] / 1e9:.2f} GB RedAE)",
        f"- `{' '.join(['python', *cmd[1:]]).replace(str(ROOT) + '/', '')}`",
        f"- launcher `ready:` after {t_ready:.0f} s; lowest MemAvailable during the run {watch.low / 1e9:.1f} GB; "
        f"1-min load average {args.load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other work on the "
        "machine slows every time)",
        f"- generator: `{kv}`",
        "",
        "| model | loading (s after tritonserver starts) | time to ready (s) | RSS at ready (GiB, private + "
        "file-mapped) | RSS after the requests | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for name in sorted(set(loads) | {k.removeprefix("stub: ") for k in at_ready if k.startswith("stub: ")}):
        s, d = loads.get(name, (math.nan, math.nan))
        key = f"stub: {name}"
        lines.append(f"| {name} | {s:.1f} -> {d:.1f} | {d - s:.1f} | {mem(at_ready, key)} | {mem(after, key)} "
                     f"| {watch.peak.get(key, 0) / GIB:.2f} |")  # fmt: skip
    for name in ("tritonserver", "gateway", "launcher"):
        lines.append(f"| ({name} process) | | | {mem(at_ready, name)} | {mem(after, name)} "
                     f"| {watch.peak.get(name, 0) / GIB:.2f} |")  # fmt: skip
    total = {k: tuple(sum(v[i] for v in d.values()) for i in (0, 1)) for k, d in (("r", at_ready), ("a", after))}
    lines.append(f"| all processes | | | {mem(total, 'r')} | {mem(total, 'a')} | |")
    lines += [
        "",
        f"One request at a time, max_patches {args.patches} ({args.patches * 0.16:.2f} s of audio), "
        f"text {args.text!r}, the default voice:",
        "",
        "| path | first audio (s) | total (s) | audio (s) |",
        "|---|---|---|---|",
    ]
    for path, first, total_s, audio, error in runs:
        lines.append(f"| {path} | {first:.1f} | {total_s:.1f} | {audio:.2f} |" + (f" failed: {error}" if error else ""))
    return lines


def _total_ram() -> int:
    return int(Path("/proc/meminfo").read_text().split()[1]) * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.full_size", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="file dtype (float32: the release's; the CPU path runs float32 either way)")  # fmt: skip
    ap.add_argument("--slots", type=int, default=2, help="the server's --slots (default 2)")
    ap.add_argument("--kv-gib", type=float, default=0.5, help="the server's --kv-memory-gb (default 0.5)")
    ap.add_argument("--patches", type=int, default=6, help="max_patches of the request (default 6 = 0.96 s)")
    ap.add_argument("--text", default="Hello from the full model.")
    ap.add_argument("--ready-timeout", type=float, default=1800.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--write-only", action="store_true", help="write the checkpoint, do not serve it")
    ap.add_argument("--nostop", action="store_true",
                    help="a stop head that never fires (the checkpoint bench.ceiling --preset full serves)")  # fmt: skip
    ap.add_argument("--out", type=Path, help="write the table here too")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    sizes = checkpoint_bytes("full", torch.float32)  # what the server holds on CPU, whatever the file dtype
    stop = not args.nostop
    ckpt = CACHE / f"checkpoint-{args.dtype}{'' if stop else '-nostop'}-layout{LAYOUT}"
    if (ckpt / TOKENIZER_DIR / "tokenizer.json").is_file():
        print(f"checkpoint: {ckpt} (written before)", file=sys.stderr)
    else:
        free = shutil.disk_usage(CACHE.parent if CACHE.parent.exists() else ROOT).free
        disk = (sizes[CORE_DIR] + sizes[REDAE_DIR]) * dtype.itemsize // 4
        if free < disk + 2e9:
            raise SystemExit(f"refusing: the checkpoint takes {disk / 1e9:.1f} GB on disk, {free / 1e9:.1f} GB free")
        refuse_if_short(int(2 * 2.0e9 * max(1, dtype.itemsize / 4)) + 2 * GIB, "writing the checkpoint (2 GB shards)")
        print(f"writing the full preset ({args.dtype}, {disk / 1e9:.1f} GB) to {ckpt} ...", file=sys.stderr)
        t0 = time.perf_counter()
        full_checkpoint(args.dtype, stop, progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(f"written in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.write_only:
        return 0
    refuse_if_short(need_for_serving(sizes, args.kv_gib), "serving the full preset on CPU (float32)")
    args.load_before = os.getloadavg()[0]
    lines = serve_and_measure(ckpt, args, sizes)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
