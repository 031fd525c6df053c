"""A server for the benchmark to run against: a random-weight checkpoint of a preset, made once in the
git-ignored ``cache/bench/``, served by tritonserver on free loopback ports and always stopped.

The checkpoint's stop head never fires (as in the integration tests), so every utterance is exactly
``max_patches`` long and runs at different concurrencies are comparable.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from serving.supervision.triton_env import REPO_ROOT, Ports, TritonServer

CACHE = REPO_ROOT / "cache" / "bench"


def nostop_checkpoint(preset: str, seed: int = 0) -> Path:
    """``cache/bench/checkpoints/{preset}-nostop-seed{seed}``, written on first use; ``full``: Base only,
    float32, written a shard at a time into ``cache/full_size/`` (bench.full_size, seed 0)."""
    from engine.config import nostop

    if preset == "full":
        from bench.full_size import full_checkpoint

        return full_checkpoint(stop=False, progress=lambda s: print(s, file=sys.stderr, flush=True))
    from engine.random_checkpoint import cached_checkpoint

    return cached_checkpoint(nostop(preset), CACHE / "checkpoints" / f"{preset}-nostop-seed{seed}", seed=seed)


@contextmanager
def local_server(
    preset: str, slots: int, device: str = "cpu", max_queue: int = -1, **options
) -> Iterator[TritonServer]:
    """A ready server for ``preset`` with ``slots`` generator slots on ``device`` and ``max_queue``
    places for requests waiting for a slot (-1: the server's default); its log stays in ``cache/bench/run/``.
    ``options``: other :class:`~serving.config.options.ServeOptions` fields (``synthetic_math=True``)."""
    from serving.config.repository import ServeOptions, build

    ckpt = nostop_checkpoint(preset)
    (CACHE / "run").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{preset}-", dir=CACHE / "run"))
    opts = ServeOptions(
        checkpoint=str(ckpt),
        slots=slots,
        voice_dir=str(work / "voices"),
        cancel_dir=str(work / "cancel"),
        device=device,
        max_queue=max_queue,
        **options,
    )
    server = TritonServer(build(work / "model_repository", opts), work, Ports.free())
    print(
        f"starting tritonserver ({preset}, {slots} slots, {device}); log: {work / 'tritonserver.log'}",
        file=sys.stderr,
        flush=True,
    )
    with server:
        yield server
