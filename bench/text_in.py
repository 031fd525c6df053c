"""Text in at an LLM's pace: one text-in stream against one request per sentence, as a listener hears them.

``python -m bench.text_in`` starts a server (``--preset``, its stop head never fires: each sentence is
``--patches`` patches long) or uses ``--url``, and writes the sentences of a reply word by word at
``--words-per-second`` (30 tokens/s is about 22 English words/s). Two ways to speak it:

- **text-in**: one stream (:meth:`client.AsyncTTSClient.open_text`), each sentence's last word flushed;
- **per sentence**: one whole-text request per sentence once its text is complete, one after another
  (what LiveKit's and Pipecat's ``StreamAdapter`` do for non-streaming TTS).

For each sentence: the time from the end of its text to its first audio; and, for a listener who starts
playing at the first chunk and plays every sample once it has it, the silence heard before the sentence
(the gap between sentences; the first sentence's is its start). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from client import AsyncTTSClient, Chunk, Flushed
from engine.protocol import SAMPLE_RATE

REPLY = (
    "Sure, I can help with that. The weather today is mild with a light breeze from the west. "
    "Expect some clouds in the afternoon and a chance of rain after six. "
    "Tomorrow looks brighter, so it is a good day for a walk. Anything else I can do for you?"
)


def sentences(text: str) -> list[list[str]]:
    """Each sentence as the words an LLM would send, each with its trailing space."""
    out, current = [], []
    for word in text.split():
        current.append(word + " ")
        if word.endswith((".", "?", "!")):
            out.append(current)
            current = []
    return out + ([current] if current else [])


def heard(arrivals: list[tuple[float, int, int]]) -> dict[int, float]:
    """(arrival time s, samples, sentence) per chunk, in order -> the silence a listener hears before each
    sentence's first sample: playback starts at the first chunk and never skips."""
    clock, gaps = None, {}
    for at, samples, sentence in arrivals:
        if clock is None:
            clock = at
        wait = max(0.0, at - clock)
        if sentence not in gaps:
            gaps[sentence] = wait
        clock = max(clock, at) + samples / SAMPLE_RATE
    return gaps


async def text_in(tts: AsyncTTSClient, words: list[list[str]], rate: float, fields: dict):
    ts = await tts.open_text(**fields)
    ends, arrivals, t0 = {}, [], time.perf_counter()

    async def write():
        for n, sentence in enumerate(words):
            for i, word in enumerate(sentence):
                await asyncio.sleep(1 / rate)
                await ts.send(word, flush=i == len(sentence) - 1)
            ends[n] = time.perf_counter() - t0
        await ts.end()

    writer = asyncio.ensure_future(write())
    sentence = 0
    async for item in ts:
        if isinstance(item, Flushed):
            sentence = item.n
        elif isinstance(item, Chunk):
            arrivals.append((time.perf_counter() - t0, item.audio.size, min(sentence, len(words) - 1)))
    await writer
    return ends, arrivals


async def per_sentence(tts: AsyncTTSClient, words: list[list[str]], rate: float, fields: dict):
    ends, arrivals, t0 = {}, [], time.perf_counter()
    complete: asyncio.Queue = asyncio.Queue()

    async def write():
        for n, sentence in enumerate(words):
            await asyncio.sleep(len(sentence) / rate)
            ends[n] = time.perf_counter() - t0
            complete.put_nowait("".join(sentence))

    writer = asyncio.ensure_future(write())
    for n in range(len(words)):
        text = await complete.get()
        async for chunk in tts.stream(text, **fields):
            arrivals.append((time.perf_counter() - t0, chunk.audio.size, n))
    await writer
    return ends, arrivals


def summary(ends: dict, arrivals: list) -> tuple[list[float], list[float]]:
    first = {}
    for at, _, n in arrivals:
        first.setdefault(n, at)
    latency = [first[n] - ends[n] for n in sorted(first)]
    gaps = heard(arrivals)
    return latency, [gaps[n] for n in sorted(gaps)][1:]


async def run(url: str, rate: float, fields: dict, rounds: int) -> list[tuple[str, list[float], list[float]]]:
    words = sentences(REPLY)
    rows = []
    async with AsyncTTSClient(url, timeout=120) as tts:
        for name, way in (("text-in stream", text_in), ("one request per sentence", per_sentence)):
            latency, gaps = [], []
            for _ in range(rounds):
                ends, arrivals = await way(tts, words, rate, fields)
                got = summary(ends, arrivals)
                latency += got[0]
                gaps += got[1]
            rows.append((name, latency, gaps))
    return rows


def table(rows, rate: float, patches: int) -> str:
    def ms(values):
        return f"{1000 * statistics.median(values):.0f} / {1000 * max(values):.0f}"

    out = [f"{rate:g} words/s, {patches} patches a sentence, load {os.getloadavg()[0]:.1f} (1 min)", "",
           ("| way | sentence end -> its first audio, ms (median / max) | silence between sentences as heard, ms "
           "(median / max) |"), "|---|---|---|"]  # fmt: skip
    out += [f"| {name} | {ms(latency)} | {ms(gaps)} |" for name, latency, gaps in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.text_in", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server's gRPC HOST:PORT (default: start one)")
    ap.add_argument("--preset", choices=["tiny", "small"], default="tiny", help="checkpoint of the started server")
    ap.add_argument("--words-per-second", type=float, default=22.0, help="the LLM's pace (22: ~30 tokens/s)")
    ap.add_argument("--patches", type=int, default=15, help="patches (160 ms) a sentence lasts (default 15)")
    ap.add_argument("--rounds", type=int, default=2, help="replies spoken each way (default 2)")
    args = ap.parse_args(argv)
    fields = {"seed": 1, "parameters": {"max_patches": args.patches}}
    if args.url:
        rows = asyncio.run(run(args.url, args.words_per_second, fields, args.rounds))
    else:
        from bench.server import local_server

        with local_server(args.preset, slots=2) as server:
            rows = asyncio.run(run(f"127.0.0.1:{server.ports.grpc}", args.words_per_second, fields, args.rounds))
    print(table(rows, args.words_per_second, args.patches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
