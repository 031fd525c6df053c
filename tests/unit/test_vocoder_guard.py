"""What the vocoder accepts from anyone (serving.security.vocoder_guard), the seals that decide it
(serving.security.auth), the live-stream folder it reads and the shared admission gate (both
serving.flow.side_channel). No Triton, no model."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, replace

import numpy as np
import pytest

from engine.protocol import Chunk, Unavailable, end_chunk, error_kind, tagged
from serving.flow.admission import Admission
from serving.flow.side_channel import UNCLAIMED_SECONDS, LiveStreams, SideChannel
from serving.security.auth import Keys
from serving.security.vocoder_guard import (
    DROPPED,
    FINISHED_SECONDS,
    MAX_FINISHED,
    PUBLIC_ENDED_IDLE_SECONDS,
    UNKNOWN,
    VocoderGuard,
)

KEYS = Keys("k" * 64)
PROMPT = np.ones((4, 64), np.float32)
LAT = np.full((8, 64), 0.5, np.float32)
EMPTY = np.zeros((0, 64), np.float32)


@dataclass
class Held:  # what the guard needs of a vocoder stream
    last_seen: float


def chunks(sid: int, n: int = 3) -> list[Chunk]:
    """A sealed stream as the generator sends it: chunk 0 with the prompt, ..., the last one."""
    out = [Chunk(sid, LAT, PROMPT if k == 0 else EMPTY, k == n - 1, "length" if k == n - 1 else "", seq=k)
           for k in range(n)]  # fmt: skip
    return [KEYS.seal(c) for c in out]


@pytest.fixture
def world(tmp_path):
    board = SideChannel(tmp_path / "board")
    return board, board.live, VocoderGuard(KEYS, board, max_streams=3)


def feed(guard, streams, chunk, **kw):
    d = guard.decide(chunk, streams, **kw)
    if d.decode and len(chunk.prompt_latents):
        streams[chunk.stream_id] = Held(0.0)
    if d.decode and chunk.last:
        streams.pop(chunk.stream_id, None)
    return d


def test_seals_cover_every_field():
    c = chunks(KEYS.new_stream_id())[0]
    assert KEYS.sealed(c)
    for changed in (replace(c, stream_id=c.stream_id + 1), replace(c, seq=1), replace(c, last=True),
                    replace(c, finish_reason="stop"), replace(c, latents=LAT * 2), replace(c, latents=LAT[:4]),
                    replace(c, prompt_latents=EMPTY), replace(c, seal=c.seal ^ 1)):  # fmt: skip
        assert not KEYS.sealed(changed)
    assert not Keys("j" * 64).sealed(c)  # another run's key


def test_a_sealed_stream_decodes_in_order_once(world):
    board, live, guard = world
    streams, sid = {}, KEYS.new_stream_id()
    live.sync({sid})
    c0, c1, c2 = chunks(sid)
    assert feed(guard, streams, c0).decode
    assert not guard.decide(c0, streams).decode  # replayed: the stream opens once
    assert not guard.decide(c2, streams).decode  # out of order
    assert feed(guard, streams, c1).decode and feed(guard, streams, c2).decode
    assert sid not in streams
    assert str(guard.decide(c0, streams).error) == UNKNOWN  # still known as used while the generator holds it


def test_a_finished_streams_replay_is_the_clients_fault_whenever_the_reap_ran(world):
    # the replay came after the reap that forgot the id off the board: it was answered 'unavailable: the
    # server dropped this stream', the server's fault and a retry, for a chunk used up (test_late_chunks
    # failed on it under load, where the replay and the 1 s reap crossed)
    board, live, guard = world
    streams, sid = {}, KEYS.new_stream_id()
    live.sync({sid}, now=0.0)
    live.sync(set(), now=1.0)  # the generator made every chunk and ended it
    c0, c1, c2 = chunks(sid)
    assert all(feed(guard, streams, c).decode for c in (c0, c1, c2))
    assert live.snapshot() == (set(), set())  # its end took it off the board
    guard.reap(streams, idle_seconds=30.0, now=2.0)
    assert sid not in guard.opened
    for c in (c0, c1, c2):
        d = guard.decide(c, streams)
        assert not d.decode and str(d.error) == UNKNOWN and not isinstance(d.error, Unavailable)
    guard.reap(streams, idle_seconds=30.0, now=time.monotonic() + FINISHED_SECONDS + 1)  # long after
    assert isinstance(guard.decide(c0, streams).error, Unavailable)  # forgotten: what any unknown sealed id gets


def test_finished_streams_are_bounded_and_made_up_ends_fill_nothing(world):
    board, live, guard = world
    for sid in range(1, 1000):
        assert guard.decide(end_chunk(sid, "cancelled"), {}).decode  # never opened here: not remembered
    assert not guard.finished
    for k in range(MAX_FINISHED + 2):
        guard.opened.add(k + 1)
        guard._end(k + 1)
    assert len(guard.finished) == MAX_FINISHED and 1 not in guard.finished and MAX_FINISHED + 2 in guard.finished


def test_only_the_generators_chunks_of_live_streams_decode(world):
    board, live, guard = world
    sid = KEYS.new_stream_id()
    forged = Chunk(sid, LAT, PROMPT)
    assert isinstance(guard.decide(forged, {}).error, ValueError)  # no seal
    # sealed, but the generator does not hold it: genuine, dropped by the server, never the client's fault
    dropped = guard.decide(chunks(sid)[0], {}).error
    assert isinstance(dropped, Unavailable) and not isinstance(dropped, ValueError)
    assert isinstance(guard.decide(chunks(sid)[1], {}).error, Unavailable)  # a later chunk of a stream let go
    live.sync({sid})
    assert guard.decide(chunks(sid)[0], {}).decode


def test_ending_chunks_need_no_seal_and_decode_nothing(world):
    board, live, guard = world
    d = guard.decide(end_chunk(123, "cancelled"), {})
    assert d.decode  # VocoderService frees the state of that id, if any, and decodes nothing
    assert guard.decide(end_chunk(123, "error: boom"), {}).decode


def test_a_chunk_whose_client_left_ends_both_streams(world):
    board, live, guard = world
    sid = KEYS.new_stream_id()
    live.sync({sid})
    streams: dict = {}
    c0, c1, _ = chunks(sid)
    feed(guard, streams, c0)
    d = guard.decide(c1, streams, cancelled=True)
    assert not d.decode and d.reason == "cancelled"
    assert sid not in streams and sid in board.poll()["cancel"]  # the generator ends it at its next step


def test_the_table_makes_room_only_from_streams_off_the_board(world):
    board, live, guard = world
    ids = [KEYS.new_stream_id() for _ in range(5)]
    live.sync(set(ids[:3]), now=0.0)
    streams: dict = {}
    for sid in ids[:3]:
        assert feed(guard, streams, chunks(sid)[0], trusted=True).decode  # tts's
    live.sync(set(ids[:3]) | {ids[3]}, now=1.0)
    d = guard.decide(chunks(ids[3])[0], streams)  # full, and every stream is generating: busy, not evicted
    assert not d.decode and "maximum of 3" in str(d.error) and error_kind(tagged(d.error))[0] == "unavailable: "
    live.sync({ids[1], ids[2], ids[3]}, now=2.0)  # ids[0] ended, but its last chunk has not come: owed to tts
    assert not guard.decide(chunks(ids[3])[0], streams).decode
    live.claim(ids[0])  # as if its consumer had passed its end on: off the board, its place can be taken
    assert feed(guard, streams, chunks(ids[3])[0]).decode
    assert set(streams) == {ids[1], ids[2], ids[3]}
    assert guard.decide(chunks(ids[4])[0], streams).error is not None  # ids[4] was never issued


def test_ended_streams_of_key_less_consumers_give_way(world):
    """Anyone may call ensemble_generator and keep its sealed chunks: such streams, once ended, can be
    opened late but never keep a place from a stream that is generating or owed to tts."""
    board, live, guard = world
    ids = [KEYS.new_stream_id() for _ in range(4)]
    live.sync(set(ids), now=0.0)
    live.sync({ids[3]}, now=1.0)  # a stranger's three streams ended; their chunks were kept back
    streams: dict = {}
    for sid in ids[:3]:
        assert feed(guard, streams, chunks(sid)[0]).decode  # key-less, late: opened (the table has room)
    assert feed(guard, streams, chunks(ids[3])[0], trusted=True).decode  # full: one of the stranger's gives way
    assert ids[3] in streams and len(streams) == 3
    for sid in streams:
        streams[sid] = Held(100.0)
    assert guard.reap(streams, idle_seconds=60, now=100.0 + PUBLIC_ENDED_IDLE_SECONDS / 2) == []
    assert sorted(guard.reap(streams, idle_seconds=60, now=100.0 + 2 * PUBLIC_ENDED_IDLE_SECONDS)) == sorted(ids[1:3])
    assert list(streams) == [ids[3]]  # tts's stream, generating, stays


def test_a_stream_ended_long_ago_decodes_until_its_own_end(world):
    """A backlogged consumer passes a stream on long after the generator ended it: every chunk decodes,
    in order, until the stream's last chunk; then the id is gone for good."""
    board, live, guard = world
    sid = KEYS.new_stream_id()
    live.sync({sid}, now=0.0)
    live.sync(set(), now=1.0)  # the generator made every chunk and ended it
    live.sync(set(), now=UNCLAIMED_SECONDS - 1)  # the old 2 s grace is long over
    streams: dict = {}
    c0, c1, c2 = chunks(sid)
    assert guard.reap(streams, idle_seconds=60, now=UNCLAIMED_SECONDS - 1) == []
    assert feed(guard, streams, c0, trusted=True).decode
    assert guard.reap(streams, idle_seconds=60, now=0.0) == [] and sid in streams
    assert feed(guard, streams, c1).decode and feed(guard, streams, c2).decode
    assert live.state(sid) == "gone"  # its end took it off the board
    assert str(guard.decide(c0, streams).error) == UNKNOWN  # a replay: used
    guard.reap(streams, idle_seconds=60)
    # off the board, but its end came here: still a replay (the client's fault), nothing opened
    assert sid not in guard.opened and str(guard.decide(c0, streams).error) == UNKNOWN and sid not in streams
    guard.reap(streams, idle_seconds=60, now=time.monotonic() + FINISHED_SECONDS + 1)
    # forgotten: a sealed chunk cannot be told from one the server dropped: unavailable, nothing opened
    assert str(guard.decide(c0, streams).error) == DROPPED and sid not in streams


