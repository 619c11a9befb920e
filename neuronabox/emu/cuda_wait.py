"""Device-side timed wait: the CUDA path of an emulated collective needs no host thread.

DESIGN.md records why: a host thread that releases the comm stream (cuStreamWaitValue32 on
a flag it writes) hung DDP's construction, because the main thread held the GIL inside a
synchronous copy that waited on that very stream. Here the wait is a one-thread Triton
kernel on the communicator's own stream: it reads ``%globaltimer`` when it starts (which is
after the caller's stream reached the call, via ``wait_stream``, and after the previous op
of the communicator ended, by stream order), spins until start + duration, and stores
both timestamps. The mirror data operations follow on the same stream; an event recorded
after them is what ``Work.wait()`` makes the caller's stream wait on (the CPU never blocks),
and what CUDA futures complete on.

Timestamps are read back only by ``resolve`` (report time), which synchronizes the device.
Import-guarded: without CUDA or Triton ``available()`` is False and nothing is built.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from .timeline import OpRecord, Recorder, Timeline, clock

try:  # torch is needed by everything here; a CPU-only build simply has no CUDA path
    import torch
except ImportError:  # pragma: no cover - the backend cannot exist without torch anyway
    torch = None  # type: ignore[assignment]

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a broken Triton install must not break the CPU path
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = ["available", "why_unavailable", "DeviceClock", "DeviceWaitUnavailable", "issue", "resolve"]

# Ops per timestamp chunk (two int64 each): 64 Ki ops = 1 MiB of device memory per chunk.
_CHUNK = 1 << 16

_kernel = None
_build_lock = threading.Lock()


class DeviceWaitUnavailable(RuntimeError):
    """The device-side wait could not be built or calibrated on this machine."""


_broken: str | None = None  # why the first build or calibration failed


def why_unavailable() -> str | None:
    """Why the device path cannot run here (``None`` when it can)."""
    if _broken is not None:
        return _broken
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if triton is None:
        return "Triton is not installed (it ships with CUDA builds of torch)"
    return None


def available() -> bool:
    """Whether device-timed waits can be used."""
    return why_unavailable() is None


def _get_kernel():
    global _kernel
    if _kernel is None:
        with _build_lock:
            if _kernel is None:
                _kernel = _build_kernel()
    return _kernel


def _build_kernel():
    # slot and duration change every call: specializing on them would recompile (x % 16 == 0, == 1).
    @triton.jit(do_not_specialize=["slot", "duration_ns"])
    def _timed_wait(stamps, slot, duration_ns):
        # The same asm as triton.language.extra.cuda.globaltimer(); is_pure=False keeps every read in the loop.
        start = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        deadline = start + duration_ns.to(tl.int64)
        now = start
        while now < deadline:
            now = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
        tl.store(stamps + 2 * slot, start)
        tl.store(stamps + 2 * slot + 1, now)

    return _timed_wait


class DeviceClock:
    """Per-device timestamp chunks, and the offset from ``%globaltimer`` ns to host ``clock()`` seconds."""

    def __init__(self, device: "torch.device"):
        self.device = device
        self.chunks: list["torch.Tensor"] = []
        self.used = _CHUNK  # forces a first chunk
        self.offset_ns = self._calibrate()
        self.pending: list[OpRecord] = []
        self.marks: list[tuple[Recorder, int, "torch.Tensor", int]] = []

    def take(self) -> tuple["torch.Tensor", int]:
        """A free (chunk, slot) for one op's start and end stamps."""
        if self.used >= _CHUNK:
            self.chunks.append(torch.zeros(2 * _CHUNK, dtype=torch.int64, device=self.device))
            self.used = 0
        slot = self.used
        self.used += 1
        return self.chunks[-1], slot

    def _calibrate(self) -> int:
        # A zero-length wait between two host readings; keep the tightest bracket of a few tries.
        kernel = _get_kernel()
        buf = torch.zeros(2, dtype=torch.int64, device=self.device)
        best = None
        with torch.cuda.device(self.device):
            kernel[(1,)](buf, 0, 0, num_warps=1)  # compile and load outside the measurement
            torch.cuda.synchronize(self.device)
            for _ in range(5):
                before = clock()
                kernel[(1,)](buf, 0, 0, num_warps=1)
                torch.cuda.synchronize(self.device)
                after = clock()
                stamp = int(buf[0].item())
                span = after - before
                if best is None or span < best[0]:
                    best = (span, stamp - int((before + after) / 2 * 1e9))
        return best[1]

    def to_host(self, stamp_ns: int) -> float:
        """A ``%globaltimer`` reading as host ``clock()`` seconds."""
        return (stamp_ns - self.offset_ns) / 1e9


