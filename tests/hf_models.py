"""Tiny Hugging Face transformers models for the integration tests, and the ways users put torch_ext's
HOPs around their decoder layers.

Models are built from configs with random weights (seeded): nothing is downloaded, and the hub is
switched offline before transformers is imported. Sizes are tiny (2 layers, hidden 64, vocab 128) so
that Dynamo and Inductor stay fast on a CPU.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import dataclasses  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, MAX_POSITIONS = 128, 64, 2, 4, 2, 64


def _llama_family(config_cls, model_cls, **extra):
    config = config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                        max_position_embeddings=MAX_POSITIONS, attn_implementation="sdpa", **extra)
    return model_cls(config)


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                     n_positions=MAX_POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config)
    # GPT2LMHeadModel leaves loss_type unset, so `loss_function` calls logger.warning_once inside the
    # forward, which Dynamo refuses under fullgraph=True (with or without torch_ext). Name the loss.
    model.loss_type = "ForCausalLM"
    return model


def _phi3():
    # A fused qkv projection sliced into q/k/v, and partial rotary (here: all of head_dim, so the
    # pass-through part of q is empty): what made Inductor return a layout other than its fake's.
    return _llama_family(transformers.Phi3Config, transformers.Phi3ForCausalLM, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1)


ARCHS = {
    "llama": lambda: _llama_family(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": lambda: _llama_family(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "gpt2": _gpt2,  # another family: learned positions, LayerNorm, GELU, fused qkv Conv1D
}


MORE_ARCHS = {"phi3": _phi3}  # built on demand by single tests, not by every arch-parametrized one


def build(arch: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {**ARCHS, **MORE_ARCHS}[arch]()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def token_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --- regions around decoder layers ---------------------------------------------------------------

def regions_on_layers(model: nn.Module) -> nn.Module:
    """Make every decoder layer's forward a nested_compile_region (one region function per layer
    class, so Dynamo can trace it once and reuse it for every layer). Returns the model."""
    regions: dict[type, types.FunctionType] = {}
    for layer in decoder_layers(model):
        cls = type(layer)
        region = regions.setdefault(cls, torch.compiler.nested_compile_region(cls.forward))
        layer.forward = types.MethodType(region, layer)  # this instance only: the class stays as it was
    return model


@dataclasses.dataclass
class LayerOutput:
    hidden_states: torch.Tensor
    update: torch.Tensor  # what the layer added to its input
    layer_index: int


class _LayerBody(nn.Module):
    def __init__(self, layer: nn.Module, index: int):
        super().__init__()
        self.layer, self.index = layer, index

    @torch.compiler.nested_compile_region
    def forward(self, hidden_states, *args, **kwargs) -> LayerOutput:
        out = self.layer(hidden_states, *args, **kwargs)
        return LayerOutput(hidden_states=out, update=out - hidden_states, layer_index=self.index)


class DataclassRegionLayer(nn.Module):
    """A decoder layer inside a region that returns a dataclass; the model sees the layer's output."""

    def __init__(self, layer: nn.Module, index: int):
        super().__init__()
        self.body = _LayerBody(layer, index)

    def forward(self, hidden_states, *args, **kwargs):
        out = self.body(hidden_states, *args, **kwargs)
        return hidden_states + out.update if out.layer_index % 2 else out.hidden_states


def dataclass_regions_on_layers(model: nn.Module) -> nn.Module:
    layers = decoder_layers(model)
    for i, layer in enumerate(list(layers)):
        layers[i] = DataclassRegionLayer(layer, i)
    return model


def hop_calls(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the higher-order ops the top level of a Dynamo graph calls, in order."""
    return [n.target.__name__ for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)]


# --- decode on a GPU against eager ----------------------------------------------------------------

def cuda_decode_matches_eager(mode: str, batch: int, steps: int = 5, update_weights_at: int | None = None,
                              dtype: torch.dtype = torch.float32, tol: float = 1e-4, **config_fields):
    """A tiny Llama on CUDA in `dtype` and torch_ext.compile of it (cudagraph_mode=mode, guard-free
    dispatch, config_fields), decoded against eager by decode_steps_match. Returns the model."""
    import torch_ext
    from torch_ext.backend import CompileConfig

    torch._dynamo.reset()
    model = build("llama").to(device="cuda", dtype=dtype).eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, guard_free_dispatch=True, cudagraph_mode=mode,
                                                      progress_bar=False, **config_fields), dynamic=False)
    decode_steps_match(model, compiled, batch, steps, update_weights_at, tol)
    return model


def decode_steps_match(model: nn.Module, compiled, batch: int, steps: int = 5,
                       update_weights_at: int | None = None, tol: float = 1e-4) -> None:
    """Prefill eagerly into two StaticCaches on the model's device, then decode `steps` tokens with the
    model and with `compiled`; logits must agree at every step (atol = rtol = tol). At step
    `update_weights_at` every weight is scaled in place first (an optimizer-style update the compiled
    model must read)."""
    import transformers

    ids = token_ids(batch, 6).to(next(model.parameters()).device)
    caches = [transformers.StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = ids[:, -1:]
        for step in range(steps):
            if step == update_weights_at:
                for p in model.parameters():
                    p.mul_(0.9)
            expected = model(input_ids=token, past_key_values=caches[0], use_cache=True).logits
            actual = compiled(input_ids=token, past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"step {step}: {m}")
            token = expected[:, -1:].argmax(-1)
