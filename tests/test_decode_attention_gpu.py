"""torch_ext::decode_attention's Triton kernels on a GPU against a float64 reference, and HF Llama decode
with them under full CUDA graphs (run through the device tool); skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import hf_models as hf
from torch_ext.backend import counters
from torch_ext.kernels.decode_attention import decode_attention_reference, decode_attention_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("b,h,hkv,length,d,mask", [(1, 16, 16, 256, 128, "bool"), (32, 16, 16, 256, 128, "bool"),
                                                   (8, 32, 8, 4096, 128, None), (3, 8, 2, 1000, 64, "float"),
                                                   (2, 4, 4, 77, 96, "heads"),
                                                   (20, 16, 4, 300, 64, "bool"),  # b*h >= 264: one split, no combine
                                                   (2, 8, 2, 77, 96, "heads"),  # grouped heads, a mask per head
                                                   (140, 8, 2, 40, 16, "bool")])  # grouped, b*hkv >= 264: direct
def test_kernels_equal_a_float64_reference(dtype, tol, b, h, hkv, length, d, mask):
    g = torch.Generator(device="cuda").manual_seed(b * length + d)
    q = torch.randn(b, h, 1, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, hkv, length + 3, d, device="cuda", dtype=dtype, generator=g)[:, :, :length]
    v = torch.randn(b, length, hkv, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    m = {None: None, "bool": torch.rand(b, 1, 1, length, device="cuda", generator=g) > 0.2,
         "float": torch.randn(b, 1, 1, length, device="cuda", dtype=dtype, generator=g),
         "heads": torch.rand(b, h, 1, length, device="cuda", generator=g) > 0.5}[mask]
    out = decode_attention_triton(q, k, v, m, d ** -0.5)
    m64 = m if m is None or m.dtype == torch.bool else m.double()
    ref = decode_attention_reference(q.double(), k.double(), v.double(), m64, d ** -0.5)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < tol, err


@pytest.mark.parametrize("mode,forced", [("none", True), ("none", None), ("full", None)])
def test_hf_llama_decode_with_the_kernel_matches_eager(mode, forced):
    """Without CUDA graphs the op runs only when asked for (decode_attention=True)."""
    counters.reset()
    model = hf.cuda_decode_matches_eager(mode, batch=2, decode_attention=forced)
    if mode == "none" and forced is None:
        assert counters.decode_attention_calls == 0
        return
    # Every decode graph's SDPA calls (the first token, a slice of the prompt, may get a graph of its own).
    assert counters.decode_attention_calls == model.config.num_hidden_layers * counters.graphs_seen


@pytest.mark.parametrize("b,h,hkv,length,d,mask", [(1, 32, 8, 2048, 128, "bool"), (8, 32, 32, 1024, 128, "float"),
                                                   (4, 8, 1, 300, 256, "none")])
def test_tuning_times_the_candidates_and_its_choice_computes_attention(tmp_path, b, h, hkv, length, d, mask):
    """Every candidate that can launch is timed (three-stage launches at head dim 256 are not offered;
    others may run out of shared memory there and are left out); the fastest is chosen, written, and
    read back by a new process without measuring; the op under the chosen config equals a float64 reference."""
    from torch_ext.kernels import decode_attention_tuning as tuning

    device = torch.device("cuda")
    shape = tuning.Shape(b, h, hkv, length, d, torch.bfloat16, mask, False)
    choices = tuning.candidates(shape, device)
    assert choices[:2] == [tuning.Choice("triton", tuple(op_launch(b, h, hkv, d))), tuning.Choice("sdpa")]
    times = tuning.measure_cuda(shape, choices, device)
    assert set(choices[:2]) <= set(times) and all(t > 0 for t in times.values())
    if d <= 128:
        assert set(times) == set(choices)
    tuning.Tuner._memo.clear()
    choice = tuning.Tuner(str(tmp_path)).choose(shape, device)
    assert choice in times
    tuning.Tuner._memo.clear()
    assert tuning.Tuner(str(tmp_path), measure=lambda *a: {}).choose(shape, device) == choice
    tuning.Tuner._memo.clear()
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    m = None if mask == "none" else torch.rand(b, 1, 1, length, device="cuda", generator=g) > 0.2
    if mask == "float":
        m = torch.zeros(m.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~m, float("-inf"))
    out = torch.ops.torch_ext.decode_attention(q, k, v, m, d ** -0.5, choice.encode())
    ref = decode_attention_reference(q.double(), k.double(), v.double(), m if m is None or m.dtype == torch.bool
                                     else m.double(), d ** -0.5)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def op_launch(b, h, hkv, d):
    from torch_ext.kernels.decode_attention import default_launch

    return default_launch(b, h, hkv, d).encode()
