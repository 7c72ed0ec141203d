"""Our Triton kernels (decode_linear's, decode_attention's) through Triton's front end for a CUDA target, on the CPU: the step that checks
types (a loop-carried variable must keep its shape) and constexpr use, which the interpreter tests skip.
A kernel that passed the interpreter once failed here on the GPU ("Loop-carried variable x has initial
type <[2048], fp32> but is re-assigned to <[512], fp32>"). Uses Triton's compiler internals
(ASTSource.make_ir, the same on Triton 3.5, 3.6 and 3.9)."""
from __future__ import annotations

import itertools

import pytest

triton = pytest.importorskip("triton")


def _ttir(kernel, signature: dict, constexprs: dict) -> str:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    options = backend.parse_options({})
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                            context)
    return str(module)


@pytest.mark.parametrize("k,block_k,pre_k", [(2048, 512, 2048), (5632, 512, 4096), (320, 64, 256), (64, 64, 64)])
def test_decode_linear_kernel_builds_for_every_fused_part(k, block_k, pre_k):
    from torch_ext.kernels.decode_linear_kernels import decode_linear_kernel

    pointers = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "g_ptr", "up_ptr", "res_ptr")
    ints = {"eps": "fp32", "N": "i32", "gate_start": "i32", "up_start": "i32"}
    signature = {name: "*bf16" if name in pointers else ints.get(name, "constexpr")
                 for name in decode_linear_kernel.arg_names}
    for has_bias, pdl, norm, gated, residual, gate in itertools.product((False, True), repeat=6):
        constexprs = dict(K=k, HAS_BIAS=has_bias, BLOCK_N=4 // (1 + gate), BLOCK_K=block_k, PRE_K=pre_k, PDL=pdl,
                          NORM=norm, GATED=gated, RESIDUAL=residual, GATE=gate)
        assert "tt.func" in _ttir(decode_linear_kernel, signature, constexprs)


def test_a_loop_carried_shape_change_is_what_this_catches():
    """The check itself: the front end refuses a kernel whose loop reassigns a variable to a new shape."""
    import triton.language as tl

    @triton.jit
    def reshaping(out_ptr, A: tl.constexpr, B: tl.constexpr):
        x = tl.zeros([A], dtype=tl.float32)
        for _ in range(3):
            x = tl.zeros([B], dtype=tl.float32)
        tl.store(out_ptr + tl.arange(0, B), x)

    with pytest.raises(Exception, match="Loop-carried variable"):
        _ttir(reshaping, {"out_ptr": "*fp32", "A": "constexpr", "B": "constexpr"}, {"A": 16, "B": 8})


@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("direct", [False, True])
def test_decode_attention_kernels_build(mask, direct):
    from torch_ext.kernels.decode_attention_kernels import combine_kernel, grouped_kernel, partial_kernel

    pointers = {"q", "k", "v", "mask", "partial", "out"}
    for kernel, extra in ((partial_kernel, {}), (grouped_kernel, dict(BLOCK_G=16, IEEE=False))):
        signature = {}
        for name in kernel.arg_names:
            if name in pointers:
                signature[name] = {"mask": "*i1" if mask == "bool" else "*bf16", "partial": "*fp32"}.get(name, "*bf16")
            else:
                signature[name] = "fp32" if name == "scale_log2" else "constexpr" if name.isupper() else "i32"
        constexprs = dict(HAS_MASK=mask is not None, BOOL_MASK=mask == "bool", DIRECT=direct, BLOCK_N=64,
                          BLOCK_D=128, PDL=True, **extra)
        for name in ("H", "GROUPS", "L", "PER_SPLIT", "D", "SPLITS"):  # plain ints in the launch, not constexpr
            signature[name] = "i32"
        assert "tt.func" in _ttir(kernel, signature, constexprs)
    signature = {"partial": "*fp32", "out": "*bf16", "so_b": "i32", "so_h": "i32", "H": "i32", "D": "i32",
                 "SPLITS": "i32", "BLOCK_S": "constexpr", "BLOCK_D": "constexpr", "PDL": "constexpr"}
    assert "tt.func" in _ttir(combine_kernel, signature, dict(BLOCK_S=8, BLOCK_D=128, PDL=True))
