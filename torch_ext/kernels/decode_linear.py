"""`torch.ops.torch_ext.decode_linear`: F.linear for a few rows (a decode step's projections), at
memory bandwidth.

    decode_linear(x, weight, bias, prefetch, norm_weight=None, eps=0.0, up=None, residual=None, gate=None,
                  config=None)
        -> gated(F.linear(prologue(x), weight, bias)) (+ residual)
        x: (..., K); weight (N, K); bias None or (N,).
        prefetch: the weight is written by no kernel of the graph the call runs in, and a kernel of
        that graph runs before it (the rewrite checks both): the kernel may then load its first
        weight columns before the kernel before it has finished (programmatic dependent launch).
        norm_weight (K,): x is first RMS-normalized as HF's RMSNorm does:
            h = x.float(); x = norm_weight * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        up (..., K) like x: then x = silu(x) * up (a gated MLP's input to its down projection).
        gate [gate_start, up_start, width]: the output is silu(y[..., gate_start:gate_start + width]) *
        y[..., up_start:up_start + width] for the projection's y (a gated MLP's merged gate/up projection
        and its product; the rewrite uses it where GATE_EPILOGUE_ROWS says).
        residual then has the product's shape.
        residual (..., N or width): added to the output (a residual stream's add).
        config: the kernel and its launch config, as measured for this shape on this GPU
        (kernels/decode_linear_tuning.py: [1, BLOCK_N, BLOCK_K, PRE_K, warps] the Triton GEMV, [2, features
        a block / 16, warps, chunks, x mode] the CUDA path); None: the defaults below.

The fused parts (rewrite/decode_linear_fusion.py puts them in) save a decode layer the launches and
round trips of its norms, its gate and its residual adds (at 2..MAX_ROWS rows its residual adds).

Why: at one row a projection is a GEMV whose kernel is short (2-18 us) and pays a ramp and a tail
each time; cuBLAS's GEMVs ran a chain of Llama-shaped projections at 1.64x the bytes' floor on an
H200, this kernel at 1.38x, and 1.26x when it loads its weights before the previous kernel is done
(bench/experiments/pdl_gemv.py, bench/results/pdl_gemv_*). The rewrite that puts the op in place of linear is
torch_ext/backend/rewrite/decode_linear.py.

CUDA runs, at one row, the Triton kernel where it takes the shapes (a contiguous weight, K a multiple of
64, a float dtype shared by x, weight and bias); at 2..MAX_ROWS rows of float16 / bfloat16, the CUDA
path of kernels/decode_linear_mma.py (tensor cores, the same fused parts) where it takes them; everything
else runs F.linear.
"""
from __future__ import annotations

import functools

import torch

from torch_ext.kernels import decode_linear_mma as mma  # its functions looked up per call: tests wrap them
from torch_ext.kernels.fused_add_rms_norm import has_triton
from torch_ext.kernels.launch_policy import runs_reference

__all__ = ["GATE_PROLOGUE_MAX_ROWS", "MAX_ROWS", "NORM_PROLOGUE_MAX_ROWS", "decode_linear", "decode_linear_reference", "decode_linear_triton",
           "kernel_takes", "prologue_reference", "serves", "serves_gate", "serves_prologue"]

