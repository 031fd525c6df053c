"""Text-in streams behind a real tritonserver (a gRPC sequence to tts, one request per piece): the audio
equals one request of the whole text with the same segments, the first audio comes while the text is still
being sent, a cancel frees the slot and pages at once, and each bound is a named error that frees the place.
The documented text-in snippets run in test_readme, against a checkpoint whose stop head fires."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import numpy as np
import pytest

from client import AsyncTTSClient, Chunk, Flushed, InvalidRequest, TTSClient
from serving.config.repository import ServeOptions, build
from serving.contract import MAX_STREAM_CHARS, MAX_STREAM_PIECES
from serving.intake.requests import MAX_TEXT_CHARS
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import serving, wait_gauges_zero

pytestmark = pytest.mark.integration
IDLE = 3  # seconds a stream may wait for its next piece, on this server
FIRST = "The first sentence is long enough here."
SECOND = " And a second sentence comes after it."
TEXT = FIRST + SECOND
# fixed chunks: the deadline rule sizes chunks by the clock, which moves float32 rounding
FIELDS = {"seed": 5, "parameters": {"max_patches": 6, "split_tokens": 8, "chunk_fixed": True}}


@pytest.fixture(scope="module")
def text_server(nostop_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("textin")
    opts = ServeOptions(checkpoint=str(nostop_ckpt), slots=2, max_len=1024, text_idle_seconds=IDLE,
                        cancel_dir=str(work / "cancel"), voice_dir=str(work / "voices"), run_dir=str(work))  # fmt: skip
    with serving(TritonServer(build(work / "model_repository", opts), work, Ports.free())) as srv:
        yield srv


@pytest.fixture(scope="module")
def url(text_server):
    return f"127.0.0.1:{text_server.ports.grpc}"


@pytest.fixture(scope="module")
def whole(url):
    """One request of the whole text: the audio every text-in stream of it must equal."""
    return TTSClient(url, timeout=120).synthesize(TEXT, **FIELDS)


def words(text: str) -> list[str]:
    parts = text.split(" ")
    return [parts[0]] + [" " + w for w in parts[1:]]


GAUGES = ("tts_generator_active_slots", "tts_vocoder_active_streams", "tts_kv_pages_in_use", "tts_requests_in_flight")


def free(server) -> dict:
    """Slot, vocoder state, KV pages and admission place all given back (the refused stream's audio request
    ends a moment after the client has its error: waited for, within 30 s)."""
    wait_gauges_zero(server)
    deadline = time.monotonic() + 30
    while any((m := server.metrics())[g] for g in GAUGES) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {g: m[g] for g in GAUGES} == dict.fromkeys(GAUGES, 0)
    return m


def test_word_by_word_equals_one_request(url, whole, text_server):
    """Sync client, a word a request, cut at the sentence end: the whole request's audio, bit for bit."""
    got = np.concatenate([c.audio for c in TTSClient(url, timeout=120).stream_text(words(TEXT), **FIELDS)])
    assert whole.size > 0 and np.array_equal(got, whole)
    free(text_server)


def test_random_pieces_equal_one_request(url, whole):
    """asyncio client, pieces of random sizes from an async iterable."""
    rng = random.Random(7)
    cuts = sorted({0, len(TEXT), *(rng.randrange(1, len(TEXT)) for _ in range(12))})

    async def pieces():
        for a, b in itertools.pairwise(cuts):
            yield TEXT[a:b]

    async def go():
        async with AsyncTTSClient(url, timeout=120) as tts:
            return [c.audio async for c in tts.stream_text(pieces(), **FIELDS)]

    assert np.array_equal(np.concatenate(asyncio.run(go())), whole)


def test_audio_comes_while_the_text_is_still_being_sent(url, whole):
    """open_text: the rest of the text goes only after audio of the first sentence came (its end is
    confirmed by the next word, " And"); a flush after it is marked once its audio is out."""
    events = []

    async def go():
        async with AsyncTTSClient(url, timeout=120) as tts:
            ts = await tts.open_text(**FIELDS)
            first_words = words(TEXT)[:7]
            for piece in first_words[:-1]:
                await ts.send(piece)
            await ts.send(first_words[-1], flush=True)
            heard = asyncio.Event()

            async def listen():
                audio = []
                async for item in ts:
                    events.append(type(item).__name__ if isinstance(item, Flushed) else "audio")
                    if isinstance(item, Chunk):
                        audio.append(item.audio)
                        heard.set()
                return audio

            listener = asyncio.ensure_future(listen())
            await asyncio.wait_for(heard.wait(), 120)
            events.append("rest sent")
            await ts.send(SECOND)
            await ts.end()
            return await asyncio.wait_for(listener, 120)

    audio = asyncio.run(go())
    assert np.array_equal(np.concatenate(audio), whole)
    assert events[0] == "audio" and events.count("Flushed") == 1
    assert events.index("rest sent") < len(events) - 1 and events[-1] == "audio"
    assert events.index("Flushed") < len(events) - 1  # the second sentence's audio follows the mark


