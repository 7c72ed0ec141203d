"""Hugging Face transformers models trained through torch.compile with torch_ext installed: regions
(nested_compile_region) on decoder layers, a region returning a dataclass around each layer, and
transformers' own activation checkpointing, all under fullgraph=True. Loss, logits and every
parameter's gradient must equal eager's. Where torch alone fails, the test shows it beside torch_ext.

Llama, Qwen2 and GPT-2 (tests/hf_models.py: tiny configs, random weights, nothing downloaded);
aot_eager on every architecture, Inductor on Llama with regions (the CPU is slow).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import hf_models as hf
import torch_ext
from torch_ext import compat

ATOL = RTOL = 1e-5
ARCH_BACKENDS = [("llama", "aot_eager"), ("qwen2", "aot_eager"), ("gpt2", "aot_eager"),
                 pytest.param("llama", "inductor", marks=pytest.mark.slow)]


def train_step(model, ids, call=None):
    """One training step's results (of `call`, the model or its compiled form): loss, logits and
    the gradient of every parameter."""
    out = (model if call is None else call)(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), out.logits.detach(), grads


def compiled_training_matches_eager(model, backend: str, ids=None) -> list[torch.fx.GraphModule]:
    """Train one step eagerly and one step compiled (fullgraph) on a copy; assert loss, logits and
    every parameter gradient agree. Returns the graphs Dynamo captured."""
    model.train()
    model.zero_grad(set_to_none=True)  # the model may have trained before (a vanilla attempt)
    ids = hf.token_ids(2, 8) if ids is None else ids
    twin = copy.deepcopy(model)
    expected = train_step(model, ids)
    counter = CompileCounterWithBackend(backend)
    actual = train_step(twin, ids, torch.compile(twin, backend=counter, fullgraph=True))
    for what, a, e in zip(("loss", "logits"), actual, expected):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"[{backend}] {what}: {m}")
    assert actual[2].keys() == expected[2].keys()
    for name, grad in expected[2].items():
        assert grad is not None, name
        torch.testing.assert_close(actual[2][name], grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"[{backend}] gradient of {name}: {m}")
    assert counter.frame_count == 1
    return counter.graphs


@pytest.mark.parametrize("arch,backend", ARCH_BACKENDS)
def test_regions_on_decoder_layers_train_like_eager(installed, arch, backend):
    graphs = compiled_training_matches_eager(hf.regions_on_layers(hf.build(arch)), backend)
    assert hf.hop_calls(graphs[0]) == ["invoke_subgraph"] * hf.LAYERS  # one region call per layer


@pytest.mark.parametrize("arch", list(hf.ARCHS))
def test_region_returning_a_dataclass_around_each_layer(arch):
    model = hf.dataclass_regions_on_layers(hf.build(arch))
    if not compat.TORCH_HAS_WRAP_SEMANTICS:  # torch 2.9.1: a region body must return tensors
        with pytest.raises(Exception, match="UserDefinedObjectVariable"):
            compiled_training_matches_eager(model, "aot_eager")
        torch._dynamo.reset()
    with torch_ext.installed():
        graphs = compiled_training_matches_eager(model, "aot_eager")
    assert hf.hop_calls(graphs[0]) == ["invoke_subgraph"] * hf.LAYERS


def test_regions_train_under_the_eager_backend():
    """backend="eager" (Dynamo only, as in debugging): torch <= 2.13 fails a region's backward
    ("fake_mode should be enabled for HOPs"); with torch_ext installed it trains like eager."""
    model = hf.regions_on_layers(hf.build("llama"))
    if compat.EAGER_REGION_BACKWARD_NEEDS_FAKE_MODE:
        with pytest.raises(Exception, match="fake_mode should be enabled"):
            compiled_training_matches_eager(model, "eager")
        torch._dynamo.reset()
    with torch_ext.installed():
        compiled_training_matches_eager(model, "eager")


@pytest.mark.parametrize("arch,backend", [(arch, "aot_eager") for arch in hf.ARCHS])
def test_gradient_checkpointing_trains_like_eager_in_one_graph(installed, arch, backend):
    model = hf.build(arch)
    model.gradient_checkpointing_enable()  # transformers' default: checkpoint(..., use_reentrant=False)
    graphs = compiled_training_matches_eager(model, backend)
    assert hf.hop_calls(graphs[0]) == ["tag_activation_checkpoint"] * hf.LAYERS
