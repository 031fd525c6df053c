"""The vocoder against a real server: a stream's chunks are accepted however late its consumer passes
them on (until the stream's own last chunk), and one request carries chunks of several streams, each
answered on its own."""

from __future__ import annotations

import queue
import secrets
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from serving import contract
from serving.stub.triton_io import read_chunk
from serving.stub.vocoder_batch import request_values
from tests.integration.helpers import SILENT, GeneratorPipe, wait_gauges_zero

pytestmark = pytest.mark.integration

OLD_GRACE_SECONDS = 2.0  # what an ended stream had before the vocoder refused it; the generator's timer ticks each 1 s


def _stream(server, model: str, requests: list[tuple[dict, dict]], ends: int, **kw) -> list:
    """``requests`` ((inputs, parameters) each) on one gRPC stream -> the responses, read until ``ends``
    of them ended a request (a generator's LAST, or each vocoder answer). ``kw``: async_stream_infer's."""
    got = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for values, parameters in requests:
            inputs = []
            for spec in contract.GENERATOR_INPUTS if model != "vocoder" else contract.VOCODER_INPUTS:
                if spec.name in values:
                    # vocoder requests come batched (request_values); a generator request is one
                    arr = np.asarray(values[spec.name]) if model == "vocoder" else spec.array(values[spec.name])[None]
                    inputs.append(grpcclient.InferInput(spec.name, list(arr.shape), spec.datatype))
                    inputs[-1].set_data_from_numpy(arr)
            client.async_stream_infer(model, inputs, parameters=parameters, **kw)
        out = []
        while ends:
            result, error = got.get(timeout=60)
            assert error is None, error
            out.append(result)
            last = result.as_numpy("LAST")
            ends -= last is None or bool(last.reshape(-1)[0])
        return out
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _generate(server, patches: int) -> list:
    """A stream of ``patches`` patches, one a chunk, straight from the generator on a pipe, as tts gets it
    (its id 63 random bits, as tts's are)."""
    stream_id = secrets.randbits(62) | (1 << 62)
    url = f"127.0.0.1:{server.ports.grpc}"
    with GeneratorPipe(url, server.generator_model, server.internal_key, server.work_dir / "cancel") as pipe:
        assert (
            pipe.answer(pipe.send(SILENT, stream_id, {"max_patches": patches, "chunk_first": 1, "chunk_next": 1}))
            is None
        )
        return pipe.read(stream_id)


def _decode(server, batches: list[list]) -> list[tuple[str, int]]:
    """Each batch of chunks as one vocoder request (as tts sends them) -> per chunk (FINISH_REASON, samples)."""
    requests = [(request_values(batch), {"internal_key": server.internal_key}) for batch in batches]
    out = []
    for r in _stream(server, "vocoder", requests, ends=len(batches)):
        reasons, samples = r.as_numpy("FINISH_REASON").reshape(-1), r.as_numpy("SAMPLES").reshape(-1)
        out += [(contract.text_of(x), int(n)) for x, n in zip(reasons, samples, strict=True)]
    return out


def test_a_consumer_late_past_the_old_grace_gets_every_chunk_decoded(server):
    chunks = _generate(server, patches=4)
    assert len(chunks) == 4 and chunks[-1].last
    ended = time.monotonic()
    time.sleep(OLD_GRACE_SECONDS + 1.5)  # the consumer is slow: the generator ended the stream long ago
    # Proof that the generator looked at its board after the old grace (the sleep alone proves nothing if its
    # engine thread was starved meanwhile): it admits and ends a later stream, and each start and end syncs the
    # board, dropping what has run out (serving/flow/side_channel.py LiveStreams.sync).
    assert len(_generate(server, patches=1)) == 1 and time.monotonic() - ended > OLD_GRACE_SECONDS
    answers = _decode(server, [[c] for c in chunks])
    assert [reason for reason, _ in answers] == ["", "", "", "length"]
    assert sum(n for _, n in answers) == 4 * 3840  # the whole stream: 3840 samples a patch
    assert _decode(server, [[chunks[0]]])[0][0].startswith("invalid: unknown stream")  # its end came: used up
    assert wait_gauges_zero(server)["tts_vocoder_active_streams"] == 0


def test_one_request_carries_chunks_of_several_streams_each_answered_alone(server):
    a, b = _generate(server, patches=2), _generate(server, patches=2)
    values = {**request_values([b[0]]), "SEAL": np.array([[0, 12345]], np.uint64)}  # b's chunk 0, a wrong seal
    forged = read_chunk(lambda n: values[n][0] if n in values else None)
    answers = _decode(server, [[a[0], forged], [a[1]]])  # a's chunk 0 beside a forged one of b, then a's last
    assert answers[1][0].startswith("invalid: unknown stream") and answers[1][1] == 0
    assert [reason for reason, _ in answers] == ["", answers[1][0], "length"]
    assert answers[0][1] > 0 and answers[0][1] + answers[2][1] == 2 * 3840  # 3840 samples a patch
    assert _decode(server, [[b[0]], [b[1]]]) == answers[:1] + answers[2:]  # the forgery cost b nothing
    assert wait_gauges_zero(server)["tts_vocoder_active_streams"] == 0