# Rows (batch x tokens) the op runs a kernel of its own for; more run F.linear. One row: the Triton kernel
# (kernels/decode_linear_kernels.py), any float dtype. 2..MAX_ROWS rows, 16-bit: the CUDA path
# (kernels/decode_linear_mma.py). H100, a chain of Llama projections (bench/dev/decode_linear_op.py): one row
# 0.83x cuBLAS's time; the CUDA path, its x loaded a round ahead and its config by shape and rows, 0.82x
# at 8 rows, 0.84x at 16, 0.92x at 32 (summed over chains of one projection each; before x was loaded
# ahead: 0.91x, 1.04x, 1.28x, when MAX_ROWS was 8; bench/results/decode_linear_xpf_h100_torch2.11.log; the ordered
# pipeline took 4-13% more off at 8-16 rows since: decode_linear_mma.default_config).
# Triton's multi-row paths (a tile per row, tl.dot; removed, in the history before commit 4d655c2) ran 2
# rows at 1.02x, 4 at 1.30x, 8 at 1.35x (bench/results/decode_linear_op_h100_torch2.11.log).
MAX_ROWS = 32
# Rows up to which the rewrite folds the norm, and the gate, into the op (the residual add: every row
# count). At 8 rows every block of the CUDA path redoes a prologue over all of x: HF Llama batch 8 on an
# H100 ran 1.298 ms with both fused against 1.179 with cuBLAS and Inductor's norms
# (bench/results/inference_floor_mma_h100_torch2.11.log). The norm alone at 8 rows (bench column
# ext-norm8: a pass over x per block, in L2) still lost: 1.091 against 1.058 ms
# (bench/results/inference_floor_norm8_h100_torch2.11.log).
NORM_PROLOGUE_MAX_ROWS = 1
GATE_PROLOGUE_MAX_ROWS = 1
# At which row counts the rewrite puts a gated MLP's silu(gate) * up into its gate/up projection's
# epilogue (the CUDA path: 2..MAX_ROWS rows). On at 9-32 rows (H100, one call, against the gate left to
# Inductor): HF Llama batch 32 1.322 against 1.386 ms, batch 24 1.206 against 1.293; decode.py batch 32
# 0.90x the hand-captured graph against 0.93x, batch 24 0.87x against 0.93x
# (bench/results/gate_epilogue_registers_h100_torch2.11.log); batch 16 1.155 against 1.179 ms, batch 12
# 1.062 against 1.083 (inference_floor_gate_rows9to16_h100_torch2.11.log). Until its kernel held 80
# registers at 4 warps (it held 110: 4 blocks an SM, so gate/up's 704 blocks took two waves) it lost at
# 17-32 rows. At 2-8 rows it lost too, with 8 warps: HF Llama batch 8 1.075 against 1.042 ms (the gate/up
# kernel 21.3 us against 18.6; bench/results/inference_floor_early_launch_h100_torch2.11.log), not
# measured since. These rows are the rule without tuning (CompileConfig.kernel_tuning off). One row is not
# among them: the one-row Triton GEMV has the epilogue too (each program pairs a gate row with its up row),
# but on Qwen2 0.5B's gate/up it timed 12.3 us against 9.3 for the plain GEMV plus the gate's kernel (H200).
# Where kernels are tuned, every row count up to MAX_ROWS gets the epilogue where a gated kernel times
# faster than the call plain and the gate's own kernel, per shape on the GPU (decode_linear_tuning:
# Tuner.gate_epilogue_choice; at one row it picked the CUDA path with the gate, 6.2 us). GATE_EPILOGUE
# False: never (bench column ext-nogate).
GATE_EPILOGUE_ROWS = range(9, 33)
GATE_EPILOGUE = True
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("torch_ext::decode_linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prefetch: bool,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0, up: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, gate: list[int] | None = None,
                  config: list[int] | None = None) -> torch.Tensor:
    """Every device without the kernel: the eager formulation."""
    return decode_linear_reference(x, weight, bias, norm_weight, eps, up, residual, gate)


@decode_linear.register_fake
def _(x, weight, bias, prefetch, norm_weight=None, eps=0.0, up=None, residual=None, gate=None, config=None):
    _check_gate(gate, weight.shape[0])
    decoded_config(config)  # a config naming no kernel fails at compile time
    return x.new_empty((*x.shape[:-1], weight.shape[0] if gate is None else gate[2]))


