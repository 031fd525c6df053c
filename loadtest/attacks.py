"""The open-door attacks, replayable against a running server (no key; loopback only):

    python -m loadtest.attacks --url 127.0.0.1:8001 [--gateway http://127.0.0.1:8080] [--minutes 10] [--every 5]
                               [--only vocoder_bomb,...]

Each attack is one function that sends what an unauthenticated client could, at the smallest size that
showed the effect before it was fixed, and returns what the server answered (the tests in
tests/integration/test_open_door.py assert on these; the loop here prints them, for a soak run beside
real load). Before the fix: a 4,000-row vocoder chunk stalled every stream 3.4 s; 80 streams of an
80-stream vocoder table locked everyone out; START requests cancelled while they waited, or a request
without START on a live sequence id, took Triton's generator slots until they silently stopped serving;
abandoned tts_ensemble streams held every slot for up to max_patches.
Issue 30's (the last four need the gateway): bursts of voice designs past max_sequence_idle leaked admission
places for good; references at odd rates (8009, 12007, 191999 Hz) cost gigabytes to resample; gRPC streams
whose client never reads kept their audio in tritonserver; 128 concurrent 19 MB uploads took the gateway
to 7.8 GB; HTTP clients that stop reading kept their slots.
Issue 47's, on the voice-agent surfaces, are in loadtest/agent_attacks.py and replayed from here too.
Past 300 lines on purpose: a catalogue of independent attacks, one function each, that one command replays
side by side; apart, they would not run together.
"""

from __future__ import annotations

import argparse
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import tritonclient.grpc as grpcclient

from loadtest import agent_attacks
from serving import contract

SILENT = {"TEXT": "An attack", "PROMPT_LATENTS": np.zeros((4, contract.LATENT_DIM), np.float32),
          "SPEAKER": np.zeros(contract.SPEAKER_DIM, np.float32), "PROMPT_TEXT": ""}  # fmt: skip
SPECS = {"prompt_encoder": contract.PROMPT_INPUTS, "ensemble_generator": contract.GENERATOR_INPUTS,
         "generator": contract.GENERATOR_INPUTS, "vocoder": contract.VOCODER_INPUTS}  # fmt: skip


