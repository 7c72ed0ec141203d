"""Hugging Face transformers models served through the torch_ext backend, split at
aten::scaled_dot_product_attention (which matches the F.scaled_dot_product_attention call of
transformers' "sdpa" attention):

  * StaticCache decode through torch_ext.compile (guard-free dispatch) over several steps: logits
    and KV caches equal eager's at every step, and the greedy tokens equal eager `generate`'s;
    also under simulated CUDA graphs (full and piecewise).
  * the split itself: one split per decoder layer, logits equal eager, dynamic batch and sequence.

Pieces run as their FX graphs (the split does not depend on Inductor, and the CPU is slow) except
for Llama's decode, compiled by Inductor.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import cudagraph_models as cm
import hf_models as hf
import torch_ext
from torch_ext.backend import CompileConfig, counters, make_backend
from torch_ext.backend.dispatch.dispatcher import GuardFreeDispatcher

SDPA = "aten::scaled_dot_product_attention"
ATOL = RTOL = 1e-5
PROMPT, STEPS, MAX_CACHE_LEN = 6, 4, 16


@pytest.fixture
def fx_pieces(monkeypatch):
    from torch_ext.backend.compile.compiler import InductorCompiler

    monkeypatch.setattr(InductorCompiler, "compile", lambda self, gm, example_inputs, variant, name="": gm)


def prefill(model, ids):
    """An eager prefill into a fresh StaticCache; returns the cache and the greedy next token."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    return cache, logits[:, -1:].argmax(-1)


def decode_matches_eager(model, step, batch: int = 2) -> None:
    """Decode STEPS tokens with `step` (a compiled model) and eagerly, each on its own StaticCache
    prefilled eagerly: logits must agree at every step, caches at the end, and the greedy tokens
    must be the ones eager `generate` picks."""
    ids = hf.token_ids(batch, PROMPT)
    eager_cache, token = prefill(model, ids)
    cache, _ = prefill(model, ids)
    tokens = [token]
    with torch.no_grad():
        for i in range(STEPS):
            expected = model(input_ids=token, past_key_values=eager_cache, use_cache=True).logits
            actual = step(input_ids=token, past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {i}: {m}")
            token = expected[:, -1:].argmax(-1)
            tokens.append(token)
    for i, (a, e) in enumerate(zip(cache.layers, eager_cache.layers)):
        assert int(a.cumulative_length) == int(e.cumulative_length) == PROMPT + STEPS
        torch.testing.assert_close((a.keys, a.values), (e.keys, e.values), atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"KV cache of layer {i}: {m}")
    generated = model.generate(ids, max_new_tokens=STEPS + 1, do_sample=False, pad_token_id=0,
                               past_key_values=transformers.StaticCache(config=model.config,
                                                                        max_cache_len=MAX_CACHE_LEN),
                               disable_compile=True)  # transformers would compile a static cache's decode itself
    assert torch.equal(generated[:, PROMPT:], torch.cat(tokens, dim=1))


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "qwen2", "gpt2"])
def test_static_cache_decode_through_torch_ext_matches_eager_and_generate(request, arch):
    if arch != "llama":
        request.getfixturevalue("fx_pieces")
    model = hf.build(arch).eval()
    config = CompileConfig(splitting_ops=[SDPA], cache_dir=None, guard_free_dispatch=True)
    compiled = torch_ext.compile(model, config, dynamic=False)  # as docs/guide/huggingface.md recommends for a StaticCache
    decode_matches_eager(model, compiled)
    # The write position is a tensor (StaticCache's cumulative_length): one graph serves every step,
    # and after the first, steps run Dynamo's code without its guards.
    assert (counters.graphs_seen, counters.splitting_op_calls, compiled.calls) == (1, hf.LAYERS, 1)
    if arch == "llama":
        assert counters.inductor_compiles == counters.unique_pieces == hf.LAYERS + 1


@pytest.mark.filterwarnings("ignore::torch_ext.backend.dispatch.dispatcher.GuardFreeDispatchWarning")  # a new batch size
@pytest.mark.parametrize("mode,split", [("full", False), ("full", True), ("piecewise", True)],
                         ids=["full", "full_split", "piecewise"])
