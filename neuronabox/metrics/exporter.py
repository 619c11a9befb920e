"""The real rank's Prometheus exporter: iteration and collective metrics from the emulator's Recorder.

Nothing runs on the training thread. The collector reads the Recorder when Prometheus
scrapes: the ops and iteration marks appended since the previous scrape are folded into
running histograms and counters (O(new ops) per scrape, on the HTTP server's thread), so a
collective call costs exactly what it cost without the exporter. The emulator is looked up
at each scrape, because ``nbox run`` starts the exporter before the user's script creates
one (it appears at ``init_process_group``).

Every sample carries ``cluster`` and ``run`` labels, so one Prometheus and one dashboard can
hold many runs; the scrape configuration keeps them (``honor_labels``). Metric names, labels
and help texts are listed in docs/guide/metrics.md.
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
import time
import uuid
from typing import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from ..exposed import split
from ..recording import RunSource, current_run

__all__ = [
    "ENV_ADDR",
    "ENV_FILE",
    "ENV_CLUSTER",
    "ENV_RUN",
    "ENV_LINGER",
    "ENV_PORT",
    "DEFAULT_PORT",
    "ITERATION_BUCKETS",
    "COLLECTIVE_BUCKETS",
    "RunCollector",
    "Exporter",
    "parse_addr",
    "start_exporter",
]

ENV_ADDR = "NBOX_METRICS_ADDR"
ENV_FILE = "NBOX_METRICS_FILE"
ENV_CLUSTER = "NBOX_CLUSTER"
ENV_RUN = "NBOX_RUN"
ENV_LINGER = "NBOX_METRICS_LINGER"
ENV_PORT = "NBOX_METRICS_PORT"  # the port when NBOX_METRICS_ADDR names only a host (the compose file does)
DEFAULT_PORT = 9464  # the exporter's port in Prometheus's port allocation list (shared by many exporters)
# Set in the exporting process so that Python children it spawns (DataLoader workers under
# the "spawn" start method run sitecustomize too) do not start a second exporter.
_ENV_OWNER = "NBOX_METRICS_OWNER"


def _decades(lo_exp: int, hi_exp: int, steps: Iterable[float]) -> tuple[float, ...]:
    steps = tuple(steps)
    return tuple(round(m * 10.0**e, 12) for e in range(lo_exp, hi_exp) for m in steps) + (10.0**hi_exp,)


# Iterations: 1 ms - 100 s, six buckets a decade, so p50/p95 interpolate within about 20%.
ITERATION_BUCKETS = _decades(-3, 2, (1, 1.5, 2, 3, 5, 7))
# Collectives: 1 us - 10 s, three a decade (many label sets: keep the series count down).
COLLECTIVE_BUCKETS = _decades(-6, 1, (1, 2, 5))


class _Hist:
    """A classic Prometheus histogram kept by hand (cumulated only when exported)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, c in zip(self.bounds, self.counts):
            acc += c
            out.append((_fmt(bound), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


def _fmt(x: float) -> str:
    return repr(float(x))


class RunCollector:
    """A prometheus-client collector over the current emulator's Recorder, plus process and GPU gauges."""

    def __init__(
        self,
        cluster: str | None = None,
        run: str | None = None,
        emulator_source: RunSource = current_run,
        gpu: bool = True,
    ):
        self._cluster = cluster
        self._run = run
        self._fallback_run = f"nbox-{uuid.uuid4().hex[:12]}"
        self._identity_frozen = cluster is not None and run is not None
        self._source = emulator_source
        self._lock = threading.Lock()
        self._recorder = None
        self._info: dict[str, str] = {}
        self._world_size: int | None = None
        self._op_cursor = 0
        self._mark_cursor = 0
        self._pending: dict[int, list] = {}  # iteration -> its ops, until the iteration ends
        self.iteration = _Hist(ITERATION_BUCKETS)
        self.collective: dict[tuple[str, str, str], _Hist] = {}
        self.bytes: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.exposed = 0.0
        self.scrapes = 0
        self._process = None
        try:
            import psutil

            self._process = psutil.Process()
        except Exception:  # noqa: BLE001 - psutil is a dependency, but a sandbox may deny /proc
            self._process = None
        self._gpus = _NvmlGpus.open() if gpu else None

    # ---- identity ------------------------------------------------------------------------
    def identity(self) -> tuple[str, str]:
        """The (cluster, run) label values of every sample."""
        if self._identity_frozen:
            return self._cluster or "nbox", self._run or self._fallback_run
        cluster = self._cluster or os.environ.get(ENV_CLUSTER)
        if not cluster and self._recorder is not None and self._info.get("topology"):
            from ..cluster.state import default_name  # the name `nbox up` gives the same topology's cluster

            cluster = default_name(self._info["topology"])
        run = self._run or os.environ.get(ENV_RUN) or os.environ.get("TORCHELASTIC_RUN_ID") or self._fallback_run
        if self._recorder is not None:
            # Once an emulator is seen the labels stay put: api.shutdown() restores the
            # environment, and a label change would split every series in two.
            self._cluster, self._run, self._identity_frozen = cluster or "nbox", run, True
        return cluster or "nbox", run

    # ---- folding the recorder in -----------------------------------------------------------
    def _attach(self, emu) -> None:
        if self._recorder is not None:
            self._finish_pending(force=True)
        self._recorder = emu.recorder
        self._op_cursor = 0
        self._mark_cursor = 0
        self._pending.clear()
        topo = getattr(emu, "topology", None)
        self._world_size = int(emu.world_size)
        self._info = {
            "topology": str(getattr(topo, "name", "") or ""),
            "model": str(getattr(emu.model, "name", type(emu.model).__name__)),
            "real_rank": str(emu.real_rank),
            "world_size": str(emu.world_size),
        }

    def update(self) -> None:
        """Fold the ops and iteration marks recorded since the last call into the metrics."""
        emu = self._source()
        if emu is not None and getattr(emu, "recorder", None) is not self._recorder:
            self._attach(emu)
        rec = self._recorder
        if rec is None:
            return
        ops = rec.ops
        n = len(ops)  # appended by other threads: read the length once, then only below it
        collective, nbytes, count, pending = self.collective, self.bytes, self.count, self._pending
        for i in range(self._op_cursor, n):
            r = ops[i]
            op = r.op.value
            key = (op, str(len(r.group)), r.algorithm)
            h = collective.get(key)
            if h is None:
                h = collective[key] = _Hist(COLLECTIVE_BUCKETS)
            h.observe(r.duration)
            nbytes[op] = nbytes.get(op, 0) + r.nbytes
            count[op] = count.get(op, 0) + 1
            bucket = pending.get(r.iteration)
            if bucket is None:
                bucket = pending[r.iteration] = []
            bucket.append(r)
        self._op_cursor = n
        marks = rec.iteration_marks
        m = len(marks)
        for i in range(self._mark_cursor, m):
            start = marks[i - 1] if i else rec.t0
            self.iteration.observe(marks[i] - start)
        self._mark_cursor = m
        self._finish_pending()

    def _finish_pending(self, force: bool = False) -> None:
        rec = self._recorder
        marks = rec.iteration_marks
        done = len(marks)
        for it in [k for k in self._pending if force or k < done]:
            ops = self._pending.pop(it)
            if it < done:
                start = marks[it - 1] if it else rec.t0
                self.exposed += exposed_seconds(ops, start, marks[it])

    # ---- exporting -------------------------------------------------------------------------
    def describe(self) -> list[Metric]:
        """Nothing up front: the label values are only known at scrape time."""
        return []

    def collect(self) -> Iterable[Metric]:
        """Prometheus calls this on every scrape."""
        with self._lock:
            self.scrapes += 1
            try:
                self.update()
            except Exception as exc:  # noqa: BLE001 - a scrape must not take the training process down
                sys.stderr.write(f"nbox metrics: could not read the recorder: {exc!r}\n")
            return list(self._families())

    def _families(self) -> Iterable[Metric]:
        cluster, run = self.identity()
        base = ["cluster", "run"]
        lv = [cluster, run]
        if self._recorder is not None:
            info = InfoMetricFamily(
                "nbox", "The emulated job: topology, delay model, real rank, world size", labels=base
            )
            info.add_metric(lv, self._info)
            yield info
            ws = GaugeMetricFamily(
                "nbox_emulated_world_size", "Ranks in the emulated job (real and emulated)", labels=base
            )
            ws.add_metric(lv, self._world_size)
            yield ws
            it = HistogramMetricFamily(
                "nbox_iteration_duration_seconds",
                "Wall time of each training iteration of the real rank (optimizer step to optimizer step)",
                labels=base,
            )
            it.add_metric(lv, self.iteration.buckets(), self.iteration.sum)
            yield it
            cd = HistogramMetricFamily(
                "nbox_collective_duration_seconds",
                "Modeled duration of each emulated collective (what-if injections included)",
                labels=base + ["op", "group_size", "algorithm"],
            )
            for (op, size, algo), h in sorted(self.collective.items()):
                cd.add_metric(lv + [op, size, algo], h.buckets(), h.sum)
            yield cd
            cb = CounterMetricFamily(
                "nbox_collective_bytes", "Payload bytes of emulated collectives (per rank, as called)",
                labels=base + ["op"],
            )
            cc = CounterMetricFamily("nbox_collectives", "Emulated collectives called", labels=base + ["op"])
            for op in sorted(self.count):
                cb.add_metric(lv + [op], self.bytes[op])
                cc.add_metric(lv + [op], self.count[op])
            yield cb
            yield cc
            ex = CounterMetricFamily(
                "nbox_exposed_communication_seconds",
                "Time the real rank waited on collectives (not hidden behind compute), over finished iterations",
                labels=base,
            )
            ex.add_metric(lv, self.exposed)
            yield ex
        yield from self._process_families(base, lv)
        if self._gpus is not None:
            yield from self._gpus.families(base, lv)

    def _process_families(self, base: list[str], lv: list[str]) -> Iterable[Metric]:
        p = self._process
        if p is None:
            return
        try:
            t = p.cpu_times()
            rss = p.memory_info().rss
        except Exception:  # noqa: BLE001 - the process is exiting
            return
        cpu = CounterMetricFamily(
            "nbox_process_cpu_seconds", "CPU time of the real rank's process (user + system)", labels=base
        )
        cpu.add_metric(lv, t.user + t.system)
        yield cpu
        mem = GaugeMetricFamily(
            "nbox_process_resident_memory_bytes", "Resident memory of the real rank's process", labels=base
        )
        mem.add_metric(lv, rss)
        yield mem


def exposed_seconds(ops: list, start: float, end: float) -> float:
    """Seconds the real rank waited on one iteration's collectives (OpRecords), by ``neuronabox.exposed``'s rule."""
    return sum(split([(r.enqueue, r.end, r.wait) for r in ops], start, end))


class _NvmlGpus:
    """GPU utilization and memory through NVML (nvidia-ml-py), for the GPUs this process may use."""

    def __init__(self, nvml, handles: list[tuple[str, object]]):
        self.nvml = nvml
        self.handles = handles
        self.pid = os.getpid()

    @classmethod
    def open(cls) -> "_NvmlGpus | None":
        """NVML's handles, or None without nvidia-ml-py, a driver or a GPU."""
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            return None
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            handles: list[tuple[str, object]] = []
            if visible is None:
                handles = [(str(i), nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
            else:
                for entry in (e.strip() for e in visible.split(",")):
                    if not entry:
                        continue
                    if entry.isdigit():
                        if int(entry) >= count:
                            break  # CUDA stops at the first invalid entry too
                        handles.append((entry, nvml.nvmlDeviceGetHandleByIndex(int(entry))))
                    else:
                        h = nvml.nvmlDeviceGetHandleByUUID(entry)
                        handles.append((str(nvml.nvmlDeviceGetIndex(h)), h))
        except Exception:  # noqa: BLE001 - NVMLError and friends: no driver, no GPU
            return None
        return cls(nvml, handles) if handles else None

    def families(self, base: list[str], lv: list[str]) -> Iterable[Metric]:
        """Utilization and memory gauges, one series per GPU."""
        labels = base + ["gpu"]
        G = GaugeMetricFamily
        util = G("nbox_gpu_utilization_ratio", "Fraction of the last sample period a kernel ran (NVML)", labels=labels)
        used = G("nbox_gpu_memory_used_bytes", "GPU memory in use on the device (all processes)", labels=labels)
        total = G("nbox_gpu_memory_total_bytes", "GPU memory of the device", labels=labels)
        mine = G("nbox_gpu_process_memory_bytes", "GPU memory the real rank's process holds", labels=labels)
        nvml = self.nvml
        for index, h in self.handles:
            try:
                u = nvml.nvmlDeviceGetUtilizationRates(h)
                m = nvml.nvmlDeviceGetMemoryInfo(h)
            except Exception:  # noqa: BLE001 - a GPU fell off the bus: leave it out of this scrape
                continue
            util.add_metric(lv + [index], u.gpu / 100.0)
            used.add_metric(lv + [index], m.used)
            total.add_metric(lv + [index], m.total)
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(h)
                held = sum(p.usedGpuMemory or 0 for p in procs if p.pid == self.pid)
                mine.add_metric(lv + [index], held)
            except Exception:  # noqa: BLE001 - not permitted in some containers
                pass
        yield from (util, used, total, mine)


def parse_addr(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``"127.0.0.1:9464"``, ``":9464"``, ``"9464"``, ``"[::1]:0"`` or a bare host -> (host, port)."""
    text = text.strip()
    host, port = "127.0.0.1", text
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1:end + 2] not in (":", ""):
            raise ValueError(f"metrics address {text!r}: expected [HOST]:PORT")
        host, port = text[1:end], text[end + 2:] or str(default_port)
    elif ":" in text:
        h, port = text.rsplit(":", 1)
        host = h or host
    elif text and not text.isdigit() and any(c.isalpha() or c == "." for c in text):
        host, port = text, str(default_port)
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics address {text!r}: the port must be 0-65535 (0: pick a free one)")
    return host, int(port)


class Exporter:
    """A running exporter: its registry, collector, HTTP server and bound address."""

    def __init__(self, collector: RunCollector, registry: CollectorRegistry, server, thread):
        self.collector = collector
        self.registry = registry
        self.server = server
        self.thread = thread
        host, port = server.server_address[:2]
        self.host, self.port = host, port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.url = f"http://{self.address}/metrics"

    def close(self, linger: float = 0.0) -> None:
        """Stop serving; with ``linger``, first wait up to that long for one more scrape (short runs lose no data)."""
        if linger > 0:
            seen = self.collector.scrapes
            deadline = time.monotonic() + linger
            while self.collector.scrapes == seen and time.monotonic() < deadline:
                time.sleep(0.05)
        self.server.shutdown()
        self.server.server_close()


def start_exporter(
    addr: str = "127.0.0.1:0",
    *,
    cluster: str | None = None,
    run: str | None = None,
    emulator_source: RunSource = current_run,
    address_file: str | None = None,
    gpu: bool = True,
    default_port: int = DEFAULT_PORT,
) -> Exporter:
    """Serve this process's nbox metrics over HTTP on ``addr`` (port 0: a free one, written to ``address_file``)."""
    from prometheus_client import start_http_server

    host, port = parse_addr(addr, default_port)
    registry = CollectorRegistry(auto_describe=False)
    collector = RunCollector(cluster, run, emulator_source, gpu)
    registry.register(collector)
    server, thread = start_http_server(port, addr=host, registry=registry)
    exp = Exporter(collector, registry, server, thread)
    if address_file:
        tmp = f"{address_file}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(exp.address + "\n")
        os.replace(tmp, address_file)  # readers never see half an address
    return exp
