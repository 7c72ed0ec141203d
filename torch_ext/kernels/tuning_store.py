"""What the kernel tuners share: a shape's choice measured once per process and kept on disk, and the
timing of candidates in a CUDA graph.

A tuner (kernels/decode_linear_tuning.py, kernels/decode_attention_tuning.py) says which candidates a
shape has and how to time them; `MeasuredChoices.choose` asks this process first, then the tuning file,
and measures only what neither knows. Files are one JSON per GPU model, torch, Triton and kernel source
(`file_name`), written whole by rename; a damaged file is said once and measured again, never trusted.
What a shortage of memory decided (a candidate that ran out of memory, a shape with no room to time) is
kept in this process only: the next process, with other memory beside it, measures it again.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from typing import Callable, Hashable

import torch

from torch_ext import process_lock

log = logging.getLogger("torch_ext.backend")

FORMAT = 1  # bump when what a result means changes


class Times(dict):
    """Microseconds per candidate; `transient` says why the measurement is incomplete for a reason of this
    moment (memory held beside it), in which case its choice is not written to the tuning file."""

    def __init__(self, *args, transient: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.transient = transient


def is_transient(error: BaseException) -> bool:
    """Whether a candidate's failure depends on what else the process holds, not on the candidate."""
    return isinstance(error, torch.OutOfMemoryError)


