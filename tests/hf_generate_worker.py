"""A separate process for the warm-start tests of Hugging Face generate: a tiny decoder (random
weights, nothing downloaded) whose forward is torch_ext-compiled with a cache dir, then
`generate(..., cache_implementation="static")`, greedy. Prints JSON on the last line: the tokens,
eager generate's tokens, the counters, Dynamo's frame count and the seconds from the compile call to
the end of generate.

    python tests/hf_generate_worker.py CACHE_DIR [--arch llama] [--dtype float32] [--layers 2]
                                       [--rope-theta T] [--plain] [--fx-pieces] [--guard-free] [--generates N]
                                       [--batch 2] [--prompt 6] [--steps 6]

--plain: torch.compile(model.forward) instead (Inductor's caches under CACHE_DIR/inductor).
--fx-pieces: pieces run as FX graphs (no Inductor: fast; they are not cached on disk).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import torch_ext  # noqa: E402
from torch_ext.backend import CompileConfig, counters  # noqa: E402

VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             max_position_embeddings=64)
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=2)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(num_key_value_heads=2)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, {}),
}


def build(arch: str, layers: int, dtype: torch.dtype, rope_theta: float | None = None) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    config = config_cls(num_hidden_layers=layers, attn_implementation="sdpa", pad_token_id=0, **SMALL, **extra)
    if rope_theta is not None:  # a config value no module keeps as a plain attribute
        config.rope_parameters["rope_theta"] = rope_theta
    return model_cls(config).to(dtype).eval()


def generate(model, ids, steps):
    return model.generate(ids, max_new_tokens=steps, do_sample=False, cache_implementation="static",
                          pad_token_id=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache_dir")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rope-theta", type=float, default=None)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--fx-pieces", action="store_true")
    parser.add_argument("--guard-free", action="store_true", help="CompileConfig.guard_free_dispatch")
    parser.add_argument("--generates", type=int, default=1, help="calls of generate (each makes a new cache)")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache_dir, "inductor")
    if args.fx_pieces:
        from torch_ext.backend.compile.compiler import InductorCompiler

        InductorCompiler.compile = lambda self, gm, example_inputs, variant, name="": gm

    model = build(args.arch, args.layers, getattr(torch, args.dtype), args.rope_theta)
    ids = torch.randint(1, VOCAB, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    expected = generate(model, ids, args.steps)

    start = time.perf_counter()
    if args.plain:
        model.forward = torch.compile(model.forward)
    else:
        config = CompileConfig(cache_dir=args.cache_dir, splitting_ops=["aten::scaled_dot_product_attention"],
                               progress_bar=False, guard_free_dispatch=args.guard_free)
        model.forward = torch_ext.compile(model.forward, config)
    tokens = generate(model, ids, args.steps)
    seconds = time.perf_counter() - start
    for _ in range(args.generates - 1):
        assert torch.equal(generate(model, ids, args.steps), tokens)
    frames = dict(torch._dynamo.utils.counters["frames"])
    print(json.dumps({"tokens": tokens.tolist(), "expected": expected.tolist(), "seconds": seconds,
                      "dynamo_frames": frames,
                      "counters": {k: v for k, v in vars(counters).items() if isinstance(v, int)}}))


if __name__ == "__main__":
    sys.exit(main())
