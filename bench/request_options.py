"""Request parameters the benchmarks pass through to the server, so that chunk schedules can be compared
run against run: ``--chunk-first``/``--chunk-next`` (patches per chunk) and ``--chunk-fixed``.

Each is sent only when given: the server refuses parameters it does not know, and ``chunk_fixed`` is new,
so a bench run without ``--chunk-fixed`` still works against a server that predates it.
"""

from __future__ import annotations

import argparse


def add_chunk_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--chunk-first", type=int, help="request parameter, patches (server default when omitted)")
    ap.add_argument("--chunk-next", type=int, help="request parameter, patches (server default when omitted)")
    ap.add_argument("--chunk-fixed", action="store_true",
                    help="send the request parameter chunk_fixed=true (not sent at all without this flag)")  # fmt: skip


def chunk_parameters(args: argparse.Namespace) -> dict:
    """The request parameters of :func:`add_chunk_options`'s flags that were given."""
    params = {key: getattr(args, key) for key in ("chunk_first", "chunk_next") if getattr(args, key) is not None}
    if args.chunk_fixed:
        params["chunk_fixed"] = True
    return params
