"""The agent frameworks' own Cartesia plugins, unchanged, against this gateway's ``/tts/websocket``: one LLM-like
reply streamed token by token at a typical rate, through LiveKit's ``cartesia.TTS`` and Pipecat's
``CartesiaTTSService``; prints a table of what each got (frames, sample rate, audio seconds, words back,
errors) and, per sentence, the time from its last token to the first audio after it. ``--barge-in``: each
plugin's own interruption mid-reply (LiveKit closes the stream, Pipecat sends a cancel), then a second
turn on the same TTS object; with ``--metrics``, the server's slot and page gauges once both are done.

Not part of the test suite, and not of this project's dependencies: run it in a throwaway venv that has
the plugins (and nothing of this repository), against a running gateway::

    python -m venv /tmp/agents && /tmp/agents/bin/pip install livekit-plugins-cartesia==1.8.9 \\
        "pipecat-ai[cartesia]==1.14.0"
    /tmp/agents/bin/python bench/agent_plugins.py --gateway http://127.0.0.1:8080

It imports only the standard library and the plugins.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from importlib.metadata import version

REPLY = "Hello there, how are you today? I can help you change your booking. What date suits you? "


def tokens(text: str) -> list[str]:
    """Word-sized tokens with their leading spaces, as an LLM streams them."""
    words = text.split(" ")
    return [w if i == 0 else f" {w}" for i, w in enumerate(words) if w or i == 0]


class Timeline:
    """When each sentence's last token went out and when audio came back."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.sentence_ends: list[float] = []
        self.audio: list[float] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def first_audio_after_each_sentence(self) -> list[float]:
        out = []
        for end in self.sentence_ends:
            later = [t for t in self.audio if t >= end]
            out.append(round(later[0] - end, 3) if later else float("nan"))
        return out


async def feed(push, timeline: Timeline, rate: float) -> None:
    for token in tokens(REPLY):
        await push(token)
        if token.rstrip().endswith((".", "?", "!")):
            timeline.sentence_ends.append(timeline.now())
        await asyncio.sleep(1 / rate)


async def livekit(gateway: str, rate: float, sample_rate: int) -> dict:
    import aiohttp
    from livekit.plugins import cartesia

    result = {"plugin": f"livekit-plugins-cartesia {version('livekit-plugins-cartesia')}", "errors": []}
    timeline, frames, rates, samples = Timeline(), 0, set(), 0
    async with aiohttp.ClientSession() as session:
        tts = cartesia.TTS(base_url=gateway, api_key="unused", voice="default", sample_rate=sample_rate,
                           http_session=session)  # fmt: skip
        stream = tts.stream()

        async def push(token: str) -> None:
            stream.push_text(token)

        async def read() -> None:
            nonlocal frames, samples
            async for event in stream:
                frames += 1
                rates.add(event.frame.sample_rate)
                samples += event.frame.samples_per_channel
                timeline.audio.append(timeline.now())

        reader = asyncio.create_task(read())
        try:
            await feed(push, timeline, rate)
            stream.end_input()
            await reader
        except Exception as e:  # noqa: BLE001 (reported in the table)
            result["errors"].append(repr(e))
        finally:
            await stream.aclose()
    return result | {"frames": frames, "sample_rate": sorted(rates), "audio_s": round(samples / sample_rate, 2),
                     "first_audio_after_sentence_s": timeline.first_audio_after_each_sentence()}  # fmt: skip


