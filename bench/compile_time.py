"""Compile time of the torch_ext backend beside plain torch.compile (Inductor), on CPU.

    python bench/compile_time.py                 # layers 2, 8, 32; cold and warm; table on stdout
    python bench/compile_time.py --layers 2 8    # fewer
    python bench/compile_time.py --hop-modes     # nested_compile_region layers: inline vs in_body
    python bench/compile_time.py --layers 32 --llama 2   # also a tiny transformers Llama (2 layers)
    python bench/compile_time.py --training --layers 32  # Llama: training step (joint vs per piece), inference

Every number comes from its own process. "1st call" is the wall time of the first call (Dynamo
trace + backend + first run) of a decoder with a dynamic batch; "backend" is the time inside the
backend alone (torch_ext: split + compile or load; inductor: compile_fx), with Inductor's modules
imported beforehand in every case. Run time (--hop-modes) is CPU time on one thread, best of 10
rounds, so that other load on the machine matters less. "cold": empty Inductor cache
(TORCHINDUCTOR_CACHE_DIR) and empty torch_ext cache; "warm": a new process on the caches the
cold run left. "warm start s": the first call of `torch_ext.compile` in a new process that finds
its warm-start entry (the traced program saved by the cold run: no Dynamo trace;
docs/guide/warm-start.md). Goals: torch_ext's 32-layer cold compile within 1.3x of its 2-layer one, warm at least 5x
faster than cold, warm start at most 1.0 s at 32 layers and at most 0.3x plain Inductor's warm call.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # backend_models: the decoder and its op

from harness import print_table  # noqa: E402

D_MODEL = 64
BATCH = 8


def child(args) -> None:
    """One measurement in this process; prints JSON."""
    import torch
    import torch._inductor.compile_fx  # noqa: F401  (imported before timing, for every backend alike)

    import backend_models as bm
    from torch_ext.backend import CompileConfig, counters, make_backend

    llama = args.model == "llama"
    model = _llama(args.layers[0]) if llama else bm.Decoder(layers=args.layers[0], d=D_MODEL, nested=args.nested,
                                                            mlp=True)
    inductor_seconds = []
    if args.mode == "inductor":
        from torch._inductor.compile_fx import compile_fx

        def timed_inductor(gm, example_inputs):  # Inductor's own backend, timed like ours
            start = time.perf_counter()
            try:
                return compile_fx(gm, example_inputs)
            finally:
                inductor_seconds.append(time.perf_counter() - start)

        compiled = torch.compile(model, backend=timed_inductor)
    else:
        op = "aten::scaled_dot_product_attention" if llama else "torch_ext_test::attention"
        cfg = CompileConfig(splitting_ops=[op], cache_dir=args.cache_dir, dedup=(args.mode != "torch_ext-nodedup"),
                            hop_split=args.hop_split, progress_bar=False,
                            differentiate_once=(args.mode != "torch_ext-perpiece"))
        if args.mode == "torch_ext-warm":  # torch_ext.compile: warm start on (a cache_dir is set)
            import torch_ext

            compiled = torch_ext.compile(model, cfg)
        else:
            compiled = torch.compile(model, backend=make_backend(cfg))
    if args.grad:  # a training step's first call: forward with labels and backward
        model.train()
        ids = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        compile_s = time.perf_counter() - start
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        error = max((g - p.grad).abs().max().item() for g, p in zip(got, model.parameters()))
        backend_s = sum(inductor_seconds) if args.mode == "inductor" else counters.backend_seconds
        print(json.dumps({"compile_s": compile_s, "backend_s": backend_s, "run_ms": None, "max_error": error,
                          "counters": counters.snapshot()}))
        return
    if llama:
        ids = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(0))
        torch._dynamo.mark_dynamic(ids, 0)
        x, caches = ids, None
        run = lambda fn, x, caches: fn(input_ids=x, use_cache=False).logits  # noqa: E731
        fresh = lambda: None  # noqa: E731
    else:
        caches = model.caches(rows=BATCH * 4)
        x = bm.batch(BATCH, D_MODEL, dynamic=True, seed=0)
        run = lambda fn, x, caches: fn(x, caches)  # noqa: E731
        fresh = lambda: model.caches(rows=BATCH * 4)  # noqa: E731
    with torch.no_grad():
        start = time.perf_counter()
        out = run(compiled, x, caches)
        compile_s = time.perf_counter() - start
        error = (out - run(model, x, fresh())).abs().max().item()
        run_ms = None
        if args.iters:  # one thread, CPU time, best of 10 rounds: steady on a shared machine
            torch.set_num_threads(1)
            for _ in range(3):
                run(compiled, x, caches)
            run_ms = float("inf")
            for _ in range(10):
                start = time.process_time()
                for _ in range(args.iters // 10):
                    run(compiled, x, caches)
                run_ms = min(run_ms, (time.process_time() - start) / (args.iters // 10) * 1e3)
    backend_s = sum(inductor_seconds) if args.mode == "inductor" else counters.backend_seconds
    print(json.dumps({"compile_s": compile_s, "backend_s": backend_s, "run_ms": run_ms, "max_error": error,
                      "counters": counters.snapshot()}))


def _llama(layers: int):
    """A tiny transformers Llama (its attention is F.scaled_dot_product_attention: the splitting op)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=D_MODEL, intermediate_size=2 * D_MODEL,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def measure(mode, layers, inductor_dir, cache_dir, *, nested=False, hop_split="inline", iters=0,
            model="decoder", grad=False) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--layers", str(layers),
           "--cache-dir", cache_dir, "--hop-split", hop_split, "--iters", str(iters), "--model", model]
    if nested:
        cmd.append("--nested")
    if grad:
        cmd.append("--grad")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} layers={layers} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["max_error"] > 1e-4:
        raise RuntimeError(f"{mode} layers={layers}: output differs from eager by {result['max_error']}")
    return result


