"""Everything Triton-facing: the contract between the models (contract.py), the launcher (serve.py) and one sub-package per concern (docs/development.md, Layout).

Importing it turns gRPC's fork support off for this process and its children (unless set already), so it runs
before any gRPC import here. The launcher and the tests start tritonserver and the gateway with fork and exec
(``preexec_fn``: serving.supervision.triton_env.die_with_parent) while gRPC threads run; with fork support on,
gRPC's fork handler restarts its poller in the child, which then sees its file descriptors closed before
``exec`` and aborts. A loaded test run saw a restarted gateway die so (exit -6, ``epoll_wait error: Bad file
descriptor``); here 23 of 1,000 such children aborted with fork support on, none of 1,000 with it off. Nothing
here forks without ``exec``. docs/triton.md#T24."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