@decode_linear.register_kernel("cuda")
def _(x, weight, bias, prefetch, norm_weight=None, eps=0.0, up=None, residual=None, gate=None, config=None):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if runs_reference("decode_linear") or not 0 < rows <= MAX_ROWS:
        return decode_linear_reference(x, weight, bias, norm_weight, eps, up, residual, gate)
    path, launch = decoded_config(config) or (None, None)
    # The CUDA path: where measured fastest, else (defaults) at 2..MAX_ROWS rows; Triton's multi-row paths
    # lost to cuBLAS (the docstring). The Triton kernel serves one row, with a gate too.
    triton_row = path == "triton" if path else rows == 1
    if not triton_row or rows > 1:
        if not triton_row and mma.mma_takes(x, weight, bias, norm_weight, up, residual, gate):
            return mma.decode_linear_mma(x, weight, bias, prefetch, norm_weight=norm_weight, eps=eps, up=up,
                                         residual=residual, gate=gate, config=launch)
        return decode_linear_reference(x, weight, bias, norm_weight, eps, up, residual, gate)
    if not (has_triton() and kernel_takes(x, weight, bias, norm_weight, up, residual, gate)):
        return decode_linear_reference(x, weight, bias, norm_weight, eps, up, residual, gate)
    from torch_ext.kernels.pdl_kernels import has_pdl

    overrides = dict(zip(TRITON_CONFIG, launch)) if launch else None
    return decode_linear_triton(x, weight, bias, prefetch and has_pdl(x.device), overrides, norm_weight=norm_weight,
                                eps=eps, up=up, residual=residual, gate=gate)


# The op's `config` argument: [path, *its launch config], as kernels/decode_linear_tuning.py measured it.
CONFIG_PATHS = {1: "triton", 2: "mma"}
TRITON_CONFIG = ("BLOCK_N", "BLOCK_K", "PRE_K", "num_warps")


def decoded_config(config: list[int] | None) -> tuple[str, tuple[int, ...]] | None:
    """(path, launch config) of the op's `config` argument; None: the defaults."""
    if not config:
        return None
    path = CONFIG_PATHS.get(int(config[0]))
    if path is None:
        raise ValueError(f"decode_linear: config {list(config)} names no kernel path (first entry 1 Triton, 2 CUDA)")
    return path, tuple(int(c) for c in config[1:])


def decode_linear_reference(x, weight, bias, norm_weight=None, eps: float = 0.0, up=None, residual=None, gate=None):
    """What the op computes, as eager writes it (HF's RMSNorm, silu(gate) * up, a residual add)."""
    y = torch.nn.functional.linear(prologue_reference(x, norm_weight, eps, up), weight, bias)
    if gate is not None:
        _check_gate(gate, weight.shape[0])
        gate_start, up_start, width = gate
        y = torch.nn.functional.silu(y[..., gate_start:gate_start + width]) * y[..., up_start:up_start + width]
    return y if residual is None else y + residual


def _check_gate(gate, n: int) -> None:
    """A gate names two slices of the projection's n outputs (the rewrite builds it; a hand-written call
    gets this error rather than a silently short slice)."""
    if gate is not None and not mma.gate_fits(gate, n):
        raise ValueError(f"decode_linear: gate {list(gate)} is not [gate_start, up_start, width] with both "
                         f"slices inside the projection's {n} outputs")


def prologue_reference(x, norm_weight=None, eps: float = 0.0, up=None):
    """The linear's input after the fused norm and gate, rounded where eager rounds."""
    if norm_weight is not None:
        h = x.float()
        x = norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if up is not None:
        x = torch.nn.functional.silu(x) * up
    return x


def serves(rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the op runs a kernel of its own for this many rows of this dtype on this device (the
    rewrite puts it in only there): one row of a float dtype, or 2..MAX_ROWS rows of a 16-bit float on
    a GPU with mma.sync (compute capability 8.0+; other devices run the reference, tests use them)."""
    if rows == 1:
        return dtype in _DTYPES
    return (1 < rows <= MAX_ROWS and dtype in (torch.float16, torch.bfloat16)
            and (device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)))


def serves_gate(rows: int, dtype: torch.dtype, device: torch.device, tuned: bool = False) -> bool:
    """Whether the rewrite may put a gate into the op's call at this many rows (the Triton kernel computes
    it at one row, the CUDA path at 2..MAX_ROWS): tuned, at every row count (the tuner then decides per
    shape); else where GATE_EPILOGUE_ROWS says."""
    return (GATE_EPILOGUE and (rows <= MAX_ROWS if tuned else rows in GATE_EPILOGUE_ROWS)
            and serves(rows, dtype, device))


def serves_prologue(rows: int, dtype: torch.dtype, device: torch.device, part: str) -> bool:
    """Whether the rewrite folds a norm (part "norm") or gate ("gate") into the op's call at this many rows."""
    limit = {"norm": NORM_PROLOGUE_MAX_ROWS, "gate": GATE_PROLOGUE_MAX_ROWS}[part]
    return rows <= limit and serves(rows, dtype, device)


