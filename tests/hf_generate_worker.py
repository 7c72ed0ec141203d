"""A separate process for the warm-start tests of Hugging Face generate: a tiny decoder (random
weights, nothing downloaded) whose forward is torch_ext-compiled with a cache dir, then
`generate(..., cache_implementation="static")`, greedy. Prints JSON on the last line: the tokens,
eager generate's tokens, the counters, Dynamo's frame count and the seconds from the compile call to
the end of generate.

    python tests/hf_generate_worker.py CACHE_DIR [--arch llama] [--dtype float32] [--layers 2]
                                       [--rope-theta T] [--plain] [--fx-pieces] [--guard-free] [--background] [--generates N]
                                       [--batch 2] [--prompt 6] [--steps 6] [--decode-ops]
                                       [--cudagraph full] [--device cuda] [--describe] [--kernels]

--plain: torch.compile(model.forward) instead (Inductor's caches under CACHE_DIR/inductor).
--fx-pieces: pieces run as FX graphs (no Inductor: fast; they are not cached on disk).
--decode-ops: torch_ext's decode rewrites on, also on the CPU (their ops run the reference there), and
  the Inductor options of decode pieces as on a Hopper GPU. --describe: the JSON holds
  torch_ext.backend.describe(). --kernels: it holds the CUDA kernels (name -> [launches, us]) of one more
  generate, from torch.profiler, and the median gap between its tokens in ms.
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
    model = model_cls(config).to(dtype).eval()
    model.generation_config.disable_compile = True  # on a GPU, generate would compile the eager model itself
    return model


def generate(model, ids, steps, streamer=None):
    return model.generate(ids, max_new_tokens=steps, do_sample=False, cache_implementation="static",
                          pad_token_id=0, streamer=streamer)


class Gaps:
    """A generate streamer that keeps the time of each token (the first put is the prompt)."""

    def __init__(self, device):
        self.device, self.times = device, []

    def put(self, value):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def median_ms(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.times[1:], self.times[2:]))
        return gaps[len(gaps) // 2] * 1e3 if gaps else 0.0


def decode_ops_on_cpu() -> None:
    """The decode rewrites on CPU tensors too (tests do the same with monkeypatch), and the decode
    pieces' Inductor options as a Hopper GPU would have them."""
    from torch_ext.backend.compile import decode_options
    from torch_ext.backend.rewrite import decode_linear

    decode_linear.DEVICES = ("cpu", "cuda")
    decode_options._has_cuda = lambda: True
    decode_options._gpu_has_pdl = lambda: True


def kernels_of(run) -> dict[str, list]:
    """CUDA kernels launched while `run()` runs (graph replays included): name -> [launches, total us]."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count, us = out.get(event.name, (0, 0.0))
            out[event.name] = [count + 1, us + event.time_range.elapsed_us()]
    return dict(sorted(out.items()))


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
    parser.add_argument("--background", action="store_true", help="CompileConfig.background_compile")
    parser.add_argument("--generates", type=int, default=1, help="calls of generate (each makes a new cache)")
    parser.add_argument("--decode-ops", action="store_true")
    parser.add_argument("--cudagraph", default="none")
    parser.add_argument("--split", default="sdpa", choices=("sdpa", "none"), help="splitting ops: SDPA or none")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--describe", action="store_true")
    parser.add_argument("--kernels", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.decode_ops:
        decode_ops_on_cpu()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache_dir, "inductor")
    if args.fx_pieces:
        from torch_ext.backend.compile.compiler import InductorCompiler

        InductorCompiler.compile = lambda self, gm, example_inputs, variant, name="": gm

    model = build(args.arch, args.layers, getattr(torch, args.dtype), args.rope_theta).to(device)
    ids = torch.randint(1, VOCAB, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    expected = generate(model, ids, args.steps)

    start = time.perf_counter()
    if args.plain:
        model.forward = torch.compile(model.forward)
    else:
        splitting = ["aten::scaled_dot_product_attention"] if args.split == "sdpa" else []
        config = CompileConfig(cache_dir=args.cache_dir, splitting_ops=splitting,
                               progress_bar=False, guard_free_dispatch=args.guard_free, cudagraph_mode=args.cudagraph,
                               background_compile=args.background,
                               **(dict(decode_linear=True, decode_attention=True) if args.decode_ops and args.cudagraph == "none" else {}))
        model.forward = torch_ext.compile(model.forward, config)
    tokens = generate(model, ids, args.steps)
    seconds = time.perf_counter() - start
    torch_ext.wait_compiled()  # --background: the programs of the first generate's eager calls
    for _ in range(args.generates - 1):
        assert torch.equal(generate(model, ids, args.steps), tokens)
    extra = {}
    if args.kernels:  # one more generate, profiled: what runs once every graph is captured
        gaps = Gaps(device)
        extra["kernels"] = kernels_of(lambda: generate(model, ids, args.steps, gaps))
        extra["median_token_ms"] = gaps.median_ms()
    if args.describe:
        from torch_ext.backend import describe
        from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats

        extra["describe"] = describe(model.forward)
        extra["cudagraph_stats"] = {k: v for k, v in vars(cudagraph_stats).items() if isinstance(v, (int, float))}
    frames = dict(torch._dynamo.utils.counters["frames"])
    print(json.dumps({"tokens": tokens.tolist(), "expected": expected.tolist(), "seconds": seconds,
                      "dynamo_frames": frames, **extra,
                      "counters": {k: v for k, v in vars(counters).items() if isinstance(v, int)}}))


if __name__ == "__main__":
    sys.exit(main())
