"""vocoder: latent chunks -> PCM chunks with per-stream RedAE decoder state, keyed by STREAM_ID; decoupled,
``execute`` queues, an engine thread decodes what queued in one forward (docs/triton.md#T13;
docs/architecture.md, "Vocoder batching", "Sealing")."""

import queue
import threading
import time

import triton_python_backend_utils as pb

from engine.protocol import failure_reason
from engine.synthetic import SyntheticVocoderService
from engine.vocoder_service import VocoderService
from serving.config.model_options import VocoderOptions
from serving.flow.side_channel import SideChannel
from serving.security.auth import Keys, Refused
from serving.security.vocoder_guard import VocoderGuard
from serving.stub.metric_batch import Level, announce, family, release
from serving.stub.triton_io import Throttled, get, load_model, read_chunk, setup_logging
from serving.stub.vocoder_batch import answer, rows
from serving.supervision.run_folder import start_heartbeat

log = setup_logging("vocoder")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
REAP_EVERY_SECONDS = 1.0


class TritonPythonModel:
    def initialize(self, args):
        opts = VocoderOptions.read(args)
        start_heartbeat(opts.run_dir, "vocoder")
        model, kw = load_model(opts, parts=("decoder",)), {"batch_invariant": opts.batch_invariant}
        service, kw = (SyntheticVocoderService, {}) if opts.synthetic_math else (VocoderService, kw)  # engine.synthetic
        self.service = service(model, opts.idle_seconds, max_streams=opts.max_streams, **kw)
        self.synthetic = announce(pb, log, "vocoder") if opts.synthetic_math else None
        self.keys = Keys.from_env("vocoder", opts.public_steps)
        self.guard = VocoderGuard(self.keys, SideChannel(opts.cancel_dir or None), opts.max_streams)
        self.batch = opts.batch
        active = family(pb, "tts_vocoder_active_streams", "vocoder streams holding decoder state", "GAUGE")
        self.gauge = Level(active.Metric())  # moved by increment, never Metric.set (docs/triton.md#T19)
        self.refusals = Throttled(log)  # anyone can send chunks that are refused
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.engine = threading.Thread(target=self._run, name="vocoder-engine", daemon=True)
        self.engine.start()

    def execute(self, requests):
        for r in requests:
            self.queue.put(r)

    def _run(self):
        """The engine thread: batches of queued chunks, and the reaper between them (one thread: no lock)."""
        next_reap = time.monotonic() + REAP_EVERY_SECONDS
        while not self.stopping.is_set():
            batch = take(self.queue, self.batch, _batch, timeout=max(0.0, next_reap - time.monotonic()))
            if batch:
                self._process(batch)
            if time.monotonic() >= next_reap:
                for stream_id in self.guard.reap(self.service.streams, self.service.idle_seconds):
                    log.warning("reclaimed vocoder stream %x: its generator stream is over or it idled", stream_id)
                self.gauge.set(self.service.active)
                next_reap = time.monotonic() + REAP_EVERY_SECONDS

    def _process(self, requests) -> None:
        """Each request is a batch of chunks (serving.stub.vocoder_batch); all of them decode together."""
        parsed, sizes, opening = [], [], 0  # per chunk: a Chunk to decode, or (finish reason, error) to answer with
        for r in requests:
            try:
                items, opening = self._read(r, opening)
            except Exception as e:  # never leave a request unanswered
                items = [("", RuntimeError(f"vocoder: {e}"))] * max(1, _batch(r))
            parsed += items
            sizes.append(len(items))
        try:
            outs = iter(self.service.process_many([c for c in parsed if not isinstance(c, tuple)]))
        except Exception as e:  # never leave a request unanswered
            log.exception("vocoder batch failed")
            outs = iter([RuntimeError(f"vocoder failed: {e}")] * len(parsed))
        results = []
        for item in parsed:
            if isinstance(item, tuple):
                (reason, error), audio = item, None
            else:
                out, reason = next(outs), item.finish_reason
                audio, error = (None, out) if isinstance(out, Exception) else (out, None)
            if error is not None:
                self.refusals.warning("vocoder chunk refused or failed: %s", error)
                reason = failure_reason(error)
            results.append((audio, reason))
        for r, size in zip(requests, sizes, strict=True):
            mine, results = results[:size], results[size:]
            out = [pb.Tensor(name, value) for name, value in answer(mine).items()]
            r.get_response_sender().send(pb.InferenceResponse(out), flags=FINAL)
        self.gauge.set(self.service.active)

    def _read(self, request, opening: int) -> tuple[list, int]:
        """Per chunk of the request: the chunk if the vocoder may decode it, else (finish reason, error); and
        ``opening`` (the streams this batch opens) counted on past the request's."""
        try:
            trusted = self.keys.split(request.parameters())[1]
            self.keys.admit(trusted, "vocoder")
            accessors = rows(lambda n: get(pb, request, n, required=False))
        except Exception as e:  # unreadable or refused: every chunk of it answered so
            error = e if isinstance(e, Refused) else ValueError(f"vocoder: {e}")
            return [("", error)] * max(1, _batch(request)), opening
        # only key-less chunks can come from an ensemble whose client left (ours are BLS requests)
        cancelled = not trusted and request.is_cancelled()
        items = []
        for tensor in accessors:
            try:
                chunk = read_chunk(tensor)
                decision = self.guard.decide(chunk, self.service.streams, cancelled, opening, trusted)
                opening += decision.decode and bool(len(chunk.prompt_latents))
                items.append(chunk if decision.decode else (decision.reason, decision.error))
            except Exception as e:  # this chunk alone
                items.append(("", ValueError(f"vocoder: {e}")))
        return items, opening

    def finalize(self):
        self.stopping.set()
        self.engine.join(5)
        release(self)


def take(q: queue.SimpleQueue, most: int, size, timeout: float) -> list:
    """The first item within ``timeout`` seconds, then what else has queued, no waiting, until the items
    hold ``most`` rows (``size(item)``; an item is never split). What comes meanwhile waits for the next."""
    try:
        batch = [q.get(timeout=timeout)]
    except queue.Empty:
        return []
    rows = size(batch[0])
    while rows < most:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            break
        rows += size(batch[-1])
    return batch


def _batch(request) -> int:
    """The rows a request says it has (1 when even that is unreadable)."""
    try:
        t = get(pb, request, "STREAM_ID", required=False)
        return 1 if t is None or not t.ndim else len(t)
    except Exception:  # noqa: BLE001 (its reading fails again in _read, and is answered there)
        return 1
