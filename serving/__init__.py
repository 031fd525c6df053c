"""Everything Triton-facing: the contract (contract.py), the launcher (serve.py), one sub-package per concern
(docs/development.md, Layout). Importing it turns gRPC's fork support off for this process and its children (unless
set already), before any gRPC import of ours: forks beside gRPC threads now and then abort (docs/triton.md#T24)."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
