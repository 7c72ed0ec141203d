"""Which kernel serves a decode_linear shape, chosen by timing the candidates on this GPU.

A shape is (rows, N, K, dtype, bias). Its candidates: cuBLAS (F.linear), the Triton GEMV (one row),
and the CUDA tensor-core path (kernels/decode_linear_mma.py) under its default config and a few
others. Each candidate that computes the right result is timed in a CUDA graph over enough copies of
the weight that they do not fit in L2 (a decode step reads its weights from HBM), and the fastest
wins. cuBLAS is always a candidate, so a shape or GPU nobody tuned by hand never gets a kernel that
loses to it. The rewrite (backend/rewrite/decode_linear.py) leaves the linear alone where cuBLAS wins
and otherwise writes the winner into the op's call (`encode`), so a saved graph brings its choice back.

Results are kept per process and, with a directory, in one JSON file per GPU model, torch, Triton and
kernel source (kernels/tuning_store.py); a damaged file is said once and measured again, never trusted.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Callable

import torch

from torch_ext.kernels import decode_linear as op, decode_linear_mma as mma, tuning_store as store

log = logging.getLogger("torch_ext.backend")

PATHS = {path: code for code, path in op.CONFIG_PATHS.items()}  # the op's `config` argument starts with one
# Other CUDA-path configs timed beside the default: (features a block / 16, warps, chunks in flight, x mode).
MMA_ALTERNATIVES = ((1, 16, 1, 2), (1, 8, 1, 2), (1, 8, 1, 1), (1, 4, 1, 1))
# Features a program of the one-row Triton GEMV timed beside its default's 4: a sweep of plain GEMVs on
# an H200 picked 2 (bench/experiments/pdl_gemv.py), the default was picked with norms and gates fused;
# 8 halves the programs of a wide projection.
TRITON_ALTERNATIVES = (2, 8)
# At one row the Triton GEMV is chosen only where it beats the fastest other candidate by this much. Timed
# alone it measures within 2% of the CUDA path on wide projections, but in a model it lost: Qwen2 0.5B's
# 151936-row head on an H200 timed 66.6 us against 67.8 us alone, and the decode step ran 0.669 ms with it
# against 0.647 ms on the CUDA path (3 interleaved rounds;
# bench/results/inference_floor_qwen05_notri_b124_h200_torch2.11.log).
# The CUDA path is also what two rows and up run, so this keeps batch 1's kernels those of batch 2.
TRITON_MARGIN = 0.05


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


class Choice(store.Choice):
    """path "cublas", "triton" or "mma", config that path's launch config."""

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
        out += [Choice("triton", c) for c in dict.fromkeys(triton_configs(shape.k))]
    if (shape.dtype in (torch.float16, torch.bfloat16) and shape.rows <= mma.MMA_MAX_ROWS
            and torch.cuda.get_device_capability(device) >= (8, 0)):
        index = device.index if device.index is not None else torch.cuda.current_device()
        configs = [mma._full(mma.default_config(shape.n, index, shape.rows)), *MMA_ALTERNATIVES]
        out += [Choice("mma", c) for c in dict.fromkeys(configs)]
    return out


