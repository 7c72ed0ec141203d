"""Which kernel serves a decode_linear shape, chosen by timing the candidates on this GPU.

A shape is (rows, N, K, dtype, bias). Its candidates: cuBLAS (F.linear), the Triton GEMV (one row),
and the CUDA tensor-core path (kernels/decode_linear_mma.py) under its default config and a few
others. Each candidate that computes the right result is timed in a CUDA graph over enough copies of
the weight that they do not fit in L2 (a decode step reads its weights from HBM), and the fastest
wins. cuBLAS is always a candidate, so a shape or GPU nobody tuned by hand never gets a kernel that
loses to it. The rewrite (backend/rewrite/decode_linear.py) leaves the linear alone where cuBLAS wins
and otherwise writes the winner into the op's call (`encode`), so a saved graph brings its choice back.

Results are kept per process and, with a directory, in one JSON file per GPU model, torch, Triton and
kernel source; a damaged file is said once and measured again, never trusted.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from typing import Callable

import torch

from torch_ext import process_lock
from torch_ext.kernels import decode_linear as op, decode_linear_mma as mma

log = logging.getLogger("torch_ext.backend")

PATHS = {path: code for code, path in op.CONFIG_PATHS.items()}  # the op's `config` argument starts with one
# Other CUDA-path configs timed beside the default: (features a block / 16, warps, chunks in flight, x mode).
MMA_ALTERNATIVES = ((1, 16, 1, 2), (1, 8, 1, 2), (1, 8, 1, 1), (1, 4, 1, 1))
_FORMAT = 1  # bump when what a result means changes


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int
    n: int
    k: int
    dtype: torch.dtype
    bias: bool

    @classmethod
    def of(cls, x, weight, has_bias: bool) -> "Shape":
        """The shape of F.linear(x, weight, bias) (x's leading dims are its rows)."""
        return cls(math.prod(x.shape[:-1]), weight.shape[0], weight.shape[1], x.dtype, has_bias)

    def key(self) -> str:
        return f"{self.rows},{self.n},{self.k},{str(self.dtype).removeprefix('torch.')},{int(self.bias)}"


@dataclasses.dataclass(frozen=True)
class Choice:
    path: str  # "cublas", "triton" or "mma"
    config: tuple[int, ...] = ()

    def encode(self) -> list[int] | None:
        """The op's `config` argument (None for cuBLAS: the rewrite leaves that linear alone)."""
        return None if self.path == "cublas" else [PATHS[self.path], *self.config]


def decode(config: list[int] | None) -> Choice | None:
    """The op's `config` argument back as a Choice (None: the op's defaults)."""
    decoded = op.decoded_config(config)
    return Choice(*decoded) if decoded else None


def candidates(shape: Shape, device: torch.device) -> list[Choice]:
    """cuBLAS first, then the op's kernels that may take the shape on this device."""
    out = [Choice("cublas")]
    if shape.k % 64:
        return out
    if shape.rows == 1 and op.has_triton():
        out.append(Choice("triton", tuple(op.config(shape.k).values())))
    if (shape.dtype in (torch.float16, torch.bfloat16) and shape.rows <= mma.MMA_MAX_ROWS
            and torch.cuda.get_device_capability(device) >= (8, 0)):
        index = device.index if device.index is not None else torch.cuda.current_device()
        configs = [mma._full(mma.default_config(shape.n, index, shape.rows)), *MMA_ALTERNATIVES]
        out += [Choice("mma", c) for c in dict.fromkeys(configs)]
    return out


def _run(choice: Choice, x, weight, bias):
    from torch_ext.kernels.pdl_kernels import has_pdl

    if choice.path == "cublas":
        return torch.nn.functional.linear(x, weight, bias)
    pdl = has_pdl(x.device)  # as in a model, where most projections prefetch their weights
    if choice.path == "triton":
        return op.decode_linear_triton(x, weight, bias, pdl, dict(zip(op.TRITON_CONFIG, choice.config)))
    return mma.decode_linear_mma(x, weight, bias, pdl, config=choice.config)


class _Bench:
    """Random operands of a shape on device, the weight in enough copies that they do not fit in L2."""

    def __init__(self, shape: Shape, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        weight_bytes = shape.n * shape.k * torch.finfo(shape.dtype).bits // 8
        copies = max(1, min(16, math.ceil(3 * getattr(props, "L2_cache_size", 50 << 20) / weight_bytes)))
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*size, scale=1.0):
            return (torch.randn(*size, device=device, generator=g) * scale).to(shape.dtype)

        self.device = device
        self.weights = [randn(shape.n, shape.k, scale=shape.k ** -0.5) for _ in range(copies)]
        self.bias = randn(shape.n) if shape.bias else None
        self.x, self.other = randn(shape.rows, shape.k), randn(shape.rows, shape.k)  # other: up, for a gate
        self.norm_weight = randn(shape.k) + 1

    def time(self, run: Callable[[torch.Tensor], object]) -> float:
        """Microseconds per run(weight), captured once over every copy and replayed (launch gaps as in a
        model's CUDA graph)."""
        # Under the process lock where it comes: a compile on the background thread times while no call
        # queues kernels beside these; the capture is thread-local, so another thread cannot break it.
        with process_lock.quiet():
            graph = torch.cuda.CUDAGraph()
            stream = _capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for w in self.weights:  # warm the launch path on the capture stream
                    run(w)
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    for w in self.weights:
                        run(w)
            torch.cuda.current_stream().wait_stream(stream)
            for _ in range(3):
                graph.replay()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
            for start, end in events:
                start.record()
                graph.replay()
                end.record()
            torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) for s, e in events)[len(events) // 2] * 1e3 / len(self.weights)


def measure_cuda(shape: Shape, choices: list[Choice], device: torch.device) -> dict[Choice, float]:
    """Microseconds per call of each choice that computes F.linear right (others are left out)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad(), torch.cuda.device(device):
        bench = _Bench(shape, device)
        x, bias = bench.x, bench.bias
        ref = torch.nn.functional.linear(x.double(), bench.weights[0].double(), None if bias is None else bias.double())
        times = {}
        for choice in choices:
            try:
                y = _run(choice, x, bench.weights[0], bias)
                err = ((y.double() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:  # NaN too: a candidate that is wrong here is never chosen
                    log.warning("torch_ext: decode_linear candidate %s is wrong on %s (relative error %.2e); "
                                "left out", choice, shape, err)
                    continue
                times[choice] = bench.time(lambda w, choice=choice: _run(choice, x, w, bias))
            except Exception as e:  # noqa: BLE001 - a candidate that cannot run here is not chosen
                torch.cuda.synchronize()
                log.info("torch_ext: decode_linear candidate %s failed on %s (%s: %s); left out", choice, shape,
                         type(e).__name__, str(e)[:200])
        del bench, ref
    torch.cuda.empty_cache()  # the candidates' copies of the weight: not held as reserved memory afterwards
    return times


def measure_fold_cuda(shape: Shape, part: str, choice: Choice, device: torch.device) -> tuple[float, float]:
    """(us with the prologue `part`, "norm" or "gate", folded into choice's call; us with the call plain
    and one elementwise kernel before it, as Inductor would leave the prologue). A folded prologue is
    computed again by every block of the projection: it pays where the launch it saves costs more."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad(), torch.cuda.device(device):
        bench = _Bench(shape, device)
        x, bias, config = bench.x, bench.bias, choice.encode()
        fused = dict(norm_weight=bench.norm_weight, eps=1e-6) if part == "norm" else dict(up=bench.other)
        second = bench.norm_weight if part == "norm" else bench.other
        buf = torch.empty_like(x)
        op_call = torch.ops.torch_ext.decode_linear.default
        folded = bench.time(lambda w: op_call(x, w, bias, True, **fused, config=config))
        separate = bench.time(lambda w: op_call(torch.mul(x, second, out=buf), w, bias, True, config=config))
        del bench, buf
    torch.cuda.empty_cache()
    return folded, separate


@functools.lru_cache(maxsize=None)
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture: cuBLAS keeps a workspace (32 MiB on Hopper) per
    stream it ran on, for the life of the process (a stream per candidate held 704 MiB, H200)."""
    return torch.cuda.Stream(device)


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """The kernels' sources and this file: a change to any is a new tuning file."""
    import torch_ext.kernels as kernels

    root = os.path.dirname(kernels.__file__)
    h = hashlib.sha256(str(_FORMAT).encode())
    for name in sorted(os.listdir(root)):
        if name.startswith("decode_linear") and name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)  # asked once per shape; a device's name, torch and Triton never change
