"""A fake ``triton_python_backend_utils``: enough of Triton 2.51's Python backend API for every
``model_repository/*/1/model.py`` to initialize and execute in-process, in a unit test.

:class:`FakeTriton` is the server: it loads models from the repository (their ``import
triton_python_backend_utils as pb`` gets this module), and answers BLS requests by handing them to the
loaded callee on that model's own thread, the way Triton does: a batch of queued requests per
``execute``, a non-decoupled model's returned responses delivered, a request released with
RESCHEDULE queued again without its START flag (the iterative sequence batcher, docs/triton.md#T9).
Some of Triton's measured behaviours are checked here, so that a model breaking them fails a unit
test: a second final response, ``is_cancelled()`` after the final response (docs/triton.md#T3) and
float request parameters (docs/triton.md#T11) raise :class:`FakeTritonFault`, and a decoupled BLS response
iterator that its model let go of before the stub's table did (docs/triton.md#T18) fails the server's exit.

One file past 300 lines on purpose: it stands in for one module, which the models import whole.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import queue
import sys
import threading
import types
import weakref
from pathlib import Path

import numpy as np

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"

# What each model asked os.nice for in initialize (folder -> increments). A stub is a process of its own; in
# process, the increment would renice the test runner, and every test after it (prompt_encoder's 10 made the
# rest of a loaded `make test` crawl at a tenth of a core), so it is recorded, not applied.
RENICED: dict[str, list[int]] = {}

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


class FakeTritonFault(AssertionError):
    """A model did what the real server punishes (a crash, a hang, a refused call)."""


class TritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"Tensor {name}: a numpy array, got {type(array).__name__}")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors=None, error: TritonError | None = None):
        self._outputs, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


class ResponseSender:
    """Records what a model sends for one request; the final response closes it."""

    def __init__(self, request):
        self.request, self.responses, self.closed = request, queue.SimpleQueue(), threading.Event()
        self.sent: list[tuple[InferenceResponse, int]] = []

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.closed.is_set():
            raise FakeTritonFault("a response after the final one")
        if response is None and not flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise FakeTritonFault("send() without a response needs the FINAL flag")
        response = response if response is not None else InferenceResponse()
        self.sent.append((response, flags))
        self.responses.put((response, flags))
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.closed.set()

    @property
    def finals(self) -> int:
        return sum(bool(f & TRITONSERVER_RESPONSE_COMPLETE_FINAL) for _, f in self.sent)

    def outputs(self) -> list[dict[str, np.ndarray]]:
        """Each response's outputs by name (errors left out)."""
        return [{t.name(): t.as_numpy() for t in r.output_tensors()} for r, _ in self.sent if not r.has_error()]

    def errors(self) -> list[str]:
        return [r.error().message() for r, _ in self.sent if r.has_error()]


class InferenceRequest:
    """A BLS request made by a model, and also (made by a test or by :class:`FakeTriton`) a request
    handed to a model's ``execute``."""

    def __init__(self, model_name: str = "", inputs=(), requested_output_names=(), correlation_id: int = 0,
                 request_id: str = "", flags: int = 0, timeout: int = 0, parameters=None):  # fmt: skip
        parameters = parameters or {}
        if isinstance(parameters, dict):
            for key, value in parameters.items():
                if isinstance(value, float) or not isinstance(value, str | int | bool):
                    raise FakeTritonFault(f"parameter {key!r}: Triton 2.51 takes str, int or bool, not {value!r}")
            parameters = json.dumps(parameters)
        self.model_name, self._inputs, self._outputs = model_name, list(inputs), list(requested_output_names)
        self._correlation_id, self._flags, self._parameters = correlation_id, flags, parameters
        self.timeout, self.request_id = timeout, request_id
        self.release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self.cancelled = False
        self.sender = ResponseSender(self)

    # ---- what a model's execute reads ----
    def inputs(self) -> list[Tensor]:
        return self._inputs

    def parameters(self) -> str:
        return self._parameters

    def correlation_id(self) -> int:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def is_cancelled(self) -> bool:
        if self.sender.closed.is_set():
            raise FakeTritonFault("is_cancelled() after the final response: tritonserver 2.51 crashes")
        if not self.cancelled and _SERVER is not None:  # a round trip through the stub's queue
            _SERVER.let_go()
        return self.cancelled

    def set_release_flags(self, flags: int) -> None:
        self.release_flags = flags

    # ---- BLS ----
    def exec(self, decoupled: bool = False):
        if _SERVER is None:
            raise FakeTritonFault("BLS without a FakeTriton")
        return _SERVER.call(self, decoupled)

    async def async_exec(self, decoupled: bool = False):
        return await asyncio.get_running_loop().run_in_executor(None, self.exec, decoupled)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

    def __init__(self, name: str, description: str, kind: int):
        self.name, self.description, self.kind, self.metrics = name, description, kind, []

    def Metric(self, labels: dict | None = None, buckets: list | None = None):  # noqa: N802 (Triton's name)
        metric = Metric(self, dict(labels or {}), buckets)
        self.metrics.append(metric)
        return metric


