"""Each gRPC stream call through the front gets sequence ids of its own, so that a text-in stream belongs to
the call that opened it; only a request's parameters are decoded. How and why: docs/operations.md ("Text
streams belong to their call")."""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from engine.protocol import new_stream_id

MAX_SEQUENCES = 16  # sequences one call may have STARTed and not ENDed (client/text_in.py opens one a call)
PARAMETERS = service_pb2.ModelInferRequest.DESCRIPTOR.fields_by_name["parameters"].number  # 4


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]  # IndexError past the end
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def parameters_of(message: bytes) -> tuple[service_pb2.ModelInferRequest, list[memoryview]] | None:
    """A ModelInferRequest's ``parameters`` (a request holding only them) and the rest of its top-level fields
    as they came; None if it is not a well-formed message. Walks the top-level fields only: a tensor's bytes
    are skipped, not copied or decoded."""
    buf, i, params, rest = memoryview(message), 0, [], []
    try:
        while i < len(buf):
            start = i
            key, i = _varint(buf, i)
            wire = key & 7
            if wire == 0:
                _, i = _varint(buf, i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                size, i = _varint(buf, i)
                i += size
            elif wire == 5:
                i += 4
            else:  # groups: not in this message
                return None
            if i > len(buf):
                return None
            (params if key >> 3 == PARAMETERS and wire == 2 else rest).append(buf[start:i])
        request = service_pb2.ModelInferRequest()
        request.ParseFromString(b"".join(params))
    except Exception:  # noqa: BLE001 (IndexError, ValueError, protobuf's DecodeError: not a request)
        return None
    return request, rest


class CallIds:
    """One stream call's client sequence ids -> Triton's (ints, or strings for string ids)."""

    def __init__(self):
        self.open: dict[int | str, int] = {}  # the client's id of each sequence STARTed -> its private id

    def rewrite(self, message: bytes) -> bytes:
        """A request as the client sent it -> as Triton gets it: the same bytes when it names no sequence or does
        not parse (Triton refuses it in its own words); its tensors are skipped over, copied once if the id changes."""
        found = parameters_of(message)
        if found is None:
            return message
        request, rest = found
        params = request.parameters
        if "sequence_id" not in params:
            return message
        given = params["sequence_id"]
        kind = given.WhichOneof("parameter_choice")
        client_id = getattr(given, kind) if kind in ("int64_param", "uint64_param", "string_param") else 0
        if not client_id:
            return message
        # START opens a mapping (or keeps the open one: a second START on an open stream is refused by tts as
        # before), END retires it; an id the call never STARTed gets a fresh one
        if ("sequence_start" in params and params["sequence_start"].bool_param) and client_id not in self.open:
            if len(self.open) >= MAX_SEQUENCES:
                del self.open[next(iter(self.open))]
            self.open[client_id] = new_stream_id()
        end = "sequence_end" in params and params["sequence_end"].bool_param
        ours = (self.open.pop(client_id, None) if end else self.open.get(client_id)) or new_stream_id()
        given.Clear()
        if kind == "string_param":
            given.string_param = f"{ours:x}"
        else:
            setattr(given, kind, ours)
        return b"".join([request.SerializeToString(), *rest])
