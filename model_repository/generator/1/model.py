"""generator: every live stream stepped on one engine thread (serving.stub.generator_host); key-less requests
refused (T9). docs/architecture.md, "The generator's engine thread" and "The generator pipe"."""

import triton_python_backend_utils as pb

from engine.protocol import Chunk, end_chunk, failure_reason
from serving.config.model_options import GeneratorOptions
from serving.flow.receipts import PARAMETER as RECEIPT
from serving.intake.request_inputs import stream_request
from serving.security.auth import Refused
from serving.stub.chunk_pipe import OPEN, pack
from serving.stub.chunk_pipe import PARAMETER as PIPE
from serving.stub.generator_host import Arrival, GeneratorHost
from serving.stub.generator_pipes import PipeOpening
from serving.stub.metric_batch import release
from serving.stub.triton_io import error_response, setup_logging

log = setup_logging("generator")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.host = GeneratorHost(pb, GeneratorOptions.read(args), send)

    def execute(self, requests):
        host = self.host
        for r in requests:  # parsed here, on Triton's thread, while the engine thread steps
            sender = r.get_response_sender()
            try:
                given, trusted = host.keys.split(r.parameters())
                host.keys.admit(trusted, "generator")
            except (Refused, ValueError) as e:
                sender.send(error_response(pb, e), flags=FINAL)
                continue
            try:
                stream_id = r.correlation_id()
                pipe = given.pop(PIPE, "")
                if pipe == OPEN:  # paced by its reader's receipt (T23)
                    host.arrivals.put(PipeOpening(stream_id, sender, host.receipts.entry(given.pop(RECEIPT, ""))))
                    continue
                if not pipe:
                    raise ValueError(f"a generator stream names its pipe (the {PIPE!r} parameter)")
                host.arrivals.put(Arrival(stream_id, stream_request(pb, r, host.model, given), sender, int(pipe, 16)))
            except Exception as e:  # bad input fails this request only
                if not isinstance(e, ValueError):
                    log.exception("could not read a stream request")
                send(sender, [end_chunk(0, failure_reason(e))], True)

    def finalize(self):
        self.host.close()
        release(self)


def send(sender, chunks: list[Chunk] | None, final: bool) -> None:  # GeneratorHost's one way to send
    tensors = [pb.Tensor(name, value[None]) for name, value in pack(chunks).items()] if chunks else []
    response = None if chunks is None else pb.InferenceResponse(tensors)  # None: only the FINAL flag
    sender.send(response, flags=FINAL if final or chunks is None else 0)