def test_cancel_mid_segment_frees_slot_and_pages_and_the_next_stream_sounds_the_same(url, whole, text_server):
    async def cancelled():
        async with AsyncTTSClient(url, timeout=120) as tts:
            ts = await tts.open_text(seed=5, parameters={"max_patches": 300, "chunk_fixed": True})
            await ts.send("A long sentence that will be cut off.", flush=True)
            async for item in ts:
                if isinstance(item, Chunk):
                    break
            assert text_server.metrics()["tts_generator_active_slots"] == 1
            await ts.cancel()
            assert [item async for item in ts] == []  # the iteration has ended

    asyncio.run(cancelled())
    free(text_server)
    got = np.concatenate([c.audio for c in TTSClient(url, timeout=120).stream_text(words(TEXT), **FIELDS)])
    assert np.array_equal(got, whole)


def _refused(url, pieces, flush=False) -> str:
    with pytest.raises(InvalidRequest) as e:
        for _ in TTSClient(url, timeout=120).stream_text(pieces, flush=flush, **FIELDS):
            pass
    return str(e.value)


def test_too_much_text_is_refused_and_frees_its_place(url, text_server):
    spaces = [" " * MAX_TEXT_CHARS] * (MAX_STREAM_CHARS // MAX_TEXT_CHARS) + ["x"]
    assert f"over {MAX_STREAM_CHARS} characters" in _refused(url, spaces, flush=True)
    free(text_server)


def test_too_many_pieces_are_refused_and_free_their_place(url, text_server):
    message = _refused(url, [""] * (MAX_STREAM_PIECES + 1))
    assert f"over {MAX_STREAM_PIECES} requests" in message
    free(text_server)


def test_an_idle_stream_is_closed_and_frees_its_place(url, text_server):
    async def go():
        async with AsyncTTSClient(url, timeout=120) as tts:
            ts = await tts.open_text(**FIELDS)
            await ts.send("Started, then silence")
            return [item async for item in ts]

    with pytest.raises(InvalidRequest, match=f"no text for {IDLE} s"):
        asyncio.run(go())
    free(text_server)


@pytest.mark.parametrize("instruct", [{}, {"instruction": "a calm older man"}], ids=["base", "instruct_design"])
def test_a_control_token_split_by_zero_width_spaces_across_pieces_is_refused_by_name(url, whole, text_server, instruct):
    """No piece holds "<|" or "|>" as sent, and 40 zero-width spaces lie between the parts: cleaning joins them.
    The text is checked as the tokenizer reads it; then a legitimate stream sounds as before."""
    gap = "\u200b" * 40
    pieces = ["Say <", gap, "|eot|", gap, "> now."]
    fields = {**FIELDS, "parameters": {**FIELDS["parameters"], "normalize": False}, **instruct}
    with pytest.raises(InvalidRequest, match=r"^TEXT must not contain '<\|': '<\|eot\|>' is a control token"):
        for _ in TTSClient(url, timeout=120).stream_text(pieces, **fields):
            pass
    free(text_server)
    got = np.concatenate([c.audio for c in TTSClient(url, timeout=120).stream_text(words(TEXT), **FIELDS)])
    assert np.array_equal(got, whole)


def test_a_piece_of_no_stream_and_settings_on_a_later_piece_are_refused(url):
    """A piece whose sequence was never started is refused by name; settings go on START only (a START on an
    open id: tests/unit/test_text_streams.py)."""
    from client.text_in import piece_request

    async def go(requests):
        async with AsyncTTSClient(url, timeout=120) as tts:

            async def send():
                for r in requests:
                    yield r

            async for _result, error in tts._channel().stream_infer(send()):
                if error is not None:
                    return str(error)
        return ""

    assert "no open text stream" in asyncio.run(go([piece_request("tts", 99, "Hello", False)]))
    with_voice = piece_request("tts", 98, "Hi", False, fields={"SEED": 3})
    start = piece_request("tts", 98, "", False, start=True, fields={"SEED": 3})
    assert "SEED: only the first request" in asyncio.run(go([start, with_voice]))