def time_in_graph(calls: list[Callable[[], object]], device: torch.device) -> float:
    """Microseconds per call of `calls`, captured once in a CUDA graph and replayed (launch gaps as in a
    model's CUDA graph). Each call should read its own operands, so that together they do not fit in L2
    (a decode step reads its weights and caches from HBM)."""
    # Under the process lock where it comes: a compile on the background thread times while no call
    # queues kernels beside these; the capture is thread-local, so another thread cannot break it.
    with process_lock.quiet():
        graph = torch.cuda.CUDAGraph()
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:  # warm the launch path on the capture stream
                call()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                for call in calls:
                    call()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[len(events) // 2] * 1e3 / len(calls)


def copies_beyond_l2(nbytes: int, device: torch.device, most: int) -> int:
    """How many copies of nbytes of operands make three L2s' worth (at most `most`)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(most, -(-3 * l2 // max(1, nbytes))))


@functools.lru_cache(maxsize=None)
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture: cuBLAS keeps a workspace (32 MiB on Hopper) per
    stream it ran on, for the life of the process (a stream per candidate held 704 MiB, H200)."""
    return torch.cuda.Stream(device)


@functools.lru_cache(maxsize=None)
def _source_hash(prefix: str) -> str:
    """The kernels' sources named prefix*.py and this file: a change to any is a new tuning file."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(str(FORMAT).encode())
    for name in sorted(os.listdir(root)):
        if (name.startswith(prefix) or name == "tuning_store.py") and name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)  # asked once per shape; a device's name, torch and Triton never change
def file_name(prefix: str, device: torch.device) -> str:
    """The tuning file of the kernels prefix*.py on device's GPU model with this torch and Triton."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    props = torch.cuda.get_device_properties(device)
    gpu = "".join(c if c.isalnum() else "-" for c in props.name)
    return (f"{prefix}-{gpu}-sm{props.major}{props.minor}-torch{torch.__version__.split('+')[0]}"
            f"-triton{triton_version}-{_source_hash(prefix)}.json")


@dataclasses.dataclass(frozen=True)
class Choice:
    """A candidate: its path (which kernel, or the op it replaces) and that path's launch config."""
    path: str
    config: tuple[int, ...] = ()

    def label(self) -> str:
        return f"{self.path}{list(self.config)}"


class MeasuredChoices:
    """Choices per shape: from this process, then the directory's file, else measured (and written).

    A subclass names its kernels (`kind`), its Choice class and the paths a stored choice may name, its
    GPU timing (`gpu_measure`: with it, devices other than CUDA get no choice), and keeps its own
    `_memo`, `_warned` and `measured` (counters.tuned_shapes counts the last)."""

    kind = ""
    choice_type: type[Choice] = Choice
    paths: tuple[str, ...] = ()
    gpu_measure: Callable | None = None  # a staticmethod in subclasses
    # The first candidate (the built-in choice) is kept unless another is faster by more than this
    # fraction: between near-equal launches a single timing picks by noise.
    margin = 0.0
    _lock = threading.Lock()  # one for every tuner: measurements never overlap on the GPU
    _memo: dict[tuple, object]
    _warned: set[str]
    measured: int

    def __init__(self, directory: str | None, measure: Callable, candidates: Callable,
                 file_name: Callable[[torch.device], str]):
        self.directory, self.measure, self.candidates, self.file_name = directory, measure, candidates, file_name

    def choose(self, shape, device: torch.device):
        """The fastest candidate for shape on device (the first candidate where none could be timed);
        None (the op's built-in config) off CUDA, where the GPU timing cannot run."""
        if device.type != "cuda" and self.measure is self.gpu_measure:
            return None
        with self._lock:
            name = self.file_name(device)
            candidates = self.candidates(shape, device)
            # The candidates are part of the key: a tuner offered others (a bench column, a test) measures
            # among its own rather than reuse a choice made among more.
            memo_key = (name, shape, tuple(candidates))
            if memo_key in self._memo:
                return self._memo[memo_key]
            choice = self._from_json(self.load(name).get(shape.key()))
            if choice is not None and choice not in candidates:  # not what this code runs
                choice = None
            if choice is None:
                start = time.perf_counter()
                times = self.measure(shape, candidates, device)
                choice = self._fastest(times, candidates[0])
                ranked = sorted(times.items(), key=lambda ct: ct[1])
                log.info("torch_ext: %s %s -> %s (%s; tuned in %.2f s)", self.kind, shape.key(), choice,
                         ", ".join(f"{c.label()} {t:.1f} us" for c, t in ranked), time.perf_counter() - start)
                transient = getattr(times, "transient", None)
                if transient:
                    log.info("torch_ext: %s %s: kept in this process only (%s); the next process measures it "
                             "again", self.kind, shape.key(), transient)
                else:
                    self.write(name, shape.key(), dict(self._to_json(choice),
                                                       us={c.label(): round(t, 2) for c, t in times.items()}))
                type(self).measured += 1
            self._memo[memo_key] = choice
            return choice

    def remembered(self, name: str, key: Hashable, compute: Callable[[], tuple[object, dict]],
                   read: Callable[[object], object]):
        """A measured fact other than a choice (e.g. whether a fusion pays): this process's, the file's
        where read(stored) is not None, else compute() -> (value, entry to store; None: this process only).
        Under the lock."""
        with self._lock:
            if (name, key) in self._memo:
                return self._memo[(name, key)]
            value = read(self.load(name).get(key))
            if value is None:
                value, entry = compute()
                if entry is not None:
                    self.write(name, key, entry)
                type(self).measured += 1
            self._memo[(name, key)] = value
            return value

    def _fastest(self, times: dict, first):
        """The fastest timed choice; `first` where nothing was timed, or where it was and none beats it
        by more than `margin`."""
        if not times:
            return first
        best = min(times, key=times.get)
        return first if first in times and times[best] * (1 + self.margin) >= times[first] else best

    def _to_json(self, choice: Choice) -> dict:
        return {"path": choice.path, "config": list(choice.config)}

    def _from_json(self, stored) -> Choice | None:
        """A stored choice, or None where it is not one (whether this code still runs it, the candidates say)."""
        if not isinstance(stored, dict) or stored.get("path") not in self.paths:
            return None
        config = stored.get("config", [])
        if not isinstance(config, list) or not all(isinstance(c, int) for c in config):
            return None
        return self.choice_type(stored["path"], tuple(config))

    def _path(self, name: str) -> str | None:
        return os.path.join(self.directory, "tuning", name) if self.directory else None

    def load(self, name: str) -> dict:
        path = self._path(name)
        if path is None or not os.path.exists(path):
            return {}
        try:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("shapes"), dict):
                raise ValueError("not a tuning file of this version")
            return data["shapes"]
        except (OSError, ValueError) as e:
            if path not in self._warned:
                self._warned.add(path)
                log.warning("torch_ext: ignoring the damaged kernel tuning file %s (%s); its shapes are "
                            "measured again and the file rewritten", path, e)
            return {}

    def write(self, name: str, key: str, entry: dict) -> None:
        path = self._path(name)
        if path is None:
            return
        shapes = self.load(name)
        shapes[key] = entry
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tuning-")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "shapes": shapes}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)  # readers see the old file or the new one, never half of one
        except OSError as e:
            log.warning("torch_ext: could not write the kernel tuning file %s (%s); kept in this process", path, e)
