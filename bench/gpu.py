"""GPU serving check, in-process: ``bench/gpu.sh`` (or ``python -m bench.gpu``).

For a CUDA machine with PyTorch, no internet and no tritonserver needed; fits in a few minutes:

1. builds the ``full`` preset with random weights directly on the GPU (no checkpoint files), in the
   per-network dtypes of :func:`engine.checkpoint.precision_policy`;
2. checks the GPU against CPU float32 on the ``small`` preset: SNR of generated latents and of audio;
3. times the batched generator step (backbone decode + stop head + flow head with CFG) at 1, 16, 64
   and 256 streams mid-way through a typical utterance, with SDPA and, where it imports, FlashInfer:
   ms per step, real-time factor, streams sustained in real time, peak GPU memory;
4. counts the host syncs of each generator step for 16 streams (:mod:`bench.step_syncs`; budget one,
   the stop decision), with :class:`bench.device_audit.DeviceAudit` and with CUDA's sync debug mode,
   and the bytes the host receives; ``--syncs-only`` and the meta count also step 16 Instruct streams,
   half in their text phase (one more read: the picked ids, 8 bytes a text row);
5. prints one markdown table. A step that fails prints what failed and the run goes on.

``--smoke`` runs the same on the ``tiny`` preset with 1 and 2 streams (on CPU when there is no GPU), in
seconds; there the syncs are counted on the meta device, in the CUDA precision policy. ``--syncs-only``
counts only the syncs (``--device cpu``: the preset on the meta device). ``--triton`` also runs the
open-loop ceiling through a real tritonserver on the same device where one exists (the NGC image's, or the
``nvidia-pytriton`` wheel's): ``python -m bench.ceiling --real --preset full`` (the networks step, not
``--synthetic-math``; Poisson arrivals at 4 to 64 requests/s), on the full preset's checkpoint that
:mod:`bench.full_size` writes on the CPU while the GPU is timed; the timed points then stop at 150 s so
that all of it fits the script's 8 minutes (``--smoke --triton``: the tiny preset on CPU, in seconds).
Past 300 lines on purpose: one GPU check (bench/gpu.sh), whose stages (agreement, step times, host syncs,
Triton) share the random-weight model and its device set-up, and end in one table.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.step_syncs import describe, instruct_step_syncs, planned, step_syncs
from engine.checkpoint import Models, RedAE, count_parameters, precision_policy
from engine.config import PATCH_SAMPLES, PRESETS
from engine.fireredtts3 import FireRedTTS3
from engine.kv_cache import capacity_line, pages_for, typical_positions
from engine.layers.attention import select_attention
from engine.models.campp import CamppConfig, SpeakerEncoder
from engine.models.core import FireRedTTS3Core
from engine.params import MAX_PATCHES, GenerationParams
from engine.prompt import VoicePrompt
from engine.protocol import SAMPLE_RATE
from engine.random_checkpoint import randomize

PATCH_MS = 1000 * PATCH_SAMPLES / SAMPLE_RATE  # 160 ms of audio per stream per step


def random_model(
    preset: str, device, dtype=None, seed: int = 0, campp: bool = False, instruct: bool = False
) -> FireRedTTS3:
    """``preset``'s networks with random weights (the checkpoint writer's init), built on ``device`` in
    the per-network dtypes; stop heads that never fire. No tokenizer, nothing written; CAM++ (float32)
    only with ``campp``, the Instruct core too with ``instruct``. ``device`` may be ``meta``: shapes and
    dtypes without data."""
    p = PRESETS[preset]
    device = torch.device(device)
    torch.manual_seed(seed)
    with device:
        core, redae = FireRedTTS3Core(p.core), RedAE(p.redae)
        second = FireRedTTS3Core(p.instruct) if instruct else None
        c = p.campp
        speaker = SpeakerEncoder(
            CamppConfig(
                embedding_size=p.core.spk_in_dim, m_channels=c.m_channels, init_channels=c.init_channels,
                growth_rate=c.growth_rate, bn_size=c.bn_size, block_layers=c.block_layers,
            )
        ) if campp else None  # fmt: skip
    for m in (core, redae, speaker, second):
        if m is not None:
            randomize(m, p.init_std_scale if m is not speaker else 1.0)
    with torch.no_grad():
        for c in (core, second):
            if c is not None:
                c.stop_head.bias.fill_(-30.0)
    return _wrap(core, redae, device, dtype, f"random {preset}", speaker, second)


def _wrap(core, redae, device, dtype, name, campp=None, instruct=None) -> FireRedTTS3:
    policy = precision_policy(device, dtype)
    for c in (core, instruct):
        if c is not None:
            c.to(device, policy["core"]).backbone_llm.to(policy["backbone"])
    redae.encoder.to(device, policy["encoder"])
    redae.decoder.to(device, policy["decoder"])
    for m in (core, redae, campp, instruct):
        if m is not None:
            m.eval().requires_grad_(False)
    models = Models(core, redae, campp, None, name, Path("."), instruct)
    return FireRedTTS3(models, device, policy["backbone"], policy)


def moved(model: FireRedTTS3, device, dtype=None) -> FireRedTTS3:
    """The same weights on another device, in that device's per-network dtypes."""
    core, redae = copy.deepcopy(model.core), copy.deepcopy(model.models.redae)
    return _wrap(core, redae, torch.device(device), dtype, model.identity)


