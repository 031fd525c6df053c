"""A server for the benchmark to run against: a random-weight checkpoint of a preset, made once in the
git-ignored ``cache/bench/``, served by tritonserver on free loopback ports and always stopped.

The checkpoint's stop head never fires (as in the integration tests), so every utterance is exactly
``max_patches`` long and runs at different concurrencies are comparable.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from engine.triton_env import REPO_ROOT, Ports, TritonServer

CACHE = REPO_ROOT / "cache" / "bench"


def nostop_checkpoint(preset: str, seed: int = 0) -> Path:
    """``cache/bench/checkpoints/{preset}-nostop-seed{seed}``, written on first use."""
    from engine.checkpoint import make_checkpoint
    from engine.config import PRESETS

    path = CACHE / "checkpoints" / f"{preset}-nostop-seed{seed}"
    if not (path / "text_tokenizer" / "tokenizer.json").is_file():
        print(f"creating the {preset} benchmark checkpoint in {path} (first use) ...", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent))  # same filesystem: the rename is atomic
        try:
            make_checkpoint(replace(PRESETS[preset], name=f"{preset}-nostop", stop_bias=-30.0), tmp / "ck", seed=seed)
            if not path.exists():
                os.replace(tmp / "ck", path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


@contextmanager
def local_server(preset: str, slots: int) -> Iterator[TritonServer]:
    """A ready server for ``preset`` with ``slots`` generator slots; its log stays in ``cache/bench/run/``."""
    from engine.repository import ServeOptions, build

    ckpt = nostop_checkpoint(preset)
    (CACHE / "run").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{preset}-", dir=CACHE / "run"))
    opts = ServeOptions(
        checkpoint=str(ckpt), slots=slots, voice_dir=str(work / "voices"), cancel_dir=str(work / "cancel")
    )
    server = TritonServer(build(work / "model_repository", opts), work, Ports.free())
    print(
        f"starting tritonserver ({preset}, {slots} slots); log: {work / 'tritonserver.log'}",
        file=sys.stderr,
        flush=True,
    )
    with server:
        yield server