def triton_configs(k: int) -> list[tuple[int, ...]]:
    """The one-row GEMV's launch configs timed for K columns (op.TRITON_CONFIG's order): its default,
    then TRITON_ALTERNATIVES' features a program. The columns loaded before the wait keep the default's
    bytes where a program holds more features (registers), and stay a power of two >= a tile, <= K."""
    default = op.config(k)
    out = [tuple(default.values())]
    for features in TRITON_ALTERNATIVES:
        pre_k = max(default["BLOCK_K"], min(default["PRE_K"], default["PRE_K"] * default["BLOCK_N"] // features))
        out.append(tuple(dict(default, BLOCK_N=features, PRE_K=pre_k).values()))
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
        weight_bytes = shape.n * shape.k * torch.finfo(shape.dtype).bits // 8
        copies = store.copies_beyond_l2(weight_bytes, device, most=16)
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*size, scale=1.0):
            return (torch.randn(*size, device=device, generator=g) * scale).to(shape.dtype)

        self.device = device
        self.weights = [randn(shape.n, shape.k, scale=shape.k ** -0.5) for _ in range(copies)]
        self.bias = randn(shape.n) if shape.bias else None
        self.x, self.other = randn(shape.rows, shape.k), randn(shape.rows, shape.k)  # other: up, for a gate
        self.norm_weight = randn(shape.k) + 1

    def time(self, run: Callable[[torch.Tensor], object]) -> float:
        """Microseconds per run(weight), over every copy in one CUDA graph."""
        return store.time_in_graph([lambda w=w: run(w) for w in self.weights], self.device)


def measure_cuda(shape: Shape, choices: list[Choice], device: torch.device) -> dict[Choice, float]:
    """Microseconds per call of each choice that computes F.linear right (others are left out)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad(), torch.cuda.device(device):
        bench = _Bench(shape, device)
        x, bias = bench.x, bench.bias
        ref = torch.nn.functional.linear(x.double(), bench.weights[0].double(), None if bias is None else bias.double())
        times = store.Times()
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
                if store.is_transient(e):
                    times.transient = f"{choice.label()} ran out of memory"
        del bench, ref
    torch.cuda.empty_cache()  # the candidates' copies of the weight: not held as reserved memory afterwards
    return times


def measure_fold_cuda(shape: Shape, part: str, choice: Choice, device: torch.device) -> tuple[float, float]:
    """(us with the prologue `part`, "norm" or "gate", folded into choice's call; us with the call plain
    and one elementwise kernel before it, as Inductor would leave the prologue). A folded prologue is
    computed again by every block of the projection: it pays where the launch it saves costs more.
    "gate_epilogue": the call with silu(gate) * up of its two output halves in its epilogue, against the
    call plain and one elementwise kernel after it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad(), torch.cuda.device(device):
        bench = _Bench(shape, device)
        x, bias, config = bench.x, bench.bias, choice.encode()
        op_call = torch.ops.torch_ext.decode_linear.default
        if part == "gate_epilogue":
            half = shape.n // 2
            buf = torch.empty((shape.rows, half), dtype=shape.dtype, device=device)
            folded = bench.time(lambda w: op_call(x, w, bias, True, gate=[0, half, half], config=config))

            def separate_run(w):
                y = op_call(x, w, bias, True, config=config)
                return torch.mul(y[:, :half], y[:, half:2 * half], out=buf)

            separate = bench.time(separate_run)
        else:
            fused = dict(norm_weight=bench.norm_weight, eps=1e-6) if part == "norm" else dict(up=bench.other)
            second = bench.norm_weight if part == "norm" else bench.other
            buf = torch.empty_like(x)
            folded = bench.time(lambda w: op_call(x, w, bias, True, **fused, config=config))
            separate = bench.time(lambda w: op_call(torch.mul(x, second, out=buf), w, bias, True, config=config))
        del bench, buf
    torch.cuda.empty_cache()
    return folded, separate


class Tuner(store.MeasuredChoices):
    """decode_linear choices per shape (MeasuredChoices), and whether a prologue folded into one pays."""

    kind = "decode_linear"
    choice_type, paths, gpu_measure = Choice, ("cublas", *PATHS), staticmethod(measure_cuda)
    _memo: dict[tuple, object] = {}  # one per process: every compile shares what was measured
    _warned: set[str] = set()
    measured = 0  # shapes and folds timed in this process (counters.tuned_shapes)

    def __init__(self, directory: str | None,
                 measure: Callable[[Shape, list[Choice], torch.device], dict[Choice, float]] = measure_cuda,
                 candidates: Callable[[Shape, torch.device], list[Choice]] = candidates,
                 file_name: Callable[[torch.device], str] = functools.partial(store.file_name, "decode_linear"),
                 measure_fold: Callable[[Shape, str, Choice, torch.device], tuple[float, float]] = measure_fold_cuda):
        super().__init__(directory, measure, candidates, file_name)
        self.measure_fold = measure_fold

    def _fastest(self, times: dict, first):
        """The store's fastest, except that a Triton GEMV within TRITON_MARGIN of the fastest other
        candidate gives way to it."""
        best = super()._fastest(times, first)
        others = {c: t for c, t in times.items() if c.path != "triton"}
        if best is None or best.path != "triton" or not others:
            return best
        rival = super()._fastest(others, first)
        return best if times[best] * (1 + TRITON_MARGIN) < times[rival] else rival

    def fold_pays(self, shape: Shape, part: str, choice: Choice, device: torch.device) -> bool:
        """Whether folding `part` (the "norm" or "gate" prologue, the "gate_epilogue") into choice's call is
        faster on this GPU than leaving it to a kernel of its own (measure_fold_cuda)."""
        folded, separate = self.fold_times(shape, part, choice, device)
        return folded <= separate

    def fold_times(self, shape: Shape, part: str, choice: Choice, device: torch.device) -> tuple[float, float]:
        """(us folded, us separate) of measure_fold_cuda, measured once per GPU model and kept."""
        def compute():
            try:
                folded, separate = self.measure_fold(shape, part, choice, device)
            except Exception as e:  # noqa: BLE001 - a fused variant that cannot run here is never folded
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                transient = store.is_transient(e)
                log.info("torch_ext: decode_linear %s: %s with %s failed (%s: %s); not folded%s", shape.key(), part,
                         choice.label(), type(e).__name__, str(e)[:200],
                         " in this process (the next one measures it again)" if transient else "")
                return (math.inf, 0.0), None if transient else {"fold": False, "us": [math.inf, 0.0]}
            log.info("torch_ext: decode_linear %s: %s folded %.1f us, separate %.1f us (%s)", shape.key(), part,
                     folded, separate, choice.label())
            return (folded, separate), {"fold": folded <= separate, "us": [round(folded, 2), round(separate, 2)]}

        def stored(entry):
            us = entry.get("us") if isinstance(entry, dict) else None
            if isinstance(us, list) and len(us) == 2 and all(isinstance(u, (int, float)) for u in us):
                return float(us[0]), float(us[1])
            return None

        return self.remembered(self.file_name(device), f"{shape.key()}|{part}|{choice.label()}", compute, stored)

    def gate_epilogue_choice(self, shape: Shape, choice: Choice, device: torch.device) -> Choice | None:
        """The kernel a gate/up call with silu(gate) * up in its epilogue runs, or None where none beats the
        call as chosen plus the gate's own kernel. The gated kernels are timed for the call's choice, the
        CUDA path's default (at one row the tuner may pick the Triton GEMV plain, while the CUDA path with the
        gate beats it plus the gate: Qwen2 0.5B's gate/up on an H200, 6.2 us against 9.4) and, at one row,
        each launch config of the Triton GEMV (its epilogue holds more registers: the plain ranking may not
        be the gated one)."""
        others = [c for c in self.candidates(shape, device) if c != choice]
        options = [choice] + [c for c in others if c.path == "mma"][:1] + [c for c in others if c.path == "triton"]
        times = {c: self.fold_times(shape, "gate_epilogue", c, device) for c in options}
        best = min(options, key=lambda c: times[c][0])
        return best if times[best][0] <= times[choice][1] else None
