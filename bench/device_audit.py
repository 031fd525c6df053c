"""What a run would do on an accelerator, checked op by op: dtype mixes, forgotten ``device=``, host syncs.

:class:`DeviceAudit` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode` (every ATen op passes
through it) watching one device type, the accelerator: ``meta`` to check the CUDA path on a machine
without a GPU (``tests/unit/test_cuda_meta.py``), ``cuda`` to count the same things on a real GPU
(``bench/gpu.sh``). While it is active:

1. **dtypes**: every matmul-like op (mm, bmm, addmm, baddbmm, linear, SDPA and its kernels, convolution)
   must have floating operands of one dtype, as CUDA's kernels require; a mix raises
   :class:`DeviceAuditError` naming the op, the operands' dtypes and the line of our code.
2. **devices**: an op that meets a CPU tensor (other than a 0-d scalar, which CUDA reads on the host)
   and an accelerator tensor raises: a tensor created without ``device=``. Deliberate CPU work (the
   per-stream noise drawn from a CPU ``torch.Generator``, the page table kept on the host) only meets the
   accelerator through a copy, which is counted, not refused.
3. **host syncs**: every read of device data by the host stalls it until the GPU has done all it was
   given: ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``), a copy to the CPU
   (``.cpu()``, ``.tolist()``, ``.numpy()`` after it), ``torch.equal``, and ops whose output size is
   data (``nonzero``, boolean masks). A *blocking* copy to the device is one too: PyTorch finishes
   ``.to(device)`` with ``cudaStreamSynchronize`` unless ``non_blocking=True`` (``torch.tensor(data,
   device=...)`` always blocks). Copies to the device with ``non_blocking=True`` are counted apart.

4. **bytes to the host**: what each device -> host read hands the host (:meth:`DeviceAudit.d2h_bytes`):
   a copy's elements times the destination's element size, one element for ``.item()``, one byte for
   ``torch.equal``, the 8-byte count for an op whose output size is data.

Meta tensors have no data, so on ``meta`` every host read gets a stand-in: **a meta tensor reads as
zeros** (``.item()`` is 0, ``bool()`` False, ``.tolist()`` zeros, ``torch.equal`` True). Zero stop
probabilities keep every stream going. PyTorch has no meta generator: a random op on meta tensors is
run without its ``generator=`` (meta kernels draw nothing, and ``exponential_``'s refuses one), so the
CPU generator the engine hands it as a stand-in is neither read nor advanced. On ``cuda`` the real
values flow and the audit only counts.

Per kind (:data:`KINDS`) the audit tallies ops (:attr:`DeviceAudit.by_op`) and, for syncs and copies,
the line of our code that caused each (:attr:`DeviceAudit.sites`, bytes in :attr:`DeviceAudit.bytes`).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SYNC = "sync"  # the host waits for the device: a device -> host read or a blocking host -> device copy
D2H, H2D_BLOCKING, H2D_ASYNC, CPU_SCALAR = "d2h", "h2d blocking", "h2d non_blocking", "cpu scalar"
KINDS = (D2H, H2D_BLOCKING, H2D_ASYNC, CPU_SCALAR)  # SYNC = D2H + H2D_BLOCKING

_aten = torch.ops.aten
_MATMUL = {
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot", "vdot", "_scaled_mm",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "scaled_dot_product_attention", "_efficient_attention_forward", "_flash_attention_forward",
}  # fmt: skip
_MATMUL_PREFIXES = ("_scaled_dot_product", "cudnn_convolution", "mkldnn_convolution", "_slow_conv", "_nnpack")
_TRANSFERS = {"to", "_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "lift_fresh", "lift_fresh_copy"}
_DATA_SHAPED = {"nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim"}  # output size = data
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)  # invisible to dispatch: a TorchFunctionMode sees them
_TORCH_DIR = os.path.dirname(torch.__file__)


class DeviceAuditError(AssertionError):
    """An op the accelerator would refuse (or that the check cannot stand in for); says which and where."""


def _name(func) -> str:
    return func.overloadpacket.__name__


def is_matmul(func) -> bool:
    name = _name(func)
    return name in _MATMUL or name.startswith(_MATMUL_PREFIXES)


def caller() -> str:
    """``file:line (function)`` of the innermost frame outside torch and this module."""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH_DIR) or f.f_code.co_filename == __file__):
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    try:
        path = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        pass
    return f"{path}:{f.f_lineno} ({f.f_code.co_name})"


def _bind(func, args, kwargs) -> dict:
    """An op's arguments by their schema names."""
    names = [arg.name for arg in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _zero(dtype: torch.dtype):
    """The Python value ``.item()`` of a zero of ``dtype`` gives."""
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point else (0j if dtype.is_complex else 0)


class _FromData(TorchFunctionMode):
    """Sees ``torch.tensor(data, device=...)``, whose copy to the device no dispatch mode is shown."""

    def __init__(self, audit: DeviceAudit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_DATA and args and not isinstance(args[0], torch.Tensor):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == self.audit.device_type:
                self.audit._note(H2D_BLOCKING, f"{func.__name__}(data, device=)")
                self.audit._quiet = True  # counted once here, whatever the dispatcher shows of it
                try:
                    return func(*args, **kwargs)
                finally:
                    self.audit._quiet = False
        return func(*args, **kwargs)


class DeviceAudit(TorchDispatchMode):
    """Checks and counts every op on ``device`` (``"meta"`` or ``"cuda"``) while active (``with``).

    Attributes:
        by_op: (kind, op) -> count, kinds from :data:`KINDS`.
        sites: (kind, op, caller) -> count: which line of our code caused each sync or copy.
        bytes: (op, caller) -> bytes the host received from the device there (device -> host reads only).
        matmuls: (op, dtype) -> count of the matmul-like ops checked (what ran in which precision).
    """

    def __init__(self, device: str | torch.device = "meta"):
        super().__init__()
        self.device_type = torch.device(device).type
        if self.device_type == "cpu":
            raise ValueError("audit an accelerator (meta or cuda); on the CPU every tensor is on the host")
        self.stand_ins = self.device_type == "meta"
        self.by_op: Counter[tuple[str, str]] = Counter()
        self.sites: Counter[tuple[str, str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.matmuls: Counter[tuple[str, torch.dtype]] = Counter()
        self._from_data = _FromData(self)
        self._quiet = False

    # -- results ---------------------------------------------------------------------------------------
    def count(self, kind: str) -> int:
        """Ops of ``kind`` (one of :data:`KINDS`, or :data:`SYNC` for all host syncs) so far."""
        kinds = (D2H, H2D_BLOCKING) if kind == SYNC else (kind,)
        return sum(n for (k, _), n in self.by_op.items() if k in kinds)

    def d2h_bytes(self, where: str = "") -> int:
        """Bytes read from the device by the host so far; with ``where``, only at callers containing it."""
        return sum(n for (_, site), n in self.bytes.items() if where in site)

    def report(self) -> str:
        """One line per (kind, op, caller), most frequent first; device -> host reads with their bytes."""
        rows = sorted(self.sites.items(), key=lambda kv: (-kv[1], kv[0]))
        return (
            "\n".join(
                f"{n:5d}  {kind:16s} {op:28s} {site}" + (f"  ({self.bytes[op, site]} bytes)" if kind == D2H else "")
                for (kind, op, site), n in rows
            )
            or "(none)"
        )

    def __enter__(self):
        self._from_data.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._from_data.__exit__(*sys.exc_info())
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._from_data.__exit__(*exc)

    # -- the check -------------------------------------------------------------------------------------
    def _note(self, kind: str, op: str, nbytes: int = 0) -> None:
        if self._quiet:
            return
        site = caller()
        self.by_op[kind, op] += 1
        self.sites[kind, op, site] += 1
        if kind == D2H:
            self.bytes[op, site] += nbytes

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if self._on_device(t)]
        if name in _TRANSFERS:
            return self._transfer(func, name, args, kwargs)
        if on_device:
            host = [t for t in tensors if t.device.type == "cpu"]
            # a library's own ops (FlashInfer's planning) may take host metadata beside device buffers
            if any(t.dim() > 0 for t in host) and func.namespace == "aten":
                shapes = ", ".join(f"{t.device} {tuple(t.shape)} {t.dtype}" for t in tensors)
                raise DeviceAuditError(
                    f"{func}: a CPU tensor meets {self.device_type} tensors ({shapes}) at {caller()}: "
                    "created without device=, or moved without .to(device)?"
                )
            if host:
                self._note(CPU_SCALAR, name)
            if is_matmul(func):
                self.matmuls[name, self._check_dtypes(func, tensors)] += 1
            if func is _aten._local_scalar_dense.default or name == "equal" or name in _DATA_SHAPED:
                scalar = func is _aten._local_scalar_dense.default
                self._note(D2H, name, args[0].element_size() if scalar else 1 if name == "equal" else 8)
                if self.stand_ins:
                    return self._stand_in(func, name, args)
            if self.stand_ins and kwargs.get("generator") is not None:  # no meta generator: see the docstring
                kwargs = {**kwargs, "generator": None}
        return func(*args, **kwargs)

    def _check_dtypes(self, func, tensors: list[torch.Tensor]) -> torch.dtype | None:
        """The one dtype of the op's floating operands (bool masks and int indices aside)."""
        floats = [t for t in tensors if t.is_floating_point()]
        if len({t.dtype for t in floats}) > 1:
            dtypes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in floats)
            raise DeviceAuditError(f"{func} mixes dtypes ({dtypes}) at {caller()}: CUDA's kernels take one")
        return floats[0].dtype if floats else None

    def _transfer(self, func, name: str, args, kwargs):
        a = _bind(func, args, kwargs)
        if "src" in a:  # copy_(self, src, non_blocking) and friends: into self
            src, dst_type = a["src"], a["self"].device.type
        else:  # to(...), _to_copy(...), lift_fresh(...): a new tensor
            src, dst = a["self"], a.get("device") or getattr(a.get("other"), "device", None)
            dst_type = torch.device(dst).type if dst is not None else a["self"].device.type
        moved = src.numel() > 0  # copy_ returns before any transfer for an empty tensor
        if src.device.type == self.device_type and dst_type == "cpu":
            dtype = a["self"].dtype if "src" in a else a.get("dtype") or getattr(a.get("other"), "dtype", None)
            dtype = dtype or src.dtype
            if moved:
                self._note(D2H, name, src.numel() * dtype.itemsize)
            if self.stand_ins:  # no data to read: zeros
                return a["self"].zero_() if "src" in a else torch.zeros(src.shape, dtype=dtype)
        elif src.device.type == "cpu" and dst_type == self.device_type and moved:
            self._note(H2D_ASYNC if a.get("non_blocking") else H2D_BLOCKING, name)
        return func(*args, **kwargs)

    def _stand_in(self, func, name: str, args):
        if func is _aten._local_scalar_dense.default:
            return _zero(args[0].dtype)
        if name == "equal":  # zeros equal zeros of the same shape
            return tuple(args[0].shape) == tuple(args[1].shape)
        raise DeviceAuditError(f"{name} at {caller()}: its output size depends on data the meta device lacks")