def test_a_stream_given_up_before_the_vocoder_opened_it_leaves_the_board(world):
    board, live, guard = world
    sid = KEYS.new_stream_id()
    live.sync({sid}, now=0.0)
    live.sync(set(), now=1.0)  # cancelled by its tts, which then sends the stream's end (unsealed)
    assert guard.decide(end_chunk(sid, "cancelled"), {}).decode
    assert live.state(sid) == "gone"
    streams: dict = {}
    assert str(guard.decide(chunks(sid)[0], streams).error) == DROPPED and not streams  # nothing opened


def test_the_table_counts_streams_opening_in_the_same_batch(world):
    board, live, guard = world
    ids = [KEYS.new_stream_id() for _ in range(4)]
    live.sync(set(ids))
    d = [guard.decide(chunks(sid)[0], {}, opening=k) for k, sid in enumerate(ids)]
    assert [x.decode for x in d] == [True, True, True, False]


def test_reap_drops_streams_off_the_board(world):
    board, live, guard = world
    a, b = KEYS.new_stream_id(), KEYS.new_stream_id()
    live.sync({a, b}, now=0.0)
    streams: dict = {}
    for sid in (a, b):
        feed(guard, streams, chunks(sid)[0])
        streams[sid] = Held(100.0)
    live.sync({b}, now=0.0)  # a ended: its last chunk may still come, however late
    assert guard.reap(streams, idle_seconds=60, now=101.0) == []
    live.sync({b}, now=UNCLAIMED_SECONDS)  # nobody passed its end on in all that time: its consumer is gone
    assert guard.reap(streams, idle_seconds=60, now=101.0) == [a]
    assert guard.reap(streams, idle_seconds=60, now=200.0) == [b]  # idle
    assert a not in guard.opened