_clocks: dict[str, DeviceClock] = {}
_recorders_hooked: set[int] = set()


def _device_clock(device: "torch.device") -> DeviceClock:
    global _broken
    key = str(device)
    dc = _clocks.get(key)
    if dc is None:
        try:  # the first use compiles the kernel and runs it: a failure here disables the path for good
            dc = _clocks[key] = DeviceClock(device)
        except Exception as exc:  # noqa: BLE001 - any Triton/driver failure means: use the host fallback
            _broken = f"the Triton timed-wait kernel failed on {device}: {type(exc).__name__}: {exc}"
            raise DeviceWaitUnavailable(_broken) from exc
    return dc


def issue(
    timeline: Timeline,
    record: OpRecord,
    device: "torch.device",
    tensors: Sequence["torch.Tensor"],
    mirror: Callable[[], None] | None,
) -> tuple["torch.cuda.Event", "torch.cuda.Stream"]:
    """Enqueue one op on the communicator's stream of ``device``; returns the completion event and the stream."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    state = timeline.device_state.get(device)
    if state is None:
        state = timeline.device_state[device] = torch.cuda.Stream(device=device)
    stream = state
    dc = _device_clock(device)
    recorder = timeline.recorder
    if id(recorder) not in _recorders_hooked:
        _recorders_hooked.add(id(recorder))
        recorder.resolvers.append(lambda: resolve(recorder))
        recorder.iteration_listeners.append(lambda index: _mark_on_device(recorder, index))

    # take() may allocate (and zero) a new chunk on the caller's stream: before the wait, so the
    # zeroing is ordered before the kernel that writes into it.
    buf, slot = dc.take()
    caller = torch.cuda.current_stream(device)
    stream.wait_stream(caller)  # inputs are ready when the caller's stream gets here
    duration_ns = max(0, int(round((record.duration + record.extra) * 1e9)))
    with torch.cuda.device(device), torch.cuda.stream(stream):
        _get_kernel()[(1,)](buf, slot, duration_ns, num_warps=1)
        if mirror is not None:
            with torch.no_grad():
                mirror()
        event = torch.cuda.Event()
        event.record(stream)
    # The caching allocator must not hand these blocks to the caller's stream before the comm stream is done.
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)
    record.device_slot = (dc, buf, slot)
    dc.pending.append(record)
    return event, stream


def _mark_on_device(recorder: Recorder, index: int) -> None:
    # The CPU runs ahead of the GPU, so a host-time iteration mark says when the step was
    # enqueued. A zero-length timed wait on the current stream stamps when the device got there.
    for dc in list(_clocks.values()):
        buf, slot = dc.take()
        with torch.cuda.device(dc.device):
            _get_kernel()[(1,)](buf, slot, 0, num_warps=1)
        dc.marks.append((recorder, index, buf, slot))


def resolve(recorder: Recorder | None = None) -> None:
    """Copy device timestamps into their records (synchronizes each device that has pending ops).

    Records of every recorder are resolved (there is one per run); ``recorder`` is accepted for the hook's signature.
    """
    for dc in list(_clocks.values()):
        if not dc.pending and not dc.marks:
            continue
        torch.cuda.synchronize(dc.device)
        host = {id(c): c.cpu() for c in dc.chunks}
        for rec_, index, buf, slot in dc.marks:
            rec_.device_iteration_marks.setdefault(str(dc.device), {})[index] = dc.to_host(int(host[id(buf)][2 * slot]))
        dc.marks = []
        for rec in dc.pending:
            _, buf, slot = rec.device_slot
            stamps = host[id(buf)]
            start_ns, end_ns = int(stamps[2 * slot]), int(stamps[2 * slot + 1])
            rec.start = rec.ready = dc.to_host(start_ns)
            rec.end = rec.start + rec.duration + rec.extra
            rec.completed = dc.to_host(end_ns)
        dc.pending = []