def _file_name(device: torch.device) -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    props = torch.cuda.get_device_properties(device)
    gpu = "".join(c if c.isalnum() else "-" for c in props.name)
    return (f"decode_linear-{gpu}-sm{props.major}{props.minor}-torch{torch.__version__.split('+')[0]}"
            f"-triton{triton_version}-{_source_hash()}.json")


class Tuner:
    """Choices per shape: from this process, then the directory's file, else measured (and written)."""

    _lock = threading.Lock()
    _memo: dict[tuple, Choice] = {}  # one per process: every compile shares what was measured
    _warned: set[str] = set()
    measured = 0  # shapes timed in this process (counters.tuned_shapes)

    def __init__(self, directory: str | None,
                 measure: Callable[[Shape, list[Choice], torch.device], dict[Choice, float]] = measure_cuda,
                 candidates: Callable[[Shape, torch.device], list[Choice]] = candidates,
                 file_name: Callable[[torch.device], str] = _file_name,
                 measure_fold: Callable[[Shape, str, Choice, torch.device], tuple[float, float]] = measure_fold_cuda):
        self.directory, self.measure, self.candidates, self.file_name = directory, measure, candidates, file_name
        self.measure_fold = measure_fold

    def fold_pays(self, shape: Shape, part: str, choice: Choice, device: torch.device) -> bool:
        """Whether folding the prologue `part` ("norm" or "gate") into choice's call is faster on this GPU
        than leaving it to a kernel of its own (measure_fold_cuda)."""
        with self._lock:
            name = self.file_name(device)
            key = f"{shape.key()}|{part}|{choice.path}{list(choice.config)}"
            if (name, key) in self._memo:
                return self._memo[(name, key)]
            stored = self._load(name).get(key)
            if isinstance(stored, dict) and isinstance(stored.get("fold"), bool):
                pays = stored["fold"]
            else:
                folded, separate = self.measure_fold(shape, part, choice, device)
                pays = folded <= separate
                log.info("torch_ext: decode_linear %s: %s folded %.1f us, separate %.1f us -> %s", shape.key(),
                         part, folded, separate, "folded" if pays else "left to Inductor")
                self._write(name, key, {"fold": pays, "us": [round(folded, 2), round(separate, 2)]})
                Tuner.measured += 1
            self._memo[(name, key)] = pays
            return pays

    def choose(self, shape: Shape, device: torch.device) -> Choice | None:
        """The fastest kernel for shape on device; None (the op's defaults) where nothing can be timed."""
        if device.type != "cuda" and self.measure is measure_cuda:
            return None
        with self._lock:
            name = self.file_name(device)
            memo_key = (name, shape)
            if memo_key in self._memo:
                return self._memo[memo_key]
            stored = self._load(name).get(shape.key())
            choice = _from_json(stored)
            if choice is not None and choice not in self.candidates(shape, device):  # not what this code runs
                choice = None
            if choice is None:
                start = time.perf_counter()
                times = self.measure(shape, self.candidates(shape, device), device)
                choice = min(times, key=times.get) if times else Choice("cublas")
                log.info("torch_ext: decode_linear %s -> %s (%s; tuned in %.2f s)", shape.key(), choice,
                         ", ".join(f"{c.path}{list(c.config)} {t:.1f} us" for c, t in sorted(times.items(),
                                                                                       key=lambda ct: ct[1])),
                         time.perf_counter() - start)
                self._write(name, shape.key(), {
                    "path": choice.path, "config": list(choice.config),
                    "us": {f"{c.path}{list(c.config)}": round(t, 2) for c, t in times.items()}})
                Tuner.measured += 1
            self._memo[memo_key] = choice
            return choice

    def _path(self, name: str) -> str | None:
        return os.path.join(self.directory, "tuning", name) if self.directory else None

    def _load(self, name: str) -> dict:
        path = self._path(name)
        if path is None or not os.path.exists(path):
            return {}
        try:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("shapes"), dict):
                raise ValueError("not a tuning file of this version")
            return data["shapes"]
        except (OSError, ValueError) as e:
            if path not in self._warned:
                self._warned.add(path)
                log.warning("torch_ext: ignoring the damaged kernel tuning file %s (%s); its shapes are "
                            "measured again and the file rewritten", path, e)
            return {}

    def _write(self, name: str, key: str, entry: dict) -> None:
        path = self._path(name)
        if path is None:
            return
        shapes = self._load(name)
        shapes[key] = entry
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tuning-")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": _FORMAT, "shapes": shapes}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)  # readers see the old file or the new one, never half of one
        except OSError as e:
            log.warning("torch_ext: could not write the kernel tuning file %s (%s); kept in this process", path, e)


def _from_json(stored) -> Choice | None:
    if not isinstance(stored, dict) or stored.get("path") not in ("cublas", *PATHS):
        return None
    config = stored.get("config", [])
    if not isinstance(config, list) or not all(isinstance(c, int) for c in config):
        return None
    return Choice(stored["path"], tuple(config))
