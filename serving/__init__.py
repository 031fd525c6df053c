"""Everything Triton-facing: the contract between the models (contract.py), the launcher (serve.py) and one sub-package per concern (docs/development.md, Layout).

Importing it turns gRPC's fork support off for this process and its children (unless set already), before any
gRPC import of ours: the launcher and the tests fork and exec (``preexec_fn``) beside gRPC threads, which
with fork support on now and then aborts the child before ``exec`` (docs/triton.md#T24)."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