async def pipecat(gateway: str, rate: float, sample_rate: int, token_mode: bool = False) -> dict:
    from pipecat.frames.frames import (
        EndFrame,
        ErrorFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
        TTSStoppedFrame,
        TTSTextFrame,
    )  # fmt: skip
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.cartesia.tts import CartesiaTTSService
    from pipecat.services.tts_service import TextAggregationMode

    mode = TextAggregationMode.TOKEN if token_mode else None  # TOKEN: each token a message, no buffer delay 0
    result = {"plugin": f"pipecat-ai {version('pipecat-ai')}" + (" TOKEN mode" if token_mode else ""), "errors": []}
    timeline, seen = Timeline(), {"frames": 0, "rates": set(), "samples": 0, "words": []}
    stopped = asyncio.Event()

    class Watch(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                seen["frames"] += 1
                seen["rates"].add(frame.sample_rate)
                seen["samples"] += len(frame.audio) // 2
                timeline.audio.append(timeline.now())
            elif isinstance(frame, TTSTextFrame):
                seen["words"].append(frame.text)
            elif isinstance(frame, ErrorFrame):
                result["errors"].append(frame.error)
            elif isinstance(frame, TTSStoppedFrame):
                stopped.set()
            await self.push_frame(frame, direction)

    tts = CartesiaTTSService(api_key="unused", url=gateway.replace("http", "ws", 1) + "/tts/websocket",
                             settings=CartesiaTTSService.Settings(voice="default"), text_aggregation_mode=mode)  # fmt: skip
    task = PipelineTask(Pipeline([Watch(), tts, Watch()]), params=PipelineParams(audio_out_sample_rate=sample_rate))

    async def push(token: str) -> None:
        await task.queue_frame(LLMTextFrame(token))

    async def drive() -> None:
        await task.queue_frame(LLMFullResponseStartFrame())
        await feed(push, timeline, rate)
        await task.queue_frame(LLMFullResponseEndFrame())
        try:
            await asyncio.wait_for(stopped.wait(), 120)
        except TimeoutError:
            result["errors"].append("no TTSStoppedFrame within 120 s")
        await task.queue_frame(EndFrame())

    await asyncio.gather(PipelineRunner(handle_sigint=False).run(task), drive())
    return result | {"frames": seen["frames"], "sample_rate": sorted(seen["rates"]),
                     "audio_s": round(seen["samples"] / sample_rate, 2), "words_back": len(seen["words"]),
                     "first_audio_after_sentence_s": timeline.first_audio_after_each_sentence()}  # fmt: skip


async def livekit_barge_in(gateway: str, rate: float, sample_rate: int) -> dict:
    """Turn 1 is closed at its first audio (LiveKit's interruption: SynthesizeStream.aclose), turn 2 plays out."""
    import aiohttp
    from livekit.plugins import cartesia

    result = {"plugin": f"livekit-plugins-cartesia {version('livekit-plugins-cartesia')} barge-in", "errors": []}
    async with aiohttp.ClientSession() as session:
        tts = cartesia.TTS(base_url=gateway, api_key="unused", voice="default", sample_rate=sample_rate,
                           http_session=session)  # fmt: skip
        first = tts.stream()
        for token in tokens(REPLY):
            first.push_text(token)
        first.flush()
        try:
            await anext(aiter(first))
            result["turn1"] = "interrupted at its first frame"
        except Exception as e:  # noqa: BLE001
            result["errors"].append(repr(e))
        await first.aclose()
        second, frames = tts.stream(), 0
        second.push_text("Sorry, go ahead. ")
        second.end_input()
        try:
            async for _ in second:
                frames += 1
        except Exception as e:  # noqa: BLE001
            result["errors"].append(repr(e))
        await second.aclose()
        await tts.aclose()
    return result | {"turn2_frames": frames}


async def pipecat_barge_in(gateway: str, rate: float, sample_rate: int) -> dict:
    """An InterruptionFrame at turn 1's first audio (Pipecat sends a cancel), then turn 2 plays out."""
    from pipecat.frames.frames import (
        EndFrame,
        ErrorFrame,
        InterruptionFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
        TTSStoppedFrame,
    )  # fmt: skip
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.cartesia.tts import CartesiaTTSService

    result = {"plugin": f"pipecat-ai {version('pipecat-ai')} barge-in", "errors": []}
    audio, stopped, frames = asyncio.Event(), asyncio.Event(), [0]

    class Watch(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                frames[0] += 1
                audio.set()
            elif isinstance(frame, ErrorFrame):
                result["errors"].append(frame.error)
            elif isinstance(frame, TTSStoppedFrame):
                stopped.set()
            await self.push_frame(frame, direction)

    tts = CartesiaTTSService(api_key="unused", url=gateway.replace("http", "ws", 1) + "/tts/websocket",
                             settings=CartesiaTTSService.Settings(voice="default"))  # fmt: skip
    task = PipelineTask(Pipeline([Watch(), tts, Watch()]), params=PipelineParams(audio_out_sample_rate=sample_rate))

    async def drive() -> None:
        await task.queue_frames([LLMFullResponseStartFrame(), LLMTextFrame(REPLY)])
        await asyncio.wait_for(audio.wait(), 60)
        await task.queue_frame(InterruptionFrame())
        frames[0], result["turn1"] = 0, "interrupted at its first frame"
        stopped.clear()
        await task.queue_frames([LLMFullResponseStartFrame(), LLMTextFrame("Sorry, go ahead."),
                                 LLMFullResponseEndFrame()])  # fmt: skip
        await asyncio.wait_for(stopped.wait(), 60)
        await task.queue_frame(EndFrame())

    await asyncio.gather(PipelineRunner(handle_sigint=False).run(task), drive())
    return result | {"turn2_frames": frames[0]}


def gauges(metrics_url: str) -> dict:
    """The server's slot and page gauges (Prometheus text)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    names = ("tts_generator_active_slots", "tts_kv_pages_in_use", "tts_vocoder_active_streams")
    return {line.split()[0]: float(line.split()[-1]) for line in lines if line.startswith(names)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateway", default="http://127.0.0.1:8080", help="the gateway's base URL")
    ap.add_argument("--tokens-per-second", type=float, default=30.0, help="how fast the reply's tokens are sent")
    ap.add_argument("--plugins", default="livekit,pipecat")
    ap.add_argument("--livekit-rate", type=int, default=24000, help="LiveKit's sample_rate (its default)")
    ap.add_argument("--pipecat-rate", type=int, default=16000, help="the Pipecat pipeline's output rate")
    ap.add_argument("--barge-in", action="store_true", help="interrupt the first turn at its first audio")
    ap.add_argument("--pipecat-token-mode", action="store_true", help="Pipecat sends each token as it comes")
    ap.add_argument("--metrics", help="the server's metrics URL: print its slot and page gauges at the end")
    args = ap.parse_args()
    token_mode = functools.partial(pipecat, token_mode=args.pipecat_token_mode)
    runs = {"livekit": (livekit, args.livekit_rate), "pipecat": (token_mode, args.pipecat_rate)}
    if args.barge_in:
        runs = {"livekit": (livekit_barge_in, args.livekit_rate), "pipecat": (pipecat_barge_in, args.pipecat_rate)}
    for name in args.plugins.split(","):
        fn, sample_rate = runs[name]
        row = asyncio.run(fn(args.gateway, args.tokens_per_second, sample_rate))
        print(" | ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    if args.metrics:
        time.sleep(1.0)  # a cancelled stream's slot is freed at the generator's next step
        print("gauges:", gauges(args.metrics))


if __name__ == "__main__":
    main()