def cold_and_warm(root, mode, layers, *, warm=True, **kw) -> tuple[dict, dict | None]:
    tag = f"{kw.get('model', 'decoder')}-{mode}-{layers}-{kw.get('hop_split', 'inline')}-{kw.get('grad', False)}"
    inductor_dir, cache_dir = os.path.join(root, tag, "inductor"), os.path.join(root, tag, "torch_ext")
    os.makedirs(inductor_dir)
    cold = measure(mode, layers, inductor_dir, cache_dir, **kw)
    warm_result = measure(mode, layers, inductor_dir, cache_dir, **kw) if warm else None
    shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
    return cold, warm_result


def compile_table(root, layer_counts, llama_layers=None) -> None:
    modes = ["torch_ext", "torch_ext-nodedup", "inductor"]
    rows, cold_by, warm_by = [], {}, {}
    cold_and_warm(root, "torch_ext", min(layer_counts), warm=False)  # untimed: fills the OS file cache
    cases = [("decoder", n) for n in layer_counts] + ([("llama", llama_layers)] if llama_layers else [])
    for model, layers in cases:
        _, warm_start = cold_and_warm(root, "torch_ext-warm", layers, model=model)
        assert warm_start["counters"]["warm_start_loads"] == 1, warm_start["counters"]
        for mode in modes if model == "decoder" else ["torch_ext", "inductor"]:
            cold, warm = cold_and_warm(root, mode, layers, model=model)
            cold_by[(mode, layers)] = (cold["compile_s"], cold["backend_s"])
            warm_by[(model, mode, layers)] = warm["compile_s"]
            c = cold["counters"]
            ext = mode != "inductor"
            pieces = f"{c['pieces']}/{c['unique_pieces']}" if ext else "-"
            rows.append((f"{layers}" if model == "decoder" else f"llama {layers}", mode,
                         f"{cold['compile_s']:.1f}", f"{warm['compile_s']:.1f}",
                         f"{warm_start['compile_s']:.2f}" if mode == "torch_ext" else "-",
                         f"{cold['backend_s']:.1f}", f"{warm['backend_s']:.1f}", pieces,
                         str(c["inductor_compiles"]) if ext else "-", str(warm["counters"]["cache_hits"]) if ext else "-"))
            if mode == "torch_ext":
                warm_by[(model, "warm start", layers)] = warm_start["compile_s"]
            print(f"  done: {model} {mode} {layers} layers", file=sys.stderr, flush=True)
    header = ("layers", "backend", "1st call cold s", "warm s", "warm start s", "backend cold s", "warm s",
              "pieces/unique", "compiles", "warm hits")
    print_table(header, rows)
    small, big = min(layer_counts), max(layer_counts)
    if small != big:
        for mode in modes:
            (big_call, big_backend), (small_call, small_backend) = cold_by[(mode, big)], cold_by[(mode, small)]
            print(f"{mode}: {big}-layer cold / {small}-layer cold = {big_call / small_call:.2f}x first call, "
                  f"{big_backend / small_backend:.2f}x backend")
    for model, layers in cases:
        ws, ind = warm_by[(model, "warm start", layers)], warm_by[(model, "inductor", layers)]
        print(f"{model} {layers} layers: warm start {ws:.2f} s = {ws / ind:.2f}x plain Inductor's warm first call "
              f"({ind:.1f} s), {ws / warm_by[(model, 'torch_ext', layers)]:.2f}x torch_ext's without warm start")


