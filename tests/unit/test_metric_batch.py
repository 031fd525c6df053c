"""serving.stub.metric_batch and serving.stub.bls_adapters.BLSPrompts: the tts stub's round trips to Triton's
process per request (metric updates, the default voice's prompt) are fewer, with the same values."""

import asyncio

import numpy as np
import pytest

from serving.intake.requests import Voice
from serving.stub.bls_adapters import BLSPrompts
from serving.stub.metric_batch import Level, MetricBatch


class Metric:
    def __init__(self):
        self.value, self.calls = 0.0, 0

    def increment(self, amount):
        self.value += amount
        self.calls += 1

    def set(self, value):
        raise AssertionError("Metric.set keeps the stub's GIL through its round trip (docs/triton.md#T19)")


def test_one_turns_updates_go_out_once_per_metric_with_the_same_values():
    ok, audio, gauge = Metric(), Metric(), Metric()
    level = Level(gauge)  # a gauge moves by increment (docs/triton.md#T19), only on a change

    async def turn():
        batch = MetricBatch()
        for _ in range(64):  # 64 requests ending in one turn of the loop
            batch.increment(ok, 1)
            batch.increment(audio, 0.5)
            batch.set(level, 3)
        batch.set(level, 2)
        assert (ok.calls, audio.calls, gauge.calls) == (0, 0, 0)  # not before the turn ends
        await asyncio.sleep(0)
        assert (ok.value, audio.value, gauge.value) == (64, 32.0, 2)
        assert (ok.calls, audio.calls, gauge.calls) == (1, 1, 1)
        batch.set(level, 2)  # the value it has: not sent again
        batch.increment(ok, 0)
        await asyncio.sleep(0)
        assert (ok.calls, gauge.calls) == (1, 1)
        batch.set(level, 0)
        await asyncio.sleep(0)
        assert (gauge.value, gauge.calls) == (0, 2)
        batch.set(level, 5)
        batch.set(level, 0)  # back to the value Triton has within the turn: nothing to send
        await asyncio.sleep(0)
        assert (gauge.value, gauge.calls) == (0, 2)

    asyncio.run(turn())


def test_threaded_updates_go_out_on_one_other_thread_in_order():
    import threading

    class Histogram:
        def __init__(self):
            self.values, self.threads = [], set()

        def observe(self, value):
            self.values.append(value)
            self.threads.add(threading.current_thread().name)

    first, ok = Histogram(), Metric()

    async def turns():
        batch = MetricBatch(threaded=True)
        for turn in range(50):
            batch.observe(first, turn)
            batch.observe(first, turn + 0.5)
            batch.increment(ok, 1)
            await asyncio.sleep(0)
        batch.sender.shutdown(wait=True)  # what was handed over is sent

    asyncio.run(turns())
    assert first.values == [v for t in range(50) for v in (t, t + 0.5)]  # every value, in order
    assert ok.value == 50 and len(first.threads) == 1 and threading.current_thread().name not in first.threads


def test_without_a_running_loop_updates_go_out_at_once():
    batch, counter = MetricBatch(), Metric()
    batch.increment(counter, 2)
    assert counter.value == 2


class Encoder:
    """BLSPrompts' BLS: counts the calls, fails when told to."""

    def __init__(self):
        self.calls, self.fail = 0, False

    async def encode(self, voice):
        self.calls += 1
        if self.fail:
            raise TimeoutError("prompt_encoder did not answer within 30 s")
        return {"PROMPT_LATENTS": np.ones((2, 3), np.float32), "SPEAKER": np.ones(4, np.float32), "PROMPT_TEXT": ""}


def prompts(encoder: Encoder) -> BLSPrompts:
    p = BLSPrompts(bls=None)
    p._encode = encoder.encode  # the BLS call itself
    return p


def test_the_default_voice_is_encoded_once_and_other_voices_every_time():
    encoder = Encoder()
    p = prompts(encoder)

    async def run():
        first = await p.encode(Voice())
        again = await p.encode(Voice())
        np.testing.assert_array_equal(first["PROMPT_LATENTS"], again["PROMPT_LATENTS"])
        assert encoder.calls == 1
        for voice in (Voice(voice_id="alice"), Voice(ref_audio=np.zeros(10, np.float32), ref_sample_rate=24000),
                      Voice(ref_text="no audio: the encoder refuses it")):  # fmt: skip
            await p.encode(voice)
            await p.encode(voice)
        assert encoder.calls == 7

    asyncio.run(run())


def test_a_failed_default_voice_call_is_not_kept():
    encoder = Encoder()
    encoder.fail = True
    p = prompts(encoder)

    async def run():
        with pytest.raises(TimeoutError, match="prompt_encoder"):
            await p.encode(Voice())
        encoder.fail = False
        await p.encode(Voice())
        await p.encode(Voice())
        assert encoder.calls == 2

    asyncio.run(run())


def test_a_level_moves_its_gauge_by_the_difference_and_only_on_a_change():
    gauge = Metric()
    level = Level(gauge, 4)
    for value in (4, 6, 6, 1, 0):
        level.set(value)
    assert (gauge.value, gauge.calls) == (0, 4)  # 4, +2, -5, -1: never set()


def test_a_models_metrics_and_families_are_held_until_its_finalize_releases_them(monkeypatch):
    """Triton keeps a metric only while its family's object lives; one still alive at the stub's end segfaults
    the stub on Triton 2.51 (a family in its destructor: python_backend PR #429; a metric in a reference cycle
    in the interpreter's last collection). ``release`` (the end of every model's ``finalize``) lets go of all."""
    import gc
    import weakref

    from serving.stub import metric_batch

    class Family:
        COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

        def __init__(self, name, description, kind):
            self.kind = kind

        def Metric(self, **_):  # noqa: N802 (Triton's name); a metric does not hold its family, as in Triton
            return Metric()

    class PB:
        MetricFamily = Family

    class Model:
        pass

    monkeypatch.setattr(metric_batch, "FAMILIES", {})
    model = Model()
    model.gauge = Level(metric_batch.family(PB, "g", "a gauge", "GAUGE").Metric())
    model.cycle = model  # held in a reference cycle, as the generator's host holds its metrics
    family, gauge = weakref.ref(metric_batch.FAMILIES["g"]), weakref.ref(model.gauge)
    assert family().kind == Family.GAUGE
    gc.collect()
    assert family() is not None and gauge() is not None  # held while the model serves
    metric_batch.release(model)
    assert family() is None and gauge() is None and not vars(model)