def inputs(model: str, values: dict, tc=grpcclient) -> list:
    """``values`` as the batched tensors ``model`` takes (a leading batch dimension of 1), as ``tc``'s
    ``InferInput`` (``tritonclient.grpc`` or ``tritonclient.http``). The generator's name may carry the
    run's secret."""
    specs = {s.name: s for s in SPECS["generator" if model.startswith("generator") else model]}
    out = []
    for name, value in values.items():
        arr = specs[name].array(value)[None]
        t = tc.InferInput(name, list(arr.shape), specs[name].datatype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def random_id() -> int:
    return secrets.randbits(62) | (1 << 62)


def stream(url: str, model: str, values: dict, parameters: dict | None = None, sequence_id: int = 0,
           start: bool = True, stop_after: int = 0, cancel_after: float = 0.0, timeout: float = 30.0):  # fmt: skip
    """One gRPC stream request -> (responses, errors). ``stop_after`` responses, or ``cancel_after``
    seconds, then the stream is cancelled (a client that leaves); ``sequence_id`` 0 sends none."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    results, errors = [], []
    try:
        seq = {"sequence_id": sequence_id, "sequence_start": start} if sequence_id else {}
        client.async_stream_infer(model, inputs(model, values), parameters=parameters or {},
                                  enable_empty_final_response=True, **seq)  # fmt: skip
        if cancel_after:
            time.sleep(cancel_after)
            return results, errors
        while True:
            try:
                result, error = got.get(timeout=timeout)
            except queue.Empty:
                errors.append(f"no response for {timeout:g} s")
                break
            if error is not None:
                errors.append(str(error))
                break
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.get_response().outputs:
                results.append(result)
            if final or (stop_after and len(results) >= stop_after):
                break
        return results, errors
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def reason(result) -> str:
    return contract.text_of(result.as_numpy("FINISH_REASON"))


def vocoder(url: str, chunk: dict, timeout: float = 60.0) -> str:
    """One chunk to the vocoder -> its FINISH_REASON (or the error)."""
    results, errors = stream(url, "vocoder", chunk, timeout=timeout)
    return reason(results[-1]) if results else f"error: {errors}"


def chunk(stream_id: int, rows: int, prompt_rows: int, seq: int = 0, seal: int = 0, last: bool = False) -> dict:
    rng = np.random.default_rng()  # fresh latents: the vocoder caches primed prompts
    return {"STREAM_ID": stream_id, "LATENTS": rng.standard_normal((rows, contract.LATENT_DIM)).astype(np.float32),
            "PROMPT_LATENTS": rng.standard_normal((prompt_rows, contract.LATENT_DIM)).astype(np.float32),
            "LAST": last, "FINISH_REASON": "", "SEAL": (seq, seal)}  # fmt: skip


def sealed_chunks(url: str, patches: int = 3, stop_after: int = 0) -> list[dict]:
    """Genuine chunks of a stream of our own: ensemble_generator is public, as tts_ensemble's step."""
    results, _ = stream(url, "ensemble_generator", SILENT, {"max_patches": patches, "chunk_first": 1, "chunk_next": 1},
                        stop_after=stop_after)  # fmt: skip
    names = [s.name for s in contract.VOCODER_INPUTS]
    chunks = [{n: r.as_numpy(n)[0] for n in names} for r in results if r.as_numpy("STREAM_ID") is not None]
    for c in chunks:
        c["FINISH_REASON"] = contract.text_of(c["FINISH_REASON"])
    return chunks


# ---- the attacks ----
def vocoder_bomb(url: str, rows: int = 4000) -> str:
    """An oversized first chunk (prompt latents) for a stream id the generator issued."""
    first = sealed_chunks(url)[0]
    return vocoder(url, chunk(int(first["STREAM_ID"][0]), 8, rows, seal=int(first["SEAL"][1])))


def vocoder_table(url: str, streams: int) -> list[str]:
    """``streams`` forged ids, then as many replays of one genuine (sealed) first chunk."""
    out = [vocoder(url, chunk(random_id(), 4, 4, seal=secrets.randbits(63))) for _ in range(streams)]
    first = sealed_chunks(url, patches=200, stop_after=1)[0]  # its stream ends soon after: the client left
    return out + [vocoder(url, first) for _ in range(streams)]


def generator_direct(url: str, rounds: int = 200, cancel_after: float = 0.002) -> list[str]:
    """Direct generator STARTs: guessable and random ids answered, and random ids cancelled while they wait
    (what took Triton's slots), and a request without START on a random id."""
    out = []
    for _ in range(rounds):
        for sequence_id in (7, random_id()):
            results, errors = stream(url, "generator", SILENT, {"max_patches": 1}, sequence_id=sequence_id)
            out.append(errors[0] if errors else reason(results[-1]))
        stream(url, "generator", SILENT, {"max_patches": 1}, sequence_id=random_id(), cancel_after=cancel_after)
    results, errors = stream(url, "generator", SILENT, {"max_patches": 1}, sequence_id=random_id(), start=False)
    return out + [errors[0] if errors else reason(results[-1])]


def ensemble_flood(url: str, streams: int, max_patches: int, abandon_after: int = 1,
                   text: str = "An ensemble flood.", patience: float = 120.0) -> list[str]:  # fmt: skip
    """``streams`` tts_ensemble requests at once, each left after ``abandon_after`` chunks (0: read to the end)
    -> per stream the FINISH_REASON of its last response read ("" if it was left first; "no answer" if
    nothing came for ``patience`` seconds). Returns once every stream has ended so: a stream that waits
    for a generator slot gets its first chunk only when a stream ahead of it has ended."""
    out: list[str] = [""] * streams
    values = {"TEXT": text}
    specs = {s.name: s for s in contract.ENSEMBLE_INPUTS}

    def one(i):
        got: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            arr = specs["TEXT"].array(values["TEXT"])
            t = grpcclient.InferInput("TEXT", list(arr.shape), "BYTES")
            t.set_data_from_numpy(arr)
            client.async_stream_infer("tts_ensemble", [t], parameters={"max_patches": max_patches, "chunk_first": 1,
                                                                       "chunk_next": 1})  # fmt: skip
            seen = 0
            while True:
                result, error = got.get(timeout=patience)
                if error is not None:
                    out[i] = f"error: {error}"
                    return
                out[i] = contract.text_of(result.as_numpy("FINISH_REASON"))
                seen += 1
                if out[i] or (abandon_after and seen >= abandon_after):
                    return
        except queue.Empty:
            out[i] = "no answer"
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:  # each ends at its stream's end, or after ``patience`` s without a response
        t.join()
    return out


def prompt_bomb(url: str, seconds: float = 61.0) -> str:
    """A reference longer than any may be, to prompt_encoder directly."""
    rate = 16000
    values = {"REF_AUDIO": np.zeros(int(seconds * rate), np.float32), "REF_SAMPLE_RATE": rate, "TEXT": "x"}
    client = grpcclient.InferenceServerClient(url)
    try:
        client.infer("prompt_encoder", inputs("prompt_encoder", values))
        return "accepted"
    except Exception as e:  # the refusal is the answer
        return str(e)
    finally:
        client.close()


DESIGN_INSTRUCTION = ("a calm older man with a slightly hoarse voice, speaking slowly and warmly " * 7)[:500]


def design_burst(url: str, designs: int = 12, max_patches: int = 200) -> list[str]:
    """``designs`` voice designs with a 500-character instruction at once (more than the slots: the rest
    wait, longer than max_sequence_idle on a busy server) -> what each was answered."""
    from client import TTSClient

    def one(_):
        try:
            audio = TTSClient(url, timeout=300).synthesize("Hello there.", instruction=DESIGN_INSTRUCTION,
                                                           parameters={"max_patches": max_patches})  # fmt: skip
            return f"audio ({audio.size} samples)"
        except Exception as e:  # noqa: BLE001 (busy is a fair answer; no answer is not)
            return f"{type(e).__name__}: {str(e)[:80]}"

    return in_threads(one, designs)


def odd_rates(url: str, rates: tuple[int, ...] = (8009, 12007, 191999)) -> list[str]:
    """A 1 s reference at each of ``rates`` (a windowed-sinc kernel of (24000/g) x (rate/g) cost 4 to 18 GB)."""
    from client import TTSClient

    answers = []
    for rate in rates:
        t0 = time.monotonic()
        try:
            ref = (0.1 * np.sin(np.arange(rate) * 0.05)).astype(np.float32)
            audio = TTSClient(url, timeout=120).synthesize("An odd rate.", ref_audio=ref, ref_sample_rate=rate,
                                                           ref_text="x", parameters={"max_patches": 6})  # fmt: skip
            answers.append(f"{rate} Hz: audio in {time.monotonic() - t0:.1f} s ({audio.size} samples)")
        except Exception as e:  # noqa: BLE001 (the answer is the finding)
            answers.append(f"{rate} Hz: {type(e).__name__}: {str(e)[:80]}")
    return answers


def not_reading(url: str, streams: int = 4, seconds: float = 20.0, max_patches: int = 400,
                until: threading.Event | None = None) -> str:  # fmt: skip
    """``streams`` tts streams over gRPC whose client never reads, held open ``seconds`` (or ``until`` it is
    set), then cancelled. Against Triton's own port they keep their slots all that time; the gRPC front
    (serving.fronts.grpc_front) ends them once their unsent audio passes its bound."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc
    from tritonclient.grpc._utils import _get_inference_request

    from client.request import grpc_inputs, request_fields

    fields = request_fields("Nobody reads this.", seed=1)
    request = _get_inference_request("tts", grpc_inputs(fields), "", "", None, 0, False, False, 0, None,
                                     {"max_patches": max_patches, "chunk_first": 1, "chunk_next": 1})  # fmt: skip
    hold = threading.Event()

    def requests():
        yield request
        hold.wait()

    with grpc.insecure_channel(url, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelStreamInfer(requests()) for _ in range(streams)]
        if until:
            until.wait()
        else:
            time.sleep(seconds)
        for call in calls:
            call.cancel()
        hold.set()
    return f"{streams} unread streams held {'until told' if until else f'{seconds:g} s'}, then cancelled"


GATEWAY: list[str] = []  # the gateway's base URL, if --gateway is given (the attacks below need it)


def gateway_not_reading(_url: str, streams: int = 4, seconds: float = 20.0) -> str:
    """``streams`` speech requests over HTTP whose client never reads (a small receive window)."""
    import json
    import socket
    from urllib.parse import urlsplit

    if not GATEWAY:
        return "skipped: no --gateway"
    address = urlsplit(GATEWAY[0])
    body = json.dumps({"input": "Nobody reads this.", "response_format": "pcm", "max_patches": 400}).encode()
    head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    socks = []
    for _ in range(streams):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((address.hostname, address.port))
        sock.sendall(head + body)
        socks.append(sock)
    time.sleep(seconds)
    got = []
    for sock in socks:
        sock.settimeout(5)
        n = 0
        try:
            while data := sock.recv(65536):
                n += len(data)
        except OSError:  # reset (the gateway cut it) or still open after 5 s
            pass
        got.append(n)
        sock.close()
    return f"{streams} unread HTTP streams; bytes they could read after {seconds:g} s: {got}"


def big_uploads(_url: str, uploads: int = 16, megabytes: int = 19) -> list[str]:
    """``uploads`` concurrent edit uploads of ``megabytes`` each, without a key -> their statuses."""
    import httpx

    if not GATEWAY:
        return ["skipped: no --gateway"]
    data = bytes(megabytes * 2**20)

    def one(_):
        try:
            r = httpx.post(f"{GATEWAY[0]}/v1/audio/edits", data={"type": "acoustic", "instructions": "x"},
                           files={"file": ("a.wav", data)}, timeout=120)  # fmt: skip
            return f"{r.status_code}"
        except Exception as e:  # noqa: BLE001 (the answer is the finding)
            return f"{type(e).__name__}"

    return in_threads(one, uploads)


def in_threads(fn: Callable[[int], str], n: int) -> list[str]:
    """``fn(i)`` for i < n on threads of their own -> their answers."""
    answers: list[str] = [""] * n

    def run(i):
        answers[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def _gateway() -> str | None:
    return GATEWAY[0] if GATEWAY else None


ATTACKS: dict[str, Callable[[str], object]] = {
    "vocoder_bomb": vocoder_bomb,
    "vocoder_table": lambda url: vocoder_table(url, 8),
    "generator_direct": lambda url: generator_direct(url, rounds=10),
    "ensemble_flood": lambda url: ensemble_flood(url, 8, 300),
    "prompt_bomb": prompt_bomb,
    "design_burst": design_burst,
    "odd_rates": odd_rates,
    "not_reading": not_reading,
    "gateway_not_reading": gateway_not_reading,
    "big_uploads": big_uploads,
    # the voice-agent surfaces (loadtest/agent_attacks.py)
    "socket_not_reading": lambda _url: agent_attacks.socket_not_reading(_gateway()),
    "sockets_not_reading": lambda _url: agent_attacks.sockets_not_reading(_gateway()),
    "idle_calls": agent_attacks.idle_calls,
    "whitespace_streams": agent_attacks.whitespace_streams,
    "foreign_pieces": agent_attacks.foreign_pieces,
    "split_control_tokens": agent_attacks.split_control_tokens,
    "surrogate_transcript": lambda _url: agent_attacks.surrogate_transcript(_gateway()),
}


def relayed(address: str, source: str) -> str:
    """``address`` (``host:port`` or ``http://host:port``) as reached from ``source`` through a relay."""
    from urllib.parse import urlsplit

    from loadtest.source_relay import SourceRelay

    scheme, _, rest = address.rpartition("://")
    where = urlsplit(f"//{rest}")
    relay = SourceRelay((where.hostname, where.port), source)
    return f"{scheme}://{relay.address}" if scheme else relay.address


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.attacks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC address")
    ap.add_argument("--gateway", help="the OpenAI gateway's base URL (http://host:port), for the attacks on it")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between attacks")
    ap.add_argument("--only", default=",".join(ATTACKS), help="comma-separated attacks: " + ", ".join(ATTACKS))
    ap.add_argument("--source", help="attack from this loopback address (e.g. 127.0.0.2), through relays: a client "
                    "of its own for the server's per-client shares, apart from a load test on 127.0.0.1")  # fmt: skip
    args = ap.parse_args(argv)
    if args.source:  # the legitimate checks of the agent attacks stay on this address
        agent_attacks.LEGIT.update(url=args.url, **({"gateway": args.gateway} if args.gateway else {}))
        args.url, args.gateway = relayed(args.url, args.source), args.gateway and relayed(args.gateway, args.source)
    if args.gateway:
        GATEWAY.append(args.gateway.rstrip("/"))
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(ATTACKS))
    if unknown:
        ap.error(f"unknown attacks {unknown}; known: {sorted(ATTACKS)}")
    end, k = time.monotonic() + 60 * args.minutes, 0
    while time.monotonic() < end:
        name = names[k % len(names)]
        t0 = time.monotonic()
        try:
            answer = ATTACKS[name](args.url)
        except Exception as e:  # the server's state is the soak's business: report and go on
            answer = f"{type(e).__name__}: {e}"
        shown = answer if isinstance(answer, str) else sorted({str(a)[:90] for a in answer})
        at = time.strftime("%H:%M:%S")
        print(f"[attacks] {name} ({time.monotonic() - t0:.1f} s, ended {at}): {shown}", flush=True)
        k += 1
        time.sleep(args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