def typical_stream(model: FireRedTTS3, seed: int) -> tuple[list[int], VoicePrompt]:
    """Random text tokens and prompt of a typical stream's sizes, its context already mid-utterance
    (the text stands in for half the speech patches)."""
    prefix, speech = typical_positions()
    ref_patches = math.ceil(SAMPLE_RATE / PATCH_SAMPLES * 10)
    n_tokens = prefix - 1 - ref_patches + speech // 2
    g = torch.Generator().manual_seed(seed)
    vocab = model.core.cfg.backbone.vocab_size
    tokens = torch.randint(0, vocab, (n_tokens,), generator=g).tolist()
    lat = torch.randn(4 * ref_patches, model.core.cfg.redae_dim, generator=g)
    spk = torch.randn(model.core.cfg.spk_in_dim, generator=g)
    return tokens, VoicePrompt(lat, spk, "")


def snr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double().cpu(), got.double().cpu()
    err = (ref - got).pow(2).sum().item()
    return float("inf") if err == 0 else 10 * math.log10(ref.pow(2).sum().item() / err)


@torch.inference_mode()
def generate(model: FireRedTTS3, patches: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """One stream of ``patches`` patches -> (latents (4N, 64), audio of prompt + latents), on CPU."""
    tokens, prompt = typical_stream(model, seed)
    gen = model.generator(1, len(tokens) + 1 + prompt.num_patches + patches, attention="sdpa")
    s = gen.new_stream(0, tokens, prompt, GenerationParams(seed=seed, min_patches=patches, max_patches=patches))
    step = planned(gen, [s])
    out = []
    while not s.finished:
        r = step([s])[0]
        if r.latents is not None:
            out.append(r.latents)
    lat = torch.cat(out).float().cpu()
    return lat, decode(model, torch.cat([prompt.latents, lat]))


@torch.inference_mode()
def decode(model: FireRedTTS3, latents: torch.Tensor) -> torch.Tensor:
    x = latents[None].to(model.device, model.dtypes["decoder"])
    return model.models.redae.decoder(x)[0].float().cpu()


def agreement(preset: str, device, patches: int) -> list[str]:
    """GPU (per-network dtypes) vs CPU float32, same weights and seeds."""
    cpu = random_model(preset, "cpu")
    dev = moved(cpu, device)
    lat_c, audio_c = generate(cpu, patches)
    lat_g, audio_g = generate(dev, patches)
    first = snr_db(lat_c[:4], lat_g[:4])
    decoder_only = snr_db(audio_c, decode(dev, torch.cat([typical_stream(cpu, 7)[1].latents, lat_c])))
    line = (
        f"agreement, {preset} preset, {device} ({_dtypes(dev)}) vs CPU float32, {patches} patches: "
        f"first patch latents SNR {first:.1f} dB, all latents {snr_db(lat_c, lat_g):.1f} dB, "
        f"audio {snr_db(audio_c, audio_g):.1f} dB; the decoder alone on the CPU's latents {decoder_only:.1f} dB"
    )
    return [line]


def _dtypes(model: FireRedTTS3) -> str:
    return ", ".join(f"{k} {str(v).removeprefix('torch.')}" for k, v in model.dtypes.items())


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_steps(model: FireRedTTS3, n: int, attention: str, steps: int, flow_steps: int) -> dict:
    """n typical streams through one generator: prefill all, then ``steps`` timed batched steps."""
    dev = model.device
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    tokens, prompt = typical_stream(model, 1)
    total = steps + 4
    max_len = 1 + len(tokens) + prompt.num_patches + total
    gen = model.generator(n, max_len, attention=attention)
    params = GenerationParams(seed=0, steps=flow_steps, min_patches=total, max_patches=total)
    streams = [gen.new_stream(i, tokens, prompt, params) for i in range(n)]
    step = planned(gen, streams)
    _sync(dev)
    t0 = time.perf_counter()
    step(streams)  # every stream's prefill (one at a time), then its first patch
    _sync(dev)
    prefill = time.perf_counter() - t0
    for _ in range(2):  # warm-up
        step(streams)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(streams)
    _sync(dev)
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated(dev) / (1 << 30) if dev.type == "cuda" else float("nan")
    return {
        "prefill_ms": 1000 * prefill / n, "step_ms": step_ms, "peak_gib": peak, "used": gen.attention,
        "reason": gen.attention_fallback_reason, "context": streams[0].position,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    """x real time: seconds of audio each stream gets per second (>= 1 keeps up); audio s/s: all streams'."""
    head = "| attention | streams | context | prefill ms/stream | step ms | x real time | audio s/s | peak GPU GiB | note |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['attention']} | {r['streams']} | | | | | | | failed: {r['error']} |")
            continue
        rt = PATCH_MS / r["step_ms"]
        note = f"ran {r['used']}" + (f" ({r['reason']})" if r["reason"] else "") + ("" if rt >= 1 else "; falls behind")
        peak = "-" if math.isnan(r["peak_gib"]) else f"{r['peak_gib']:.2f}"
        lines.append(
            f"| {r['attention']} | {r['streams']} | {r['context']} | {r['prefill_ms']:.1f} | {r['step_ms']:.1f} "
            f"| {rt:.2f} | {r['streams'] * rt:.1f} | {peak} | {note} |"
        )
    return "\n".join(lines)


def attention_choices(device, dtype, head_dim) -> tuple[list[str], str]:
    """The backends to time: SDPA always, FlashInfer where it would be used (else why not)."""
    c = select_attention("auto", device, dtype, head_dim)
    return (["sdpa", "flashinfer"] if c.name == "flashinfer" else ["sdpa"]), c.reason


def sync_lines(model: FireRedTTS3, kinds: list[str], n: int, flow_steps: int = 10) -> list[str]:
    """Host syncs per generator step for ``n`` typical streams, per attention path; ``model`` on CUDA, or
    on the meta device in the CUDA precision policy (what a GPU would do, counted without one; with two
    Euler steps, as every op on meta costs Python time)."""
    tokens, prompt = typical_stream(model, 1)
    meta = model.device.type == "meta"
    where = str(model.device) + (", the CUDA precision policy" if meta else "")
    kinds = ["sdpa"] if meta else kinds  # FlashInfer has no meta kernels
    flow_steps = 2 if meta else flow_steps
    lines = [describe(step_syncs(model, tokens, prompt, n, a, flow_steps=flow_steps), n, a, where) for a in kinds]
    if model.models.instruct is not None:  # as many streams again, half in Instruct's text phase
        counts = instruct_step_syncs(model, tokens, n // 2, n - n // 2, kinds[0], flow_steps=flow_steps)
        lines.append(describe(counts, n, kinds[0], where, text_rows=n // 2))
    return lines


# bench/gpu.sh --triton in its 8 minutes (GPU_BENCH_TIMEOUT): the timed points stop starting after this, the
# ceiling (checkpoint written meanwhile, server start, 5 rates of 15 s) is cut off at the end
TRITON_TIMED_BUDGET_S, TRITON_END_S = 150, 465


def ceiling_command(device: str, smoke: bool) -> list[str]:
    """The open-loop ceiling of the real networks (``bench.ceiling --real``): the full preset on ``device``
    (Poisson arrivals, rates 4 to 64 requests/s, 15 s each, judged by the headline's rule: no underrun and
    first audio p95 within 4 steps + 200 ms), or the tiny one in seconds with ``smoke``."""
    if smoke:
        sizes = ["--preset", "tiny", "--slots", "4", "--start", "1", "--rate-start", "1", "--rate-max", "1", "--duration", "2",
                 "--patches", "4", "--bisect", "0"]  # fmt: skip
    else:
        sizes = ["--preset", "full", "--slots", "256", "--rate-start", "4", "--rate-max", "64", "--duration", "15",
                 "--drain-timeout", "30", "--patches", "48", "--bisect", "1", "--first-audio-rule"]  # fmt: skip
    return [sys.executable, "-m", "bench.ceiling", "--real", "--device", device, *sizes]


def triton_ceiling(args, device: str, writer: subprocess.Popen | None, t_start: float) -> str:
    """Runs :func:`ceiling_command` through a real tritonserver (its table goes to stdout, above this
    run's); the line to report. Without a tritonserver, says so."""
    try:
        from serving.supervision.triton_env import find_triton

        find_triton(Path(tempfile.mkdtemp(prefix="triton-probe-")))
    except Exception as e:
        if writer is not None:
            writer.kill()
        return f"--triton: no tritonserver ({e}); skipped"

    def left() -> float:
        return TRITON_END_S - (time.perf_counter() - t_start)

    if writer is not None:
        try:
            if writer.wait(timeout=max(1.0, left())) != 0:
                return f"--triton: writing the full checkpoint (python -m bench.full_size) exited {writer.returncode}"
        except subprocess.TimeoutExpired:
            writer.kill()
            return "--triton: the full checkpoint was not written in the time budget; skipped"
    cmd = ceiling_command(device, args.smoke)
    shown = " ".join(cmd[1:])
    print(f"--triton: {shown} ({left():.0f} s left)", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd)
    try:
        code = proc.wait(timeout=None if args.smoke else max(30.0, left()))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the ceiling stops its tritonserver on the way out
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        return f"--triton: `{shown}` cut off at the time budget (its levels so far are in its progress above)"
    return f"--triton: `{shown}` exited {code} (its ceiling and table are above)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny preset, 1 and 2 streams, CPU if no GPU (seconds)")
    ap.add_argument("--device", default=None, help="default: cuda if available (else cpu with --smoke)")
    ap.add_argument("--preset", default=None, help="timed preset (default full; tiny with --smoke)")
    ap.add_argument("--check-preset", default=None, help="GPU-vs-CPU agreement preset (default small; tiny)")
    ap.add_argument("--streams", default=None, help="stream counts (default 1,16,64,256; 1,2 with --smoke)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point (default 10; 2)")
    ap.add_argument("--flow-steps", type=int, default=10, help="Euler steps of the flow head")
    ap.add_argument("--budget-s", type=float, default=420, help="points not started by then are skipped")
    ap.add_argument(
        "--syncs-only",
        action="store_true",
        help="only count host syncs per generator step (seconds; on CPU: the preset on the meta device)",
    )
    ap.add_argument(
        "--triton",
        action="store_true",
        help="also the open-loop ceiling of the full preset's real networks through a real tritonserver on this "
        "device (python -m bench.ceiling --real; its checkpoint written meanwhile; tiny preset with --smoke)",
    )
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device (use --smoke to run on CPU)")
    if not device.startswith("cuda") and not (args.smoke or args.syncs_only):
        ap.error("this benchmark is for a CUDA machine; --smoke runs it on CPU")
    writer = None
    # --triton: the ceiling's checkpoint, written on the CPU while the GPU is timed
    if args.triton and not args.smoke and not args.syncs_only:
        writer = subprocess.Popen([sys.executable, "-m", "bench.full_size", "--write-only", "--nostop"])
        args.budget_s = min(args.budget_s, TRITON_TIMED_BUDGET_S)
    preset = args.preset or ("tiny" if args.smoke else "full")
    check = args.check_preset or ("tiny" if args.smoke else "small")
    streams = [int(x) for x in (args.streams or ("1,2" if args.smoke else "1,16,64,256")).split(",")]
    steps = args.steps or (2 if args.smoke else 10)
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # the CPU smoke run: small shapes, where threads only contend

    info = [f"torch {torch.__version__}, python {platform.python_version()}, device {device}"]
    if device.startswith("cuda"):
        info[0] += (
            f" ({torch.cuda.get_device_name(device)}, {torch.cuda.get_device_properties(device).total_memory / (1 << 30):.0f} GiB)"
        )
    if args.syncs_only:
        where = "meta" if device == "cpu" else device
        model = random_model(preset, where, dtype=precision_policy("cuda"), instruct=True)
        kinds = attention_choices(device, model.dtype, model.core.cfg.backbone.head_dim)[0]
        lines = info + sync_lines(model, kinds, min(16, max(streams)), args.flow_steps)
        print("\n".join(f"- {line}" for line in lines))
        return 1 if any("OVER BUDGET" in line for line in lines) else 0
    try:
        info += agreement(check, device, patches=4 if args.smoke else 12)
    except Exception as e:
        info.append(f"agreement check failed: {type(e).__name__}: {e}")
        traceback.print_exc()

    rows: list[dict] = []
    try:
        t0 = time.perf_counter()
        model = random_model(preset, device)
        _sync(device)
        bb = model.core.cfg.backbone
        info.append(
            f"{preset} preset built on {device} with random weights in {time.perf_counter() - t0:.1f} s: "
            f"{count_parameters(model.core) / 1e6:.0f} M core parameters ({_dtypes(model)})"
        )
        kinds, reason = attention_choices(device, model.dtype, bb.head_dim)
        if reason:
            info.append(f"FlashInfer not timed: {reason}")
        else:
            import flashinfer

            info.append(f"flashinfer {getattr(flashinfer, '__version__', '?')}")
        for attention in kinds:
            for n in streams:
                if time.perf_counter() - t_start > args.budget_s:
                    rows.append({"attention": attention, "streams": n, "error": "skipped (time budget)"})
                    continue
                try:
                    rows.append(
                        {
                            "attention": attention,
                            "streams": n,
                            **time_steps(model, n, attention, steps, args.flow_steps),
                        }
                    )
                except Exception as e:
                    print(f"{attention}, {n} streams failed:", file=sys.stderr)
                    traceback.print_exc()
                    rows.append({"attention": attention, "streams": n, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                print(f"{attention} x {n}: done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        # the pool of a server with max(streams) slots of 2,048 positions (arithmetic: 56 GiB at 256 streams)
        pages = max(streams) * pages_for(2048)
        dtype = model.core.backbone_llm.norm.weight.dtype
        info.append(capacity_line(bb, dtype, pages, max(streams), MAX_PATCHES.default))
        try:
            cuda = model if device.startswith("cuda") else None  # the timed model: Base only
            cuda = cuda or random_model(preset, "meta", dtype=precision_policy("cuda"), instruct=True)
            info += sync_lines(cuda, kinds, min(16, max(streams)), args.flow_steps)
        except Exception as e:  # a report, not a reason to lose the table
            info.append(f"host sync count failed: {type(e).__name__}: {e}")
            traceback.print_exc()
    except Exception as e:
        info.append(f"building or timing the {preset} preset failed: {type(e).__name__}: {e}")
        traceback.print_exc()

    if args.triton:  # the NGC image's /opt/tritonserver, or the nvidia-pytriton wheel's
        info.append(triton_ceiling(args, device, writer, t_start))
    print()
    for line in info:
        print(f"- {line}")
    print(f"- {steps} timed steps per point after 2 warm-up steps, flow head {args.flow_steps} Euler steps with CFG; "
          f"a step makes {PATCH_MS:.0f} ms of audio per stream; {time.perf_counter() - t_start:.0f} s in all")  # fmt: skip
    print()
    print(table(rows))
    return 0 if rows and not any("error" in r and "budget" not in r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
