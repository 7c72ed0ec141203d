"""Regions in models -> the piecewise backend, the pipeline torch_ext exists for, on every supported
torch: an 8-layer decoder whose layers are nested_compile_regions around an in-place attention op,
`dynamic=True`, batch sizes inside and outside compile_sizes, CUDA-graph modes (which fall back on a
machine without CUDA). No explicit install(): the backend installs torch_ext itself.

Two torch behaviours this pins: torch's own invoke_subgraph reuse path (stamp-out) passes the wrong
argument for a Python float read inside a region (LayerNorm's eps under dynamic=True), and a float
Dynamo leaves symbolic cannot be compiled per size; the backend specializes such floats.
"""
import pytest
import torch

import torch_ext
from backend_models import Decoder, batch


def _run(model, compiled, n):
    x = batch(n, seed=n)
    expected_caches, caches = model.caches(), model.caches()
    expected = model(x, expected_caches)
    actual = compiled(x, caches)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches, expected_caches, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compile_sizes,cudagraph_mode", [((), "none"), ((1, 8), "none"), ((1, 8), "piecewise")])
def test_region_decoder_dynamic_matches_eager(compile_sizes, cudagraph_mode):
    model = Decoder(layers=8, nested=True)
    config = torch_ext.CompileConfig(splitting_ops=["torch_ext_test::attention"], compile_sizes=compile_sizes,
                                     cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=compile_sizes,
                                     cache_dir=None)
    compiled = torch.compile(model, backend=torch_ext.backend(config), dynamic=True)
    assert torch_ext.is_installed()
    with torch.no_grad():
        for n in (8, 1, 3, 17, 8):  # in and out of compile_sizes, a size seen before
            _run(model, compiled, n)


def test_python_float_inputs_are_specialized_and_guarded():
    """The float becomes a constant of the compiled code, with a guard: a new value recompiles."""
    model = Decoder(layers=2, nested=True)
    config = torch_ext.CompileConfig(splitting_ops=["torch_ext_test::attention"], compile_sizes=(4,), cache_dir=None)
    compiled = torch.compile(model, backend=torch_ext.backend(config), dynamic=True)
    with torch.no_grad():
        _run(model, compiled, 4)
        model.layers[1].norm1.eps = 0.5
        _run(model, compiled, 4)