class Metric:
    def __init__(self, family: MetricFamily, labels: dict, buckets):
        self.family, self.labels, self.buckets, self.value, self.observed = family, labels, buckets, 0.0, []

    def increment(self, by: float) -> None:
        if self.family.kind == MetricFamily.COUNTER and by < 0:
            raise FakeTritonFault(f"{self.family.name}: a counter cannot decrease")
        self.value += by

    def set(self, value: float) -> None:  # Triton 2.51's keeps the GIL through its round trip
        raise FakeTritonFault(f"{self.family.name}: Metric.set keeps the GIL (docs/triton.md#T19); increment instead")

    def observe(self, value: float) -> None:
        self.observed.append(value)


class _Responses:
    """A decoupled BLS call's response iterator: blocks for each response, ends after the final one."""

    def __init__(self, sender: ResponseSender, timeout: float, server: FakeTriton | None):
        self.sender, self.timeout, self.done, self.server = sender, timeout, False, server
        self.first: tuple | None = None  # the first response, once arrived (Triton returns the iterator with it)

    def __iter__(self):
        return self

    def arrived(self) -> _Responses:
        """Wait for the first response: Triton's BLS returns a decoupled call's iterator only with it."""
        self.first = self._get()
        return self

    def _get(self) -> tuple:
        try:
            return self.sender.responses.get(timeout=self.timeout)
        except queue.Empty:
            raise FakeTritonFault(f"no response within {self.timeout} s") from None

    def __next__(self) -> InferenceResponse:
        if self.done:
            raise StopIteration
        if self.first is not None:
            (response, flags), self.first = self.first, None
        elif self.sender.responses.empty() and _on_event_loop():
            raise FakeTritonFault("next() on a BLS response iterator would block an event loop's thread: read "
                                  "a response that is not there yet on a thread of its own")  # fmt: skip
        else:
            response, flags = self._get()
        self.done = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if self.done and self.server is not None:  # a decoupled call's: in the stub's table
            self.server.releasing(self)
        return response


