"""The paged KV cache behind a real tritonserver: a stream that does not fit the pool now waits for
pages (it is not failed), one that can never fit is refused with the reason, and the metrics show the
pool, its use and the attention path."""

from __future__ import annotations

import threading
import time

import pytest

from client import TTSClient, TTSError
from engine.kv_cache import PAGE_SIZE
from serving.config.repository import ServeOptions, build
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import serving, wait_gauges_zero

pytestmark = pytest.mark.integration
PAGES = 6  # the tiny backbone in float32: 512 bytes a position, so 8 KiB a page


@pytest.fixture(scope="module")
def small_pool(nostop_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("kvpool")
    gib = PAGES * PAGE_SIZE * 512 / 2**30
    opts = ServeOptions(checkpoint=str(nostop_ckpt), slots=2, max_len=1024, kv_memory_gb=gib, attention="auto",
                        cancel_dir=str(work / "cancel"), voice_dir=str(work / "voices"), run_dir=str(work))  # fmt: skip
    with serving(TritonServer(build(work / "model_repository", opts), work, Ports.free())) as srv:
        yield srv


def test_the_pool_and_the_attention_path_are_reported(small_pool):
    m = small_pool.metrics()
    assert m["tts_kv_pages"] == PAGES and m["tts_kv_pages_in_use"] == 0
    # CPU: FlashInfer is not used, and the label says why
    assert m['tts_generator_attention{backend="sdpa",fallback_reason="no_cuda"}'] == 1


def test_a_stream_without_pages_waits_then_runs(small_pool):
    """Two slots, and pages (96 positions) for the first stream (prompt + 70 patches, 5 pages) but not
    for both (the second needs 2 more): the second, sent once the first is streaming, waits in its slot
    until the first gives its pages back, then runs to the end; nothing fails. Its first audio comes after
    the last look that saw it waiting (not after the first stream's last chunk reached this client: under
    load that chunk's trip through the vocoder and tts can take longer than the second's start)."""
    url = f"127.0.0.1:{small_pool.ports.grpc}"
    params = {"chunk_first": 1, "chunk_next": 1}
    first_started, times, waiting_seen = threading.Event(), {"First": [], "Second": []}, []

    def one(name, patches):
        for _ in TTSClient(url, timeout=120).stream(name, seed=1, parameters={"max_patches": patches, **params}):
            times[name].append(time.monotonic())
            first_started.set()

    first = threading.Thread(target=one, args=("First", 70))
    first.start()
    assert first_started.wait(60)
    second = threading.Thread(target=one, args=("Second", 20))
    second.start()
    while second.is_alive():
        looked = time.monotonic()  # before the read: a wait it reports had begun by then
        waiting_seen.append((looked, small_pool.metrics().get("tts_generator_waiting_for_kv", 0)))
        time.sleep(0.02)
    first.join(60)
    assert len(times["First"]) == 70 and len(times["Second"]) == 20
    waits = [looked for looked, waiting in waiting_seen if waiting == 1]
    assert waits, "the second stream was never seen waiting for pages"
    assert max(waiting for _, waiting in waiting_seen) == 1
    assert times["Second"][0] > waits[-1]  # no audio while it waited for the first stream's pages
    m = wait_gauges_zero(small_pool)
    assert m["tts_kv_pages_in_use"] == 0 and m["tts_generator_waiting_for_kv"] == 0


def test_a_stream_that_can_never_fit_is_refused(small_pool):
    with pytest.raises(TTSError, match="KV-cache pages of 16 positions; the whole pool has 6"):
        TTSClient(f"127.0.0.1:{small_pool.ports.grpc}").synthesize("Too long", parameters={"max_patches": 300})
    m = wait_gauges_zero(small_pool)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0
