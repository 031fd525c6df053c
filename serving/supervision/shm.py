"""The shared-memory segments of Triton's Python backend (``/dev/shm/<prefix>*``, one prefix per server:
``TritonServer.shm_prefix``): removed by the server's stop, the watchdog and the next server's start. Imported by
the watchdog, so it imports nothing of ours."""

from __future__ import annotations

import re
from pathlib import Path

SHM_OWNER = re.compile(r"tts(\d+)_")  # TritonServer.shm_prefix: tts<pid of the process that started it>_


def remove_segments(prefix: str = "", shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Remove (and name) the segments ``prefix*`` that a killed server's Python backend leaves; without a prefix,
    those of servers whose starting process is gone (SIGKILLed: no ``stop``, no watchdog), never a live one's."""
    removed = []
    for segment in shm_dir.glob(f"{prefix or 'tts'}*"):
        if prefix or ((owner := SHM_OWNER.match(segment.name)) and not Path(f"/proc/{owner[1]}").exists()):
            segment.unlink(missing_ok=True)
            removed.append(segment.name)
    return removed