class _Served:
    """A loaded model and the thread that runs its executes, one batch of queued requests at a time."""

    def __init__(self, model, max_batch: int):
        self.model, self.max_batch, self.queue = model, max_batch, queue.SimpleQueue()
        self.executes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (first := self.queue.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.queue.put(None)
                    break
                batch.append(more)
            for r in batch:
                r.release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
            out = self.model.execute(batch)
            self.executes += 1
            if asyncio.iscoroutine(out):
                raise FakeTritonFault("an async execute behind BLS: call it from the test")
            for r, response in zip(batch, out or [], strict=bool(out)):
                r.sender.send(response, flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            for r in batch:
                if r.release_flags & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                    r._flags &= ~TRITONSERVER_REQUEST_FLAG_SEQUENCE_START  # docs/triton.md#T9
                    self.queue.put(r)


class FakeTriton:
    """Models loaded from the repository; BLS requests reach them by name. Use as a context manager."""

    def __init__(self, timeout: float = 60.0):
        self.models: dict[str, _Served] = {}
        self.timeout = timeout
        self.loops: dict[int, tuple[asyncio.AbstractEventLoop, threading.Thread]] = {}
        # The stub's table of decoupled BLS iterators (docs/triton.md#T18): one whose final response was read
        # is let go of at the next is_cancelled() round trip (the latest Triton may); its model must still
        # hold it then. Models share one table here (each stub has its own): a lenient stand-in.
        self.table: list[weakref.ref] = []
        self.table_lock = threading.Lock()
        self.faults: list[str] = []

    def releasing(self, responses: _Responses) -> None:
        with self.table_lock:
            self.table.append(weakref.ref(responses))

    def let_go(self) -> None:
        with self.table_lock:
            table, self.table = self.table, []
        if any(ref() is None for ref in table):
            self.faults.append(
                "a decoupled BLS response iterator was let go of before the stub's table let go "
                "of it: Triton 2.51 frees it without the GIL (docs/triton.md#T18)"
            )

    def __enter__(self) -> FakeTriton:
        global _SERVER
        _SERVER = self
        return self

    def __exit__(self, *exc) -> None:
        global _SERVER
        for loop, thread in self.loops.values():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
        for served in self.models.values():
            served.queue.put(None)
        for served in self.models.values():
            served.thread.join(10)
            if hasattr(served.model, "finalize"):
                served.model.finalize()
        _SERVER = None
        self.let_go()
        if self.faults:
            raise FakeTritonFault(self.faults[0])

    @staticmethod
    def load(folder: str, parameters: dict[str, str]):
        """``model_repository/<folder>/1/model.py``'s TritonPythonModel, initialized with ``parameters``
        as its config's (``XOptions.of(serve_options).parameters()``)."""
        spec = importlib.util.spec_from_file_location(f"fake_triton_{folder}", REPOSITORY / folder / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.TritonPythonModel()
        config = {"name": folder, "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
        real_nice = os.nice
        os.nice = lambda increment: RENICED.setdefault(folder, []).append(increment) or real_nice(0)
        try:
            model.initialize({"model_config": json.dumps(config), "model_name": folder})
        finally:
            os.nice = real_nice
        return model

    def serve(self, name: str, model, max_batch: int = 8):
        """Answer BLS requests to ``name`` with ``model`` (loaded, or any object with ``execute``)."""
        self.models[name] = _Served(model, max_batch)
        return model

    def execute(self, model, requests: list, timeout: float = 120.0):
        """``model.execute(requests)`` as its stub runs it: an async execute on the model's own event
        loop, which lives as long as this server (a stub's loop outlives its executes)."""
        if not asyncio.iscoroutinefunction(model.execute):
            return model.execute(requests)
        if id(model) not in self.loops:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, daemon=True)
            thread.start()
            self.loops[id(model)] = (loop, thread)
        loop = self.loops[id(model)][0]
        return asyncio.run_coroutine_threadsafe(model.execute(requests), loop).result(timeout)

    def call(self, request: InferenceRequest, decoupled: bool):
        served = self.models.get(request.model_name)
        if served is None:
            return InferenceResponse(error=TritonError(f"Model '{request.model_name}' is not ready", 2))
        delivered = InferenceRequest(
            inputs=[Tensor(t.name(), t.as_numpy().copy()) for t in request.inputs()],  # the callee's own copy
            requested_output_names=request.requested_output_names(), correlation_id=request.correlation_id(),
            flags=request.flags(), parameters=json.loads(request.parameters() or "{}"),
        )  # fmt: skip
        served.queue.put(delivered)
        responses = _Responses(delivered.sender, self.timeout, self if decoupled else None)
        if decoupled:
            return responses.arrived()
        response = next(responses)
        if not delivered.sender.closed.wait(self.timeout):
            raise FakeTritonFault(f"{request.model_name}: no final response")
        return response


_SERVER: FakeTriton | None = None


def _on_event_loop() -> bool:
    """Whether the calling thread runs an asyncio event loop."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def request(inputs: dict[str, np.ndarray], parameters: dict | None = None, correlation_id: int = 0,
            flags: int = 0) -> InferenceRequest:  # fmt: skip
    """A client's request to a model (inputs by name)."""
    return InferenceRequest(inputs=[Tensor(k, v) for k, v in inputs.items()], parameters=parameters or {},
                            correlation_id=correlation_id, flags=flags)  # fmt: skip


def install(monkeypatch) -> types.ModuleType:
    """This module as ``triton_python_backend_utils`` (until the test ends)."""
    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module
