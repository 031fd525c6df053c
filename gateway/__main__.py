"""``python -m gateway --triton 127.0.0.1:8001 [--host 127.0.0.1] [--port 8080]``: the OpenAI-compatible
speech API in front of a Triton server (this one's or a remote one), on uvicorn."""

from __future__ import annotations

import argparse
import contextlib

LAUNCHER_OWNS = ("--triton", "--host", "--port", "--random-weights")  # serving.serve sets these itself


def parser() -> argparse.ArgumentParser:
    """The gateway's command line (``serving.serve --gateway-args`` is checked against it)."""
    ap = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton", default="127.0.0.1:8001", help="host:port of Triton's gRPC endpoint")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds without a chunk before a stream fails")
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="the server runs a random-weight checkpoint: the web page says what that produces",
    )
    from gateway import server

    server.add_arguments(ap)
    server.add_socket_arguments(ap)
    from gateway.jobs import options as job_options

    job_options.add_arguments(ap)
    return ap


def check(argv: list[str]) -> str | None:
    """What is wrong with ``argv`` as more options of a gateway the launcher starts, or None."""
    from gateway import server

    for arg in argv:
        if arg.split("=", 1)[0] in LAUNCHER_OWNS:
            return f"{arg.split('=', 1)[0]} is set by the launcher (--host, --openai-port), not in --gateway-args"
    try:
        args = parser().parse_args(argv)
    except SystemExit:  # argparse has printed why
        return "not options of python -m gateway (python -m gateway --help lists them)"
    from gateway.jobs.options import from_arguments

    try:
        server.options(args), server.socket_bounds(args), from_arguments(args)
    except ValueError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    from gateway import server

    args = ap.parse_args(argv)
    from gateway.jobs.options import from_arguments

    try:
        options, socket_bounds, jobs = server.options(args), server.socket_bounds(args), from_arguments(args)
    except ValueError as e:
        ap.error(str(e))
    import sys

    import uvicorn

    uv = uvicorn.Server(
        server.uvicorn_config(
            args.triton,
            args.host,
            args.port,
            options,
            args.timeout,
            random_weights=args.random_weights,
            socket_bounds=socket_bounds,
            jobs=jobs,
        )
    )
    with contextlib.suppress(KeyboardInterrupt):
        uv.run()
    if not uv.started:  # e.g. the port is taken (uvicorn has logged why)
        sys.exit(3)


if __name__ == "__main__":
    main()
