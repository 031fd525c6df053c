"""A generator pipe's parameter and packing: docs/architecture.md, "The generator pipe"."""

from __future__ import annotations

import numpy as np

from engine.protocol import LATENT_DIM, Chunk
from serving import contract

PARAMETER = "pipe"  # a generator request's pipe: OPEN to open one, or the pipe's id in hex to use it
OPEN = "open"
# pipes a generator keeps at once (a new one past it ends the oldest): each reading process (tts's instances,
# ensemble_generator: serving.config.options.MAX_TTS_INSTANCES + 1) reads its open pipe and up to 4 rotated ones
MAX_PIPES = 48


def pack(chunks: list[Chunk]) -> dict[str, np.ndarray]:
    """``chunks`` (of any streams; a stream's in order) -> the arrays of one pipe response."""
    n = len(chunks)
    table = np.empty((n, contract.PIPE_COLUMNS), np.uint64)
    strings = np.empty((n, 2), np.object_)
    for i, c in enumerate(chunks):
        table[i] = (c.stream_id, c.seq, c.seal, len(c.latents), len(c.prompt_latents), c.last)
        strings[i, 0] = c.finish_reason.encode("utf-8", "surrogatepass")
        strings[i, 1] = c.text.encode("utf-8", "surrogatepass")
    rows = [a for c in chunks for a in (c.latents, c.prompt_latents)]
    latents = np.concatenate(rows).astype(np.float32, copy=False) if rows else np.zeros((0, LATENT_DIM), np.float32)
    return {"PIPE_CHUNKS": table, "PIPE_LATENTS": latents.reshape(-1, LATENT_DIM), "PIPE_TEXT": strings}


def unpack(tensor) -> list[Chunk]:
    """The arrays of one pipe response (``tensor(name)`` gives each as numpy, a batch dimension or not)
    -> its chunks, in the order packed. ValueError naming the tensor for what :func:`pack` never writes
    (checked before anything is copied: a chunk's rows within the contract's bounds, the rows adding up)."""
    table, latents, strings = tensor("PIPE_CHUNKS"), tensor("PIPE_LATENTS"), tensor("PIPE_TEXT")
    if table is None or latents is None or strings is None:
        raise ValueError("a pipe response lacks PIPE_CHUNKS, PIPE_LATENTS or PIPE_TEXT")
    if table.size % contract.PIPE_COLUMNS or latents.size % LATENT_DIM:
        raise ValueError(f"PIPE_CHUNKS {table.shape} or PIPE_LATENTS {latents.shape} are not whole rows")
    table, latents = table.reshape(-1, contract.PIPE_COLUMNS), latents.reshape(-1, LATENT_DIM)
    n = len(table)
    if strings.size != 2 * n:
        raise ValueError(f"PIPE_TEXT has {strings.size} values for {n} chunks")
    strings = strings.reshape(n, 2)
    sizes = table[:, 3:5]
    if (sizes[:, 0] > contract.MAX_CHUNK_LATENTS).any() or (sizes[:, 1] > contract.MAX_PROMPT_LATENTS).any():
        raise ValueError("a pipe chunk has more latents than the contract allows")
    if int(sizes.sum()) != len(latents):
        raise ValueError(f"PIPE_CHUNKS count {int(sizes.sum())} latent rows, PIPE_LATENTS has {len(latents)}")
    out, at = [], 0
    for i in range(n):
        stream_id, seq, seal, rows, prompt_rows, last = (int(v) for v in table[i])
        chunk_latents = latents[at : at + rows]
        at += rows
        prompt = latents[at : at + prompt_rows]
        at += prompt_rows
        out.append(Chunk(stream_id, chunk_latents, prompt, bool(last), _text(strings[i, 0]), seq, seal,
                         _text(strings[i, 1])))  # fmt: skip
    return out


def _text(value) -> str:
    return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else str(value)