def training_table(root, layer_counts) -> None:
    """Cold first calls of the Llama: a training step (joint, per piece, Inductor) and an inference call."""
    rows = []
    cases = [(True, "torch_ext"), (True, "torch_ext-perpiece"), (True, "inductor"), (False, "torch_ext"),
             (False, "inductor")]
    for layers in layer_counts:
        for grad, mode in cases:
            cold, _ = cold_and_warm(root, mode, layers, warm=False, model="llama", grad=grad)
            c = cold["counters"]
            rows.append((str(layers), "training" if grad else "inference", mode, f"{cold['compile_s']:.1f}",
                         f"{cold['backend_s']:.1f}", f"{c['pieces']}/{c['unique_pieces']}" if mode != "inductor" else "-",
                         str(c["inductor_compiles"]) if mode != "inductor" else "-"))
            print(f"  done: {layers} layers {rows[-1][1]} {mode}: {rows[-1][3]} s", file=sys.stderr, flush=True)
    print_table(("layers", "graph", "backend", "1st call cold s", "backend cold s", "pieces/unique", "compiles"), rows)


def hop_table(root, layer_counts) -> None:
    rows = []
    for layers in layer_counts:
        for hop_split in ("inline", "in_body"):
            cold, _ = cold_and_warm(root, "torch_ext", layers, warm=False, nested=True, hop_split=hop_split,
                                    iters=200)
            c = cold["counters"]
            rows.append((str(layers), hop_split, f"{cold['compile_s']:.1f}", f"{cold['backend_s']:.1f}",
                         f"{cold['run_ms']:.2f}", f"{c['pieces']}/{c['unique_pieces']}", str(c["inductor_compiles"])))
            print(f"  done: {hop_split} {layers} layers", file=sys.stderr, flush=True)
    print_table(("layers", "hop_split", "1st call cold s", "backend cold s", "run ms/iter", "pieces/unique",
                 "compiles"), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--hop-modes", action="store_true", help="compare hop_split inline vs in_body")
    parser.add_argument("--llama", type=int, default=None, metavar="LAYERS",
                        help="also a tiny transformers LlamaForCausalLM with this many layers")
    parser.add_argument("--training", action="store_true",
                        help="Llama cold compiles: training step (joint vs per piece vs Inductor) and inference")
    parser.add_argument("--model", default="decoder", help=argparse.SUPPRESS)
    parser.add_argument("--grad", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="torch_ext", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hop-split", default="inline", help=argparse.SUPPRESS)
    parser.add_argument("--nested", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, decoder d={D_MODEL} batch={BATCH} (dynamic)")
    root = tempfile.mkdtemp(prefix="torch_ext_bench_")
    try:
        if args.hop_modes:
            hop_table(root, args.layers)
        elif args.training:
            training_table(root, args.layers)
        else:
            compile_table(root, args.layers, args.llama)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