def test_live_streams_follow_the_generator(tmp_path):
    writer, reader = LiveStreams(tmp_path), LiveStreams(tmp_path)
    writer.sync({1, 2, 3}, now=0.0)
    assert (reader.state(1), reader.state(4)) == ("live", "gone")
    writer.sync({2}, now=1.0)
    assert reader.state(1) == "ended" and reader.snapshot() == ({2}, {1, 3})
    reader.claim(3)  # the vocoder had stream 3's end
    reader.claim(2)  # a live stream stays listed
    assert reader.snapshot() == ({2}, {1})
    writer.sync({2}, now=UNCLAIMED_SECONDS)
    assert reader.state(1) == "ended"
    writer.sync({2}, now=1.0 + UNCLAIMED_SECONDS)
    assert reader.state(1) == "gone" and writer.ended == {}
    writer.clear()
    assert reader.snapshot() == (set(), set())


def _take(board, n, out):
    gate = Admission(board, "ensemble_generator", 10)
    out.put(sum(gate.enter() for _ in range(n)))


def test_admission_is_one_gate_across_processes(tmp_path):
    model = Admission(tmp_path, "tts", 10)
    assert all(model.enter() for _ in range(4))
    got = multiprocessing.get_context("fork").Queue()
    p = multiprocessing.get_context("fork").Process(target=_take, args=(tmp_path, 8, got))
    p.start()
    p.join(10)
    assert got.get(timeout=5) == 6  # 4 + 6 = 10: the other model's requests count
    assert not model.enter() and model.total() == 10 and "limit 10" in model.busy_message()
    model.leave()
    assert model.enter()
    assert Admission(tmp_path, "tts", 10).counts() == (4, 6)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [(ValueError("TEXT is empty"), "invalid: "), (RuntimeError("boom"), "error: "), (TimeoutError("late"), "error: ")],
)
def test_errors_are_tagged_once(exc, kind):
    message = tagged(exc)
    assert error_kind(message) == (kind, str(exc))
    assert tagged(ValueError(message)) == message  # a tagged message keeps its tag
    assert error_kind("Stub process is not healthy") == ("error: ", "Stub process is not healthy")