def test_static_cache_decode_under_simulated_cuda_graphs(fx_pieces, mode, split):
    """The StaticCache tensors written in place (keys, values, cumulative_length) are read where
    they are by the captured graphs; replays produce eager's logits and caches. Two batch sizes,
    each with its own cache, through one compiled model: one graph each (dynamic=False)."""
    cm.cudagraph_stats.reset()
    model = hf.build("llama").eval()
    config = CompileConfig(splitting_ops=[SDPA] if split else [], cache_dir=None, guard_free_dispatch=True,
                           cudagraph_mode=mode)
    backend = make_backend(config)
    backend.cudagraphs = cm.SimulatedCudaGraphs(config)
    compiled = GuardFreeDispatcher(model, backend, dynamic=False)
    for batch in (2, 3):
        decode_matches_eager(model, compiled, batch)
    assert (counters.graphs_seen, compiled.calls, len(compiled.signatures)) == (2, 2, 2)
    # Per batch size: one warm-up step, one capturing step, then replays.
    assert cm.cudagraph_stats.captures >= 2 and cm.cudagraph_stats.replays >= 2 * (STEPS - 2)


@pytest.mark.parametrize("arch", list(hf.ARCHS))
def test_split_at_sdpa_once_per_layer_with_dynamic_batch_and_sequence(fx_pieces, caplog, arch):
    model = hf.build(arch).eval()
    config = CompileConfig(splitting_ops=[SDPA], cache_dir=None)
    compiled = torch.compile(model, backend=torch_ext.backend(config), dynamic=True, fullgraph=True)
    with torch.no_grad(), caplog.at_level("WARNING", logger="torch_ext.backend"):
        for batch, seq in ((2, 5), (3, 7), (4, 2)):
            ids = hf.token_ids(batch, seq)
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits,
                                       model(input_ids=ids, use_cache=False).logits, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"batch {batch}, sequence {seq}: {m}")
    assert not [r for r in caplog.records if "matches no call" in r.getMessage()]
    assert counters.graphs_seen == 1  # dynamic in batch and sequence: no recompile
    assert (counters.splitting_op_calls, counters.pieces) == (hf.LAYERS, hf.LAYERS + 1)


def test_compiling_a_model_with_generate_says_to_compile_its_forward(fx_pieces):
    """generate() calls model.forward itself, never the compiled wrapper: generate on torch_ext.compile(model)
    says so (once), naming the fix; compiling the forward serves generate, with eager's tokens."""
    from torch_ext.backend.dispatch.entry import GenerateCallsForwardWarning

    model = hf.build("llama").eval()
    ids = hf.token_ids(1, PROMPT)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    counters.reset()
    for config in (CompileConfig(cache_dir=None), CompileConfig(cache_dir=None, guard_free_dispatch=True)):
        wrapped = torch_ext.compile(model, config)
        with torch.no_grad(), pytest.warns(GenerateCallsForwardWarning,
                                           match=r"model.forward = torch_ext.compile\(model.forward"):
            assert torch.equal(wrapped.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0), expected)
    assert counters.graphs_seen == 0  # nothing compiled: what the warning says
    original = model.forward
    model.forward = torch_ext.compile(model.forward, CompileConfig(cache_dir=None, splitting_ops=(SDPA,)))
    try:
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    finally:
        model.forward = original
    assert counters.graphs_seen >= 1 and torch.equal(generated, expected)


@pytest.mark.slow
@pytest.mark.parametrize("guard_free", [False, True])
def test_generates_own_compile_stays_off_around_a_torch_ext_forward(fx_pieces, tmp_path, guard_free):
    """generate compiles model.__call__ itself for a static cache on a GPU (forced here on the CPU with
    the compile_config's `_compile_all_devices`): around a torch_ext forward it is turned off, and a
    compile_config the user set is said to be unused; an outer torch.compile that still wraps the
    forward calls it as is (no trace into torch_ext's wrapper) and gets eager's tokens."""
    model = hf.build("llama").eval()
    ids = hf.token_ids(2, PROMPT)
    generate = lambda m: m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,  # noqa: E731
                                    cache_implementation="static")
    expected = generate(model)
    compile_config = transformers.CompileConfig(fullgraph=False)
    compile_config._compile_all_devices = True
    model.generation_config.compile_config = compile_config
    config = CompileConfig(cache_dir=str(tmp_path), splitting_ops=(SDPA,), guard_free_dispatch=guard_free,
                           progress_bar=False)
    with pytest.warns(UserWarning, match="compile_config is not used"):
        model.forward = torch_ext.compile(model.forward, config)
    assert model.generation_config.disable_compile
    assert torch.equal(generate(model), expected)
    assert "_compiled_call" not in vars(model)  # generate never compiled __call__ (get_compiled_call sets it)

    outer = torch.compile(model, backend="eager")  # a torch.compile around the module: calls the forward as is
    with torch.no_grad():
        torch.testing.assert_close(outer(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
