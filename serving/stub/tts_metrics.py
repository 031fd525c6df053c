"""``tts``'s metric families (model_repository/tts/1/model.py), made once at its start and kept for its life
(Triton drops a family nobody holds)."""

from __future__ import annotations

FIRST_CHUNK_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]


class TTSMetrics:
    """Requests by outcome, the gauges of requests in flight, waiting and text-in streams open, the audio
    streamed and the first chunk's latency."""

    def __init__(self, pb, batch):
        """``batch``: the serving.stub.metric_batch.MetricBatch that moves them."""
        self.batch = batch
        self.requests = pb.MetricFamily("tts_requests_total", "tts requests by outcome", pb.MetricFamily.COUNTER)
        self.outcome = {k: self.requests.Metric(labels={"outcome": k}) for k in ("ok", "error", "cancelled", "busy")}
        self.gauges = [
            pb.MetricFamily("tts_requests_in_flight", "tts requests holding an admission place", pb.MetricFamily.GAUGE),
            pb.MetricFamily("tts_requests_waiting", "tts requests with no audio sent yet", pb.MetricFamily.GAUGE),
            pb.MetricFamily("tts_text_streams_open", "text-in streams open", pb.MetricFamily.GAUGE),
        ]
        self.in_flight, self.waiting, self.open = (g.Metric() for g in self.gauges)
        self.counts = [0, 0]  # requests in flight, waiting
        self.audio_family = pb.MetricFamily("tts_audio_seconds_total", "audio streamed", pb.MetricFamily.COUNTER)
        self.audio_seconds = self.audio_family.Metric()
        self.first_family = pb.MetricFamily("tts_first_chunk_seconds", "request arrival to first audio chunk sent",
                                            pb.MetricFamily.HISTOGRAM)  # fmt: skip
        self.first_chunk = self.first_family.Metric(buckets=FIRST_CHUNK_BUCKETS)

    def count(self, in_flight: int, waiting: int) -> None:
        """Requests that took (1) or gave back (-1) an admission place, or began (-1) to wait for audio."""
        self.counts[0] += in_flight
        self.counts[1] += waiting
        self.batch.set(self.in_flight, self.counts[0])
        self.batch.set(self.waiting, self.counts[1])

    def streams_open(self, n: int) -> None:
        self.batch.set(self.open, n)
