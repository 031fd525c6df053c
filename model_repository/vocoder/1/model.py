"""vocoder: latent chunks -> PCM chunks with per-stream RedAE decoder state, keyed by STREAM_ID.

Dynamic batching, one instance: the same protocol serves the tts front door (BLS) and tts_ensemble.
A stream's first chunk (with prompt latents) primes its decoder, its LAST chunk flushes the iSTFT tail
and frees the state; streams idle longer than the configured time are reclaimed by a reaper thread.
"""

import threading

import numpy as np
import triton_python_backend_utils as pb

from engine.orchestrator import LENGTH, STOP, Chunk, failure_reason
from serving.auth import Keys, Refused
from serving.contract import VOCODER_OUTPUTS
from serving.supervise import start_heartbeat
from serving.triton_io import load_tts, model_parameters, read_chunk, setup_logging, tensors

log = setup_logging("vocoder")
REAP_EVERY_SECONDS = 1.0


class TritonPythonModel:
    def initialize(self, args):
        from engine.streams import VocoderService

        params = model_parameters(args)
        start_heartbeat(params, "vocoder")
        self.service = VocoderService(load_tts(params, parts=("decoder",)), float(params.get("idle_seconds", 60)),
                                      max_streams=int(params.get("max_streams", 1024)))  # fmt: skip
        self.keys = Keys.from_env(params, "vocoder")
        self.family = pb.MetricFamily(
            "tts_vocoder_active_streams", "vocoder streams holding decoder state", pb.MetricFamily.GAUGE
        )
        self.gauge = self.family.Metric()
        # One lock between execute and the reaper thread. The reaper frees streams nobody ends: a client
        # cancelled a tts_ensemble stream (the ensemble then drops the generator's last chunk) or a
        # caller died; it runs on its own clock because no request may come to trigger it.
        self.lock, self.stopping = threading.Lock(), threading.Event()
        self.reaper = threading.Thread(target=self._reap_forever, name="vocoder-reaper", daemon=True)
        self.reaper.start()

    def _reap_forever(self):
        while not self.stopping.wait(REAP_EVERY_SECONDS):
            with self.lock:
                for stream_id in self.service.reap():
                    log.warning("reclaimed vocoder stream %x after %.0f s without a chunk", stream_id,
                                self.service.idle_seconds)  # fmt: skip
                self.gauge.set(self.service.active)

    def finalize(self):
        self.stopping.set()
        self.reaper.join(5)

    def execute(self, requests):
        with self.lock:
            return self._execute(requests)

    def _execute(self, requests):
        parsed = []  # a Chunk per request, or the error that makes it unreadable or refused
        for r in requests:
            try:
                parsed.append(self._read(r))
            except Refused as e:
                parsed.append(e)
            except Exception as e:
                parsed.append(ValueError(f"vocoder: {e}"))
        outs = iter(self.service.process_many([c for c in parsed if not isinstance(c, Exception)]))
        responses = []
        for chunk in parsed:
            out = chunk if isinstance(chunk, Exception) else next(outs)
            if isinstance(out, Exception):  # a normal response that says why: an ensemble hangs on errors
                log.warning("vocoder chunk failed: %s", out)
                values = {"AUDIO": np.zeros(0, np.float32), "FINISH_REASON": failure_reason(out)}
            else:
                values = {"AUDIO": out, "FINISH_REASON": chunk.finish_reason}
            responses.append(pb.InferenceResponse(tensors(pb, VOCODER_OUTPUTS, values)))
        self.gauge.set(self.service.active)
        return responses

    def _read(self, request) -> Chunk:
        """The request's chunk, if it may act: only ids the generator issued can start or feed a stream
        (a chunk that only frees a stream is harmless with any id: no live stream has an unissued one)."""
        self.keys.admit(self.keys.split(request.parameters())[1], "vocoder")
        chunk = read_chunk(lambda n: _input(request, n))
        frees_only = chunk.last and chunk.finish_reason not in (STOP, LENGTH)
        if not frees_only and not self.keys.valid_stream_id(chunk.stream_id):
            raise ValueError("unknown stream (stream ids are issued by the generator)")
        return chunk


def _input(request, name):
    t = pb.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()