def kernel_takes(x, weight, bias, norm_weight=None, up=None, residual=None, gate=None) -> bool:
    """Shapes and layouts the Triton kernel serves (the op falls back to the reference on the rest): one
    row, a float dtype shared by every operand, K a multiple of 64, contiguous weight and operands, a
    gate's slices inside the weight."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    n = weight.shape[0] if weight.dim() == 2 else -1
    if gate is not None and not mma.gate_fits(gate, n):
        return False
    out = n if gate is None else gate[2]

    def plain(t, shape) -> bool:  # an optional operand: x's dtype, the given shape, contiguous
        return t is None or (t.dtype == x.dtype and t.shape == shape and t.is_contiguous())

    return (rows == 1 and weight.dim() == 2 and weight.shape[1] == k and k % 64 == 0
            and weight.is_contiguous() and x.dtype in _DTYPES and weight.dtype == x.dtype
            and plain(bias, (n,)) and plain(norm_weight, (k,)) and plain(up, x.shape)
            and plain(residual, (*x.shape[:-1], out)))


@functools.lru_cache(maxsize=None)
def config(k: int) -> dict:
    """Launch config: 4 features x 512 columns a tile, the first 2048 loaded before the wait, 4 warps.
    bench/experiments/pdl_gemv.py's sweep of plain GEMVs (H200) picked 2 features; with the norm and gate fused,
    every program computes its prologue over the whole row, and 4 features halve that work: HF Llama
    batch 1 on an H100 0.861 ms against 0.910 (8 features 0.955, 8 with 8 warps 0.894,
    bench/results/inference_floor_row_tile_h100_torch2.11.log). Cached: the caller copies it."""
    block_k = next(b for b in (512, 256, 128, 64) if k % b == 0)
    pre_k = max(block_k, min(1 << (k.bit_length() - 1), 2048))  # a power of two <= k: a multiple of block_k
    return dict(BLOCK_N=4, BLOCK_K=block_k, PRE_K=pre_k, num_warps=4)


def decode_linear_triton(x, weight, bias, pdl: bool, overrides: dict | None = None, *, norm_weight=None,
                         eps: float = 0.0, up=None, residual=None, gate=None) -> torch.Tensor:
    """The Triton kernel, one row (also on CPU tensors under TRITON_INTERPRET=1, with pdl False, for
    tests); overrides (launch config entries) replace the kernel's choice (bench/inference_floor.py)."""
    import triton

    from torch_ext.kernels.decode_linear_kernels import decode_linear_kernel
    from torch_ext.kernels.pdl_kernels import launch_options

    _check_gate(gate, weight.shape[0])
    k = weight.shape[1]
    n = weight.shape[0] if gate is None else gate[2]  # outputs
    x2 = x.reshape(-1, k)
    if x2.shape[0] != 1:
        raise ValueError(f"decode_linear_triton: one row, not {x2.shape[0]} (the op routes more rows elsewhere)")
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = {**config(k), **(overrides or {})}
    if gate is not None:  # a program pairs gate and up rows: half as many outputs, the same weight rows a program
        cfg["BLOCK_N"] = max(1, cfg["BLOCK_N"] // 2)
    up2 = up.reshape(-1, k).contiguous() if up is not None else x2
    res2 = residual.reshape(-1, n).contiguous() if residual is not None else y
    gate_start, up_start = (gate[0], gate[1]) if gate is not None else (0, 0)
    decode_linear_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x2, weight, bias if bias is not None else weight, y, norm_weight if norm_weight is not None else weight,
        up2, res2, float(eps), n, int(gate_start), int(up_start), K=k, HAS_BIAS=bias is not None, PDL=pdl,
        NORM=norm_weight is not None, GATED=up is not None, RESIDUAL=residual is not None, GATE=gate is not None,
        **cfg, **launch_options(pdl))
    return y.view(*x.shape[:-1], n)
