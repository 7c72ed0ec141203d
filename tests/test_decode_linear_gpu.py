"""torch_ext::decode_linear's kernel on a GPU against a float64 reference, with and without
programmatic dependent launch (inside CUDA graphs too), and HF Llama decode with it (run through the
device tool); skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import hf_models as hf
from torch_ext.backend import counters
from torch_ext.kernels.decode_linear import decode_linear_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _error(out, x, w, b) -> float:
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("rows,k,n,bias", [(1, 2048, 6144, False), (1, 5632, 2048, True), (2, 4096, 11008, False),
                                           (3, 320, 77, True), (8, 2048, 2048, False), (5, 64, 1, True),
                                           (9, 256, 64, False)])
def test_op_equals_a_float64_reference(pdl, dtype, tol, rows, k, n, bias):
    """The op on CUDA at any row count: the Triton kernel (one row), the CUDA path (2-8 rows of 16-bit
    floats), F.linear (the rest)."""
    g = torch.Generator(device="cuda").manual_seed(rows * k + n)
    x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    out = torch.ops.torch_ext.decode_linear(x, w, b, pdl)
    assert out.shape == (rows, n) and not out.isnan().any()
    assert _error(out, x, w, b) < tol


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("parts", [("norm",), ("up",), ("residual",), ("norm", "up", "residual")])
def test_fused_parts_equal_the_eager_formulation(pdl, dtype, parts):
    """The norm / gate / residual add run inside the kernel: eager's prologue (its roundings), then the
    projection in float64, rounded, plus the residual; bfloat16 here (the interpreter rounds it wrong)."""
    from torch_ext.kernels.decode_linear import prologue_reference

    k, n = 2048, 5632
    g = torch.Generator(device="cuda").manual_seed(len(parts))
    x = torch.randn(1, 1, k, device="cuda", dtype=dtype, generator=g) * 3
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    args = dict(norm_weight=torch.rand(k, device="cuda", dtype=dtype, generator=g) + 0.5 if "norm" in parts else None,
                eps=1e-6, up=torch.randn(1, 1, k, device="cuda", dtype=dtype, generator=g) if "up" in parts else None,
                residual=torch.randn(1, 1, n, device="cuda", dtype=dtype, generator=g) if "residual" in parts else None)
    out = decode_linear_triton(x, w, None, pdl, **args)
    xp = prologue_reference(x, args["norm_weight"], args["eps"], args["up"])
    expected = torch.nn.functional.linear(xp.double(), w.double()).to(dtype)
    if args["residual"] is not None:
        expected = expected + args["residual"]
    err = ((out.double() - expected.double()).norm() / expected.double().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def assert_dependent_launch_chain_reads_each_input_complete(linear, rows: int) -> None:
    """Six linears (`linear(h, w)`) that load their weights before the kernel before them finishes,
    reading the previous one's output directly or through a pointwise kernel, captured and replayed on
    fresh inputs of `rows` rows: a read of an input before it is written would show as a moving error."""
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16, generator=g) / 2048 ** 0.5
               for _ in range(6)]
    x = torch.empty(rows, 2048, device="cuda", dtype=torch.bfloat16)

    def chain(linear=linear, h=x):
        for i, w in enumerate(weights):  # every other linear reads the one before it directly
            h = linear(torch.tanh(h) * 2 if i % 2 == 0 else h, w)
        return h

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(20):
        x.copy_(torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        ref = chain(lambda h, w: torch.nn.functional.linear(h, w.double()), x.double())
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2


def test_a_chain_with_dependent_launch_in_a_cuda_graph_reads_each_input_complete():
    assert_dependent_launch_chain_reads_each_input_complete(
        lambda h, w: torch.ops.torch_ext.decode_linear(h, w, None, True), rows=1)


@pytest.mark.parametrize("mode,forced", [("none", True), ("none", None), ("full", None)])
def test_hf_llama_decode_with_the_kernel_matches_eager_and_follows_weight_updates(mode, forced):
    """Without CUDA graphs the op runs only when asked for (decode_linear=True)."""
    counters.reset()
    # One row: the projections the op takes; every weight scaled in place before step 3.
    model = hf.cuda_decode_matches_eager(mode, batch=1, update_weights_at=3, decode_linear=forced)
    if mode == "none" and forced is None:
        assert counters.decode_linear_calls == 0
        return
    # Every projection of every decode graph: merged q/k/v and gate/up, o, down, and lm_head.
    assert counters.decode_linear_calls == (4 * model.config.num_hidden_layers + 1) * counters.graphs_seen


@pytest.mark.parametrize("rows,n,k,dtype,bias", [(1, 6144, 2048, torch.bfloat16, False), (8, 2048, 5632, torch.bfloat16, False),
                                                 (1, 2304, 1536, torch.float16, True), (32, 17920, 1536, torch.bfloat16, False),
                                                 (1, 512, 320, torch.float32, False)])
def test_tuning_times_every_candidate_and_each_computes_linear(tmp_path, rows, n, k, dtype, bias):
    """On this GPU every candidate of a shape is timed (cuBLAS first), each one's result equals a float64
    reference, and the winner, written into the op's config, computes the same; a second tuner reads
    the choice back from the file."""
    from torch_ext.kernels import decode_linear_tuning as tuning

    shape, device = tuning.Shape(rows, n, k, dtype, bias), torch.device("cuda")
    choices = tuning.candidates(shape, device)
    assert choices[0].path == "cublas" and (len(choices) > 1) == (k % 64 == 0)
    times = tuning.measure_cuda(shape, choices, device)
    assert set(times) == set(choices) and all(t > 0 for t in times.values())
    tuning.Tuner._memo.clear()
    choice = tuning.Tuner(str(tmp_path)).choose(shape, device)
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    for c in choices:
        out = torch.ops.torch_ext.decode_linear(x, w, b, True, config=c.encode())
        assert _error(out, x, w, b) < (1e-2 if dtype != torch.float32 else 1e-5), c
    tuning.Tuner._memo.clear()
    assert tuning.Tuner(str(tmp_path), measure=lambda *a: {}).choose(shape, device) == choice
    print(f"tuned {shape.key()}: {choice} ({', '.join(f'{c.path}{list(c.config)} {t:.1f} us' for c, t in times.items())})")


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm,bias", [(False, False), (True, True)])
def test_the_one_row_gate_epilogue_equals_the_eager_formulation(pdl, dtype, norm, bias):
    """silu(gate) * up of the projection's two halves inside the one-row kernel: the projection in float64,
    rounded, then eager's gate (bfloat16 here; the interpreter rounds it wrong)."""
    from torch_ext.kernels.decode_linear import prologue_reference

    k, width = 896, 4864  # Qwen2 0.5B's gate/up
    g = torch.Generator(device="cuda").manual_seed(int(norm))
    x = torch.randn(1, 1, k, device="cuda", dtype=dtype, generator=g) * 3
    w = torch.randn(2 * width, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(2 * width, device="cuda", dtype=dtype, generator=g) if bias else None
    nw = torch.rand(k, device="cuda", dtype=dtype, generator=g) + 0.5 if norm else None
    out = decode_linear_triton(x, w, b, pdl, norm_weight=nw, eps=1e-6, gate=[0, width, width])
    y = torch.nn.functional.linear(prologue_reference(x, nw, 1e-6).double(), w.double(),
                                   b.double() if bias else None).to(dtype)
    expected = torch.nn.functional.silu(y[..., :width]) * y[..., width:]
    err = ((out.double() - expected.double()).norm() / expected.double().norm()).item()
    assert out.shape == expected.shape and err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("part", ["norm", "gate", "gate_epilogue"])
def test_a_folded_prologue_is_timed_against_a_kernel_of_its_own(part):
    """Both sides of the fold decision run on this GPU and take time; the folded call computes eager's result."""
    from torch_ext.kernels import decode_linear_tuning as tuning
    from torch_ext.kernels.decode_linear import decode_linear_reference

    n, k = {"norm": (1536, 1536), "gate": (1536, 8960), "gate_epilogue": (2 * 4864, 896)}[part]
    shape, device = tuning.Shape(1, n, k, torch.bfloat16, False), torch.device("cuda")
    offered = tuning.candidates(shape, device)
    for choice in [next(c for c in offered if c.path == path) for path in ("triton", "mma")] + \
            [c for c in offered if c.path == "triton"][1:]:  # each path's default, then the GEMV's other configs
        folded, separate = tuning.measure_fold_cuda(shape, part, choice, device)
        assert folded > 0 and separate > 0
        x = torch.randn(1, shape.k, device="cuda", dtype=shape.dtype)
        w = torch.randn(shape.n, shape.k, device="cuda", dtype=shape.dtype) / shape.k ** 0.5
        extra = {"norm": lambda: dict(norm_weight=torch.rand(shape.k, device="cuda", dtype=shape.dtype) + 0.5, eps=1e-6),
                 "gate": lambda: dict(up=torch.randn_like(x)),
                 "gate_epilogue": lambda: dict(gate=[0, n // 2, n // 2])}[part]()
        out = torch.ops.torch_ext.decode_linear(x, w, None, True, **extra, config=choice.encode())
        ref = decode_linear_reference(x.double(), w.double(), None, **{k: v.double() if torch.is_tensor(v) else v
                                                                       for k, v in extra.items()})
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2, choice
        print(f"{part} {shape.key()} {choice}: folded {folded:.1f} us, separate {separate:.1f} us")
