"""Serving a Hugging Face model with `generate`: how long a process takes to be ready, cold (empty
caches) and warm (a second process on the same cache dirs), torch_ext beside torch.compile.

    python bench/hf_generate.py [--new-tokens 64] [--prompt 128] [--batch 1] [--columns eager,hf-auto,ext,ro]
    python bench/hf_generate.py --smoke      # tiny model on the CPU: every path end to end

Model: LlamaForCausalLM, 16 layers, hidden 2048, MLP 5632, 16 heads, vocab 32000, bf16, random
weights, "sdpa" attention; greedy `generate(..., cache_implementation="static")`.

Columns (each phase of each column is a process of its own, with its own cache dirs):
  eager    no compile (the tokens every column is compared with)
  hf-auto  transformers' own route: on a GPU with a static cache generate compiles `model.__call__`
           with torch.compile(mode="reduce-overhead") itself
  ro       model.forward = torch.compile(model.forward, mode="reduce-overhead"): on the H100 (torch 2.11)
           generate fails in CUDA graph trees ("accessing tensor output of CUDAGraphs that has been
           overwritten by a subsequent run"), so it is not a default column
  ext      model.forward = torch_ext.compile(model.forward, CompileConfig(cache_dir=..., cudagraph_mode="full",
           guard_free_dispatch=True)): warm start loads the prefill and decode programs
  ext-split  the same, split at aten::scaled_dot_product_attention: one Inductor compile per distinct
           layer instead of the whole model (the whole step still one CUDA graph)
Per process: "imports" (start to torch, transformers and torch_ext imported), "first generate" (from
the compile call, or the model's first use, to the end of the first generate: compile + one
generate), "process" (start to that same point: what a server waits for), then the steady state:
ms per new token of a later generate. Ratios are to hf-auto in the same phase.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

COLUMNS = ("eager", "hf-auto", "ext", "ext-split")  # and "ro" on request (--columns): it fails under generate on 2.11


def child(args) -> None:
    started = float(os.environ["HF_GENERATE_SPAWNED"])
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache, "inductor")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    import torch_ext
    from torch_ext.backend import counters
    imports = time.time() - started

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
            if args.smoke else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                    num_attention_heads=16, vocab_size=32000))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**size, num_key_value_heads=size["num_attention_heads"],
                                      max_position_embeddings=4096, attn_implementation="sdpa", pad_token_id=0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(1, size["vocab_size"], (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(1)).to(device)

    def generate():
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                             cache_implementation="static", min_new_tokens=args.new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    if args.profile:  # where the first generate's time goes (bench/hf_generate.py --profile), on stderr
        import cProfile
        import logging
        import pstats

        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s %(message)s")
        logging.getLogger("torch").setLevel(logging.WARNING)
        profiler = cProfile.Profile()
        profiler.enable()
    start = time.time()
    column = args.child
    if column == "eager":
        model.generation_config.disable_compile = True
    elif column == "hf-auto" and device == "cpu":  # generate compiles on GPUs only, unless told
        model.generation_config.compile_config = transformers.CompileConfig()
        model.generation_config.compile_config._compile_all_devices = True
    elif column == "ro":
        model.generation_config.disable_compile = True
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
    elif column in ("ext", "ext-split"):
        model.forward = torch_ext.compile(model.forward, torch_ext.CompileConfig(
            cache_dir=os.path.join(args.cache, "torch_ext"), progress_bar=False, guard_free_dispatch=True,
            cudagraph_mode="full" if device == "cuda" else "none",
            splitting_ops=("aten::scaled_dot_product_attention",) if column == "ext-split" else ()))
    tokens = generate()
    first = time.time() - start
    process = time.time() - started
    if args.profile:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
    generate()  # CUDA graphs are captured in the calls after the first
    t = time.perf_counter()
    generate()
    per_token = (time.perf_counter() - t) / args.new_tokens * 1e3
    print(json.dumps({"imports": imports, "first": first, "process": process, "ms_per_token": per_token,
                      "tokens": tokens[:, args.prompt:].tolist(), "device": torch.cuda.get_device_name() if
                      device == "cuda" else "cpu", "torch": torch.__version__,
                      "loads": counters.warm_start_loads, "saves": counters.warm_start_saves,
                      "frames": int(torch._dynamo.utils.counters["frames"].get("total", 0))}))


def run(column: str, cache: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", column, "--cache", cache, "--batch", str(args.batch),
           "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens)] + (["--smoke"] if args.smoke else []) \
        + (["--profile"] if args.profile else [])
    env = dict(os.environ, HF_GENERATE_SPAWNED=repr(time.time()))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode != 0:
        print(f"{column}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
        return {}
    if args.profile:
        lines = [line for line in done.stderr.splitlines() if " ms torch_ext" in line or "(" in line]
        print(f"--- {column}\n" + "\n".join(lines[-90:]), file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def matching(tokens, expected) -> str:
    if not tokens or not expected:
        return "-"
    same = sum(a == b for row, ref in zip(tokens, expected) for a, b in zip(row, ref))
    return f"{same}/{sum(len(r) for r in expected)}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", default=None)
    parser.add_argument("--cache", default=None)
    parser.add_argument("--columns", default=",".join(COLUMNS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile each process's first generate (stderr)")
    args = parser.parse_args()
    if args.smoke:
        args.prompt, args.new_tokens = min(args.prompt, 8), min(args.new_tokens, 8)
    if args.child:
        child(args)
        return 0
    columns = args.columns.split(",")
    results = {}
    with tempfile.TemporaryDirectory(prefix="hf_generate_") as root:
        for column in columns:
            cache = os.path.join(root, column)
            phases = ("cold",) if column == "eager" else ("cold", "warm")
            for phase in phases:
                results[column, phase] = run(column, cache, args)
    info = next((r for r in results.values() if r), {})
    print(f"\nHF generate, LlamaForCausalLM{' (smoke)' if args.smoke else ' 16x2048 bf16'}, batch {args.batch}, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens; {info.get('device')}, torch {info.get('torch')}")
    expected = results.get(("eager", "cold"), {}).get("tokens")
    print(f"{'column':<8} {'phase':<5} {'imports s':>9} {'first generate s':>16} {'x hf':>6} {'process s':>9} "
          f"{'x hf':>6} {'ms/token':>8} {'x hf':>6} {'loads':>5} {'frames':>6}  tokens = eager")
    for (column, phase), r in results.items():
        if not r:
            print(f"{column:<8} {phase:<5} failed")
            continue
        base = results.get(("hf-auto", phase), {})
        ratio = lambda key: f"{r[key] / base[key]:.2f}" if base.get(key) else "-"  # noqa: E731
        print(f"{column:<8} {phase:<5} {r['imports']:>9.2f} {r['first']:>16.2f} {ratio('first'):>6} "
              f"{r['process']:>9.2f} {ratio('process'):>6} {r['ms_per_token']:>8.2f} {ratio('ms_per_token'):>6} "
              f"{r['loads']:>5} {r['frames']:>6}  {matching(r['tokens'], expected)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
