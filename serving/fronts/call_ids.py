"""Each gRPC stream call through the front gets a namespace of sequence ids of its own, so that a text-in
stream (serving.intake.text_streams, keyed by the sequence id ``tts`` sees) belongs to the call that opened it.

The front decodes every request of a ModelStreamInfer call (a ``ModelInferRequest``; responses stay raw bytes:
Triton does not echo the sequence id in them) and replaces a non-zero ``sequence_id`` parameter by one
private to the call: a START (``sequence_start``) names a new random 63-bit id and the call keeps it until
the END of that sequence; a later request of the call with the same client id gets the same private id; a
request of an id this call never STARTed (another client's id, or one already ENDed) gets a fresh random id
that names no stream, so ``tts`` answers it as any unknown id ("no open text stream"). The table holds at
most MAX_SEQUENCES ids a call STARTed and did not END; a START past that drops the oldest (its later pieces
are then unknown): a client needs one per text stream, and the server bounds its open streams anyway.
"""

from __future__ import annotations

import secrets

from tritonclient.grpc import service_pb2

MAX_SEQUENCES = 16  # sequences one call may have STARTed and not ENDed (client/text_in.py opens one a call)


def private_id() -> int:
    """A random positive 63-bit sequence id (never 0, which means "no sequence")."""
    return secrets.randbits(63) | 1


class CallIds:
    """One stream call's client sequence ids -> Triton's (ints, or strings for string ids)."""

    def __init__(self):
        self.open: dict[int | str, int] = {}  # the client's id of each sequence STARTed -> its private id

    def rewrite(self, message: bytes) -> bytes:
        """A request as the client sent it -> as Triton gets it (the same bytes when it names no sequence).
        A message that does not parse is passed on as it came (Triton refuses it as it would have)."""
        request = service_pb2.ModelInferRequest()
        try:
            request.ParseFromString(message)
        except Exception:  # noqa: BLE001 (protobuf's DecodeError; Triton answers it in its own words)
            return message
        params = request.parameters
        if "sequence_id" not in params:
            return message
        given = params["sequence_id"]
        kind = given.WhichOneof("parameter_choice")
        client_id = getattr(given, kind) if kind in ("int64_param", "uint64_param", "string_param") else 0
        if not client_id:
            return message
        ours = self.map(client_id, params["sequence_start"].bool_param if "sequence_start" in params else False,
                        params["sequence_end"].bool_param if "sequence_end" in params else False)  # fmt: skip
        given.Clear()
        if kind == "string_param":
            given.string_param = f"{ours:x}"
        else:
            setattr(given, kind, ours)
        return request.SerializeToString()

    def map(self, client_id: int | str, start: bool, end: bool) -> int:
        """The private id of one request's sequence; START opens a mapping (or keeps the open one: a second
        START on an open stream is refused by tts as before), END retires it."""
        if start and client_id not in self.open:
            if len(self.open) >= MAX_SEQUENCES:
                del self.open[next(iter(self.open))]
            self.open[client_id] = private_id()
        ours = self.open.pop(client_id, None) if end else self.open.get(client_id)
        return private_id() if ours is None else ours
