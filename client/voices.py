"""Named voices on the server (the ``voices`` model): register once, then synthesize with VOICE_ID."""

from __future__ import annotations

import json
import os

import numpy as np

from client.request import TTSError, grpc_error, grpc_inputs
from client.tts_client import _host_port

ADMIN_KEY_ENV = "TTS_ADMIN_KEY"


def kept_admin_key_file() -> str:
    """Where a launcher on this machine keeps the key it generated (serving.security.admin_key, its default state
    directory), worked out here so that the client loads no server module; a test checks they agree."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fireredtts3-triton", "admin_key")


def default_admin_key() -> str:
    """$TTS_ADMIN_KEY, else the key a launcher on this machine keeps (if this user can read it), else ""."""
    if os.environ.get(ADMIN_KEY_ENV):
        return os.environ[ADMIN_KEY_ENV]
    try:
        with open(kept_admin_key_file()) as f:
            return f.readline().strip()
    except OSError:
        return ""


class VoiceClient:
    """``admin_key`` (default: $TTS_ADMIN_KEY, else the key a launcher on this machine keeps) is needed to
    add and remove voices, not to list them.

    Errors are those of :class:`client.TTSClient`: :class:`client.Forbidden` for a missing or wrong key,
    :class:`client.NotFound` for removing a voice that is not registered, :class:`client.InvalidRequest`
    for a bad name or recording."""

    def __init__(self, url: str, protocol: str = "grpc", timeout: float = 120.0, admin_key: str | None = None):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        self.protocol, self.timeout = protocol, timeout
        self.admin_key = admin_key if admin_key is not None else default_admin_key()
        self.host, self.port = _host_port(url, 8001 if protocol == "grpc" else 8000)

    def add(self, name: str, audio: np.ndarray, sample_rate: int, text: str = "") -> dict:
        """Encode ``audio`` on the server and store it as ``name`` (replacing a voice of that name)."""
        return self._call("add", name=name, audio=audio, sample_rate=sample_rate, text=text)

    def list(self) -> list[dict]:
        return self._call("list")

    def remove(self, name: str) -> dict:
        return self._call("remove", name=name)

    def check_key(self) -> None:
        """Whether the server takes this client's admin key: an error (TTSError) if not, nothing done."""
        self._call("check")

    def _call(self, action, name=None, audio=None, sample_rate=None, text=None):
        if self.protocol == "grpc":
            import tritonclient.grpc as tc
            from tritonclient.utils import InferenceServerException
        else:
            import tritonclient.http as tc
            from tritonclient.utils import InferenceServerException
        fields = {"ACTION": action, "NAME": name}
        if audio is not None:
            fields |= {"REF_AUDIO": audio, "REF_SAMPLE_RATE": sample_rate, "REF_TEXT": text or ""}
        inputs = grpc_inputs({k: v for k, v in fields.items() if v is not None}, tc, "voices")
        kw = {"client_timeout": self.timeout} if self.protocol == "grpc" else {}
        if self.admin_key and action != "list":
            kw["parameters"] = {"admin_key": self.admin_key}
        client = (tc.InferenceServerClient(f"{self.host}:{self.port}") if self.protocol == "grpc"
                  else tc.InferenceServerClient(f"{self.host}:{self.port}", network_timeout=self.timeout))  # fmt: skip
        try:
            result = client.infer("voices", inputs, **kw)
        except InferenceServerException as e:  # the server's verdict by its kind tag, or a transport failure
            raise grpc_error(e) from None
        finally:
            client.close()
        raw = result.as_numpy("RESULT").reshape(-1)[0]
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


# ---- `python -m client --url U voices {add,list,remove}` ----
HELP = "manage named voices on the server: add NAME --audio WAV --text T | list | remove NAME"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    add = sub.add_parser("add", help="encode a reference recording and store it as NAME")
    add.add_argument("name")
    add.add_argument("--audio", required=True, help="reference recording (any format libsndfile reads)")
    add.add_argument("--text", default="", help="transcript of the recording")
    sub.add_parser("list", help="list registered voices")
    rm = sub.add_parser("remove", help="delete a voice")
    rm.add_argument("name")
    for q in (add, rm):
        q.add_argument("--admin-key", default=None,
                       help=f"the server's admin key itself (default: ${ADMIN_KEY_ENV}, else the one a launcher on "
                            f"this machine keeps in {kept_admin_key_file()})")  # fmt: skip


def run(args) -> int:
    import sys

    from client.audio_io import read_audio

    client = VoiceClient(
        args.url or "127.0.0.1",
        args.protocol,
        timeout=max(args.timeout, 120.0),
        admin_key=getattr(args, "admin_key", None),
    )
    try:
        if args.action == "add":
            try:
                audio, sr = read_audio(args.audio)
            except Exception as e:
                print(f"error: cannot read --audio {args.audio}: {e}", file=sys.stderr)
                return 2
            v = client.add(args.name, audio, sr, args.text)
            print(f"added voice {v['name']} ({v['seconds']:.1f} s)", file=sys.stderr)
        elif args.action == "list":
            for v in client.list():
                print(f"{v['name']}\t{v['seconds']:.1f} s\t{v['text']}")
        else:
            client.remove(args.name)
            print(f"removed voice {args.name}", file=sys.stderr)
    except (TTSError, ConnectionError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
