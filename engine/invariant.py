"""Batch-invariant arithmetic (issue 46): a stream's numbers the same bits whoever shares its batch.

A matrix product's kernel, and so its rounding, depends on the row count (on a CPU with MKL, one row of
``F.linear(x[:m])`` differs from ``F.linear(x)[:m]`` for many m; cuBLAS also picks its algorithm by
shape), but at a fixed row count a row's result does not depend on its place or on the other rows. So
inside :func:`batch_invariant` the ``nn.Linear`` layers of a module passed to :func:`install` (all of the
engine's products are ``nn.Linear``) multiply in tiles of :data:`TILE` rows, the last zero-padded, as one
batched product (``bmm`` of the tiles: on this CPU a tile's bits do not depend on the number of tiles, and
it is twice as fast as a product per tile for small layers). The generator's step and the vocoder's
decode run inside it; the backbone's attention over the paged cache takes each row over exactly its own
keys (:class:`engine.kv_cache.RowAttention`). docs/serving.md "What a seed guarantees" has what was
measured and what it costs.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

TILE = 8  # rows per product: a step's backbone rows (<= slots) are one tile or a few
_on = threading.local()  # per thread: the vocoder's or a prompt encoder's thread is not affected


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed TILE rows at a time, so each row's bits are the same in any batch."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = -n % TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    tiles = rows.view(-1, TILE, rows.shape[1])  # one batched product of (TILE, in) x (in, out) matrices
    out = torch.bmm(tiles, weight.t().expand(tiles.shape[0], -1, -1)).reshape(-1, weight.shape[0])[:n]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if getattr(_on, "tiles", False):
        return tiled_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def install(module: nn.Module) -> None:
    """Let ``module``'s ``nn.Linear`` layers tile inside :func:`batch_invariant` (outside it they run as
    before; installing twice is harmless)."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.forward = _forward.__get__(m)


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Installed ``nn.Linear`` layers tile in this thread while inside if ``on`` (and do not if not)."""
    before = getattr(_on, "tiles", False)
    _on.tiles = on
    try:
        yield
    finally:
        _on.tiles = before
