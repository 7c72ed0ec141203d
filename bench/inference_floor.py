"""How far each way of running an unmodified HF Llama decode step is from the memory-bandwidth floor.

    python bench/inference_floor.py [--batches 1,8,32] [--rounds 3] [--iters 30] [--autotune]
                                    [--serving] [--smoke] [--breakdown] [--kv-heads 4] [--context 2048]
                                    [--models llama-1b,llama3-8b,qwen2-1.5b,...]

Models and caches as bench/hf_decode.py (`--models`: its MODELS, common served shapes from 0.5B to 8B
built from configs with random weights; default the bench shape llama-1b, 16 layers, hidden 2048, MLP
5632), bf16, a StaticCache per batch holding context - 1 tokens; one decode step per call. With several
models, a summary table last: every model and batch, each column's x floor and x ro, and whether each
column's latency is monotone in batch (a smaller batch never slower than a larger one). Floor = the bytes a step must read
(every weight but the embedding table, and the whole static KV cache, which SDPA reads masked) /
device-to-device copy bandwidth measured here (read + write bytes).

Step table, per batch: GPU ms per step (CUDA events, steps back to back, median of the interleaved
rounds), x floor, x ro (median of the per-round ratios to reduce-overhead), kernels and GEMM kernels per
step (torch.profiler, kernels inside CUDA graphs included). Columns:
  eager       the model as written
  ro          torch.compile(mode="reduce-overhead"), as transformers recommends
  ro-freeze   the same, compiled with Inductor's freezing on (weights folded as constants: assumes they
              never change). Torch 2.11 then skips its CUDA graphs ("mutated inputs": the frozen
              graph no longer knows the KV caches are static), so it runs without graphs.
  autotune    torch.compile(mode="max-autotune"), batch 1 only (--autotune: minutes of compile)
  ext         torch_ext.compile(model, CompileConfig(cudagraph_mode="full", guard_free_dispatch=True),
              dynamic=False): torch_ext's inference recipe, its other defaults (merged projections, decode
              attention, decode linear: the projections' GEMVs in torch_ext's kernel) on
  ext-cublas  ext with decode_linear=False: the projections through cuBLAS (Inductor's choice)
  ext-plain   the same with merge_projections=False, decode_attention=False, decode_linear=False
              (torch_ext before issue 25)
  ext-pdl     ext with Inductor's triton.enable_pdl (programmatic dependent launch: a Triton kernel
              may start while the one before it drains; Hopper+), where this torch has the option
              (ext turns it on by itself in pieces that run decode_linear)
  ext-nopdl   ext with triton.enable_pdl=False: decode_linear without Inductor's dependent launch
  ext-combo   ext with Inductor's combo_kernels on (ext turns them on in decode pieces, torch 2.11+)
  ext-nocombo ext with combo_kernels off
  ext-nofuse  ext with decode_linear_fusion=False (norms, gates and residual adds as Inductor's kernels)
  ext-nocg    ext with cudagraph_mode="none": every kernel launched from the CPU, the decode ops off
              (their default without CUDA graphs); ext-nocg-nofuse likewise
  ext-nocg-forced  ext-nocg with decode_attention=True, decode_linear=True (what the default avoids);
              ext-nocg-forced-nofuse the same without the fusion
  ext-uncaptured  ext compiled with a dynamic batch and capture size 1 only: batches above 1 run the compiled
              code without graphs, the decode ops there on their reference (kernels/launch_policy.py);
              ext-uncaptured-forced the same with the ops set to True (their kernels launched from Python)
  inductor    torch.compile(model.forward) with Inductor's defaults (no CUDA graphs)
  ext-rows1   ext with decode_linear at one row only (cuBLAS and Inductor's norms from two rows up: the
              default before the op's CUDA path for 2-8 rows);
  ext-rows8   ext with decode_linear's CUDA path up to 8 rows (cuBLAS above: the default before 2026-11-27)
  ext-noxpf   ext with the CUDA path's launch config of before 2026-11-27 (x loaded just before its mma;
              16 warps x 2 chunks or 8 x 1 by block count)
  ext-unordered  ext with the CUDA path's launch config of before its ordered pipeline (x mode 2, 2026-11-27:
              x loaded a round ahead at every row count)
  ext-no-xsmem  ext with x in registers, a round ahead, where the one-wave projections at 17-32 rows now
              stage it through shared memory (x mode 3, 2026-11-27 session 5)
  ext-prologue8  ext with the norms and gates folded into decode_linear up to 8 rows (the default: one row)
  ext-prologue0  ext with no norm or gate folded into decode_linear (at one row too)
  ext-notune  ext with kernel_tuning=False: decode_linear's and decode_attention's hand-tuned built-in
              configs, at every shape
  ext-attn-table  ext with decode attention's built-in launch table (decode_linear still tuned)
  ext-norm8   ext with the norms alone folded in up to 8 rows (the gate left to Inductor)
  ext-late-launch  ext with Inductor's kernels triggering their dependents after their last load (Inductor's
              own placement; ext moves it to right after their first wait)
  ext-gate    ext with decode_linear's gate epilogue at every row count where kernels are not tuned
              (silu(gate) * up written by the merged gate/up projection instead of an Inductor kernel; untuned
              by default at 9-32 rows; tuned, wherever the tuner times it faster)
  ext-nogate  ext with the gate epilogue at no row count
  ext-tri1    ext with the one-row Triton GEMV timed at its default launch config only (before 2026-12-04:
              no other features-a-program counts among the tuner's candidates)
  ext-notri   ext with no Triton GEMV among the tuner's candidates at one row (the CUDA path or cuBLAS there,
              as from two rows up)
  ext-row-n8-p1024-k512-w4 (any numbers): the one-row path's features a program, weight columns loaded
              before the wait, columns a tile, warps (default 4 / up to 2048 / 512 / 4)
  ext-attn1   ext with decode attention in one split (no combine launch; each program walks a whole row)
  ext-mha-per-head  ext with MHA decode attention on its per-head kernel at every batch (before 8a2d1cc)
  ext-lt      ext with the GEMMs it captures picked by cuBLASLt (torch.backends.cuda.preferred_blas_library);
              ext-cublas-lt the same for ext-cublas
  ext-autotune ext with Inductor's max_autotune (GEMM templates that take pointwise neighbours), batch 1
               only (--autotune: minutes of compile)

--breakdown: per batch, the kernels of a ro and an ext step by time (inside graphs too).

--serving: one dynamic-batch compile serving batches 1..32 (capture sizes 1, 2, 4, 8, 16, 32), one
StaticCache per batch as generate makes: static input bytes, memory the graphs hold, ms per step at
batch 1 and 32, for ro and ext (cudagraph_mode="full").
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_decode as H  # noqa: E402  (puts the repository on sys.path)
from harness import copy_bandwidth  # noqa: E402  (device-to-device, read + write bytes)
from dev.floor_columns import AT_LAUNCH, EXPERIMENTS, column_experiment  # noqa: E402
from harness import print_table  # noqa: E402

CAPTURE = (1, 2, 4, 8, 16, 32)
BATCH_1_ONLY = ("autotune", "ext-autotune")  # minutes of compile per batch


def floor_bytes(setup, b: int) -> int:
    model = setup.model
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    cache = setup.caches[b]
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return weights + kv


NO_DECODE_ATTENTION = False  # --no-decode-attention


def make(name: str, model, root: str, serving: bool = False):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, name, "inductor")
    # ext-uncaptured*: graphs of batch 1 only. Called at 1, then 8 (Dynamo recompiles with a dynamic batch:
    # step_table warms these columns up in ascending order), then 32, batches above 1 run without graphs.
    # (dynamic=True would make the cache length a symbol too, and nothing would be captured.)
    uncaptured = "uncaptured" in name
    dynamic = None if serving or uncaptured else False
    if name == "eager":
        return model
    if name == "ro":
        return torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=dynamic)
    if name == "ro-freeze":
        # reduce-overhead is options {"triton.cudagraphs": True}. Given as options with freezing, the backend
        # compares unequal to ro's: with mode= and a patched config, Dynamo reused ro's compiled code.
        return torch.compile(model.forward, options={"triton.cudagraphs": True, "freezing": True}, fullgraph=True,
                             dynamic=dynamic)
    if name == "inductor":
        return torch.compile(model.forward, fullgraph=True, dynamic=dynamic)
    if name == "autotune":
        return torch.compile(model.forward, mode="max-autotune", fullgraph=True, dynamic=dynamic)
    import torch_ext

    # ext-nocg*: no CUDA graphs, each kernel launched from the CPU (what fewer kernels save there).
    config = torch_ext.CompileConfig(cudagraph_mode="none" if "nocg" in name else "full",
                                     guard_free_dispatch=not serving, progress_bar=False,
                                     cache_dir=os.path.join(root, name, "torch_ext"),
                                     cudagraph_capture_sizes=(1,) if uncaptured else CAPTURE if serving else (),
                                     merge_projections=name != "ext-plain",
                                     decode_attention=False if name == "ext-plain" or NO_DECODE_ATTENTION
                                     else (True if "forced" in name else None),
                                     decode_linear=False if name in ("ext-plain", "ext-cublas", "ext-cublas-lt")
                                     else (True if "forced" in name else None),
                                     decode_linear_fusion="nofuse" not in name,
                                     kernel_tuning=name != "ext-notune",
                                     inductor_options={"ext-pdl": {"triton.enable_pdl": True},
                                                       "ext-nopdl": {"triton.enable_pdl": False},
                                                       "ext-combo": {"combo_kernels": True},
                                                       "ext-nocombo": {"combo_kernels": False},
                                                       "ext-autotune": {"max_autotune": True}}.get(name, {}))
    return torch_ext.compile(model, config, dynamic=dynamic)


def device_kernels(step, steps: int) -> list | None:
    """The CUDA kernels (inside graphs too) of `steps` calls of step, from torch.profiler; None on the CPU."""
    from torch.autograd import DeviceType

    if not torch.cuda.is_available():  # --smoke on the CPU
        return None
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                             torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def kernels_per_step(step, steps: int = 4) -> tuple[float, float]:
    kernels = device_kernels(step, steps)
    if kernels is None:
        return float("nan"), float("nan")
    names = [e.name for e in kernels if not e.name.startswith(("Memcpy", "Memset"))]
    # Inductor's pointwise kernels carry the names of the ops they fused (".._bmm_..."): not GEMMs.
    gemm = [n for n in names if n.startswith("decode_linear") or not n.startswith("triton_") and any(
        k in n.lower() for k in ("gemm", "gemv", "cutlass", "sm90_", "mm_", "matmul"))]
    return len(names) / steps, len(gemm) / steps


def kernel_breakdown(name: str, b: int, step, steps: int = 4, top: int = 40) -> None:
    """Where a step's GPU time goes: kernel time by kernel name (inside graphs too); the step's time
    minus the total is spent between kernels."""
    kernels = device_kernels(step, steps)
    if kernels is None:
        return
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        per_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in per_name.values()) / steps
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    print(f"\n{name}, batch {b}: {len(kernels) / steps:.0f} kernels, {total:.0f} us of kernel time per step")
    print_table(["kernel", "per step", "us per step", "us each"],
                [[n[:90], f"{len(v) / steps:.0f}", f"{sum(v) / steps:.1f}", f"{sum(v) / len(v):.2f}"]
                 for n, v in rows[:top]])
    # One layer in the middle of the last step, in launch order: under PDL a kernel starts before the
    # one before it ends (a negative gap) and its time includes its wait.
    last = sorted(kernels, key=lambda e: e.time_range.start)[-len(kernels) // steps:]
    middle = len(last) // 2
    layer = last[middle:middle + 14]
    print_table(["kernel (a middle layer, launch order)", "start - previous end, us", "us"],
                [[e.name[:70], f"{e.time_range.start - p.time_range.end:.1f}", f"{e.time_range.elapsed_us():.1f}"]
                 for p, e in zip(last[middle - 1:], layer)])


def step_table(args, setup, bandwidth: float) -> list[list]:
    root = tempfile.mkdtemp(prefix="torch_ext_floor_")
    columns = [c for c in ["eager", "ro", "ro-freeze", "ext", "ext-cublas", "ext-nopdl", "ext-plain", "ext-pdl",
                              "ext-combo", "ext-nocombo", "ext-nofuse", "ext-nocg", "ext-nocg-nofuse",
                              "ext-nocg-forced", "ext-nocg-forced-nofuse", "ext-uncaptured", "ext-uncaptured-forced",
                              "inductor", *EXPERIMENTS]
               if c in args.columns]
    columns += sorted(c for c in args.columns if c.startswith("ext-row-"))
    columns += ["autotune", "ext-autotune"] if args.autotune else []
    fns = {}
    for name in columns:
        try:
            fns[name] = make(name, setup.model, root)
        except ValueError as e:  # an Inductor option this torch does not have (ext-pdl)
            print(f"column {name} skipped: {e}")
            continue
        batches = [1] if name in BATCH_1_ONLY else args.batches
        with column_experiment(name):
            for b in sorted(batches, reverse="uncaptured" not in name):
                for _ in range(3 if name.startswith(AT_LAUNCH) else 1):
                    setup.reset(b)
                    with torch.no_grad():
                        setup.step(fns[name], b)
                setup.reset(b)
    error_batch = min(args.batches)  # the logits check runs at the smallest batch timed
    errors = H.logits_errors(setup, {n: f for n, f in fns.items() if n != "eager"}, [error_batch])
    times = {}
    for _ in range(args.rounds):
        for b in args.batches:
            for name, fn in fns.items():
                if name in BATCH_1_ONLY and b != 1:
                    continue
                times.setdefault((name, b), []).append(H.time_steps(setup, fn, b, args.iters)[0])
    rows = []
    for b in args.batches:
        floor_ms = floor_bytes(setup, b) / bandwidth * 1e3
        for name, fn in fns.items():
            if (name, b) not in times:
                continue
            mine = times[(name, b)]
            ratio = statistics.median(t / r for t, r in zip(mine, times[("ro", b)]))

            def one():
                setup.step(fn, b)
                setup.reset(b)
            kernels, gemms = kernels_per_step(one)
            ms = statistics.median(mine)
            rows.append([b, name, f"{ms:.3f}", f"{ms / floor_ms:.2f}", f"{ratio:.2f}", f"{kernels:.0f}",
                         f"{gemms:.0f}", f"{errors.get(name, 0.0):.1e}" if b == error_batch else ""])
        rows.append([b, "floor", f"{floor_ms:.3f}", "1.00", "", "", "", ""])
    if args.breakdown:
        for b in args.batches:
            for name in [c for c in fns if c != "eager" and (c not in BATCH_1_ONLY or b == 1)]:
                def one(fn=fns[name], b=b):
                    setup.step(fn, b)
                    setup.reset(b)
                kernel_breakdown(name, b, one)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke: timings say nothing)"
    print(f"\nDecode step, {H.describe_model(setup.model.config)}, bf16, context {setup.context}, "
          f"{device}, torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"{args.rounds} interleaved rounds of {args.iters} steps")
    print_table(["batch", "column", "GPU ms", "x floor", "x ro", "kernels", "GEMMs", f"logits err b={error_batch}"], rows)
    return rows


def summary_table(results: dict[str, list[list]]) -> None:
    """Every model's rows in one table (x floor, x ro per column), and latency monotone in batch per column."""
    columns = list(dict.fromkeys(r[1] for rows in results.values() for r in rows if r[1] != "floor"))
    table, monotone = [], {c: [] for c in columns}
    for model, rows in results.items():
        by = {(r[0], r[1]): r for r in rows}
        batches = sorted({r[0] for r in rows})
        for b in batches:
            table.append([model, b, by[(b, "floor")][2]] + [
                f"{by[(b, c)][3]} / {by[(b, c)][4]}" if (b, c) in by else "" for c in columns])
        for c in columns:
            ms = [float(by[(b, c)][2]) for b in batches if (b, c) in by]
            if any(a > later for a, later in zip(ms, ms[1:])):
                monotone[c].append(model)
    print("\nAll models: x floor / x ro per column")
    print_table(["model", "batch", "floor ms"] + columns, table)
    for c in columns:
        print(f"{c}: latency monotone in batch on {'every model' if not monotone[c] else 'all but ' + ', '.join(monotone[c])}")


def serving_table(args, setup) -> None:
    """One compile, every batch size with a cache of its own (generate's pattern)."""
    from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats

    memory = torch.cuda.memory_allocated if torch.cuda.is_available() else (lambda: 0)
    root = tempfile.mkdtemp(prefix="torch_ext_serving_")
    rows = []
    for name in ("ro", "ext"):
        torch._dynamo.reset()
        cudagraph_stats.reset()
        H.sync(setup.device)
        before = memory()
        fn = make(name, setup.model, root, serving=True)
        for b in sorted(CAPTURE, reverse=True):
            for _ in range(3):
                setup.reset(b)
                with torch.no_grad():
                    setup.step(fn, b)
            setup.reset(b)
        H.sync(setup.device)
        held = memory() - before
        before = dataclasses.replace(cudagraph_stats)
        ms = {b: H.time_steps(setup, fn, b, args.iters)[0] for b in (1, 32)}
        static = cudagraph_stats.static_input_bytes if name == "ext" else 0
        timed = "-" if name != "ext" else "/".join(
            str(getattr(cudagraph_stats, k) - getattr(before, k)) for k in ("replays", "uncaptured_runs", "recaptures"))
        rows.append([name, f"{static / 2**20:.0f}", f"{held / 2**20:.0f}", f"{ms[1]:.3f}", f"{ms[32]:.3f}", timed])
        del fn
    print(f"\nServing batches {CAPTURE} from one dynamic compile, a StaticCache per batch (setup as above)")
    print_table(["column", "static input MiB", "memory held MiB", "ms b=1", "ms b=32",
                 "timed steps: replays/uncaptured/recaptures"], rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--autotune", action="store_true")
    parser.add_argument("--serving", action="store_true", help="also the multi-batch serving table")
    parser.add_argument("--serving-only", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU (checks the script)")
    parser.add_argument("--no-decode-attention", action="store_true", help="ext without torch_ext's decode kernel")
    parser.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention: 16 heads share these")
    parser.add_argument("--context", type=int, default=None, help="cache length (default 256)")
    parser.add_argument("--models", default="llama-1b", help="any of " + ",".join(H.MODELS))
    parser.add_argument("--columns", default="eager,ro,ro-freeze,ext,ext-plain",
                        help="any of eager,ro,ro-freeze,ext,ext-cublas,ext-nopdl,ext-plain,ext-pdl,ext-combo,ext-nocombo,ext-nofuse,ext-nocg,ext-nocg-nofuse,ext-rows1; ro is always run (x ro); --autotune adds "
                             "autotune and ext-autotune")
    parser.add_argument("--decode-linear-rows", type=int, default=None,
                        help="let torch_ext's decode_linear take up to this many rows (default: its MAX_ROWS)")
    parser.add_argument("--breakdown", action="store_true", help="kernel time by kernel, every compiled column")
    parser.add_argument("--log", action="store_true", help="torch_ext's INFO log (what runs without graphs, and why)")
    args = parser.parse_args()
    global NO_DECODE_ATTENTION
    NO_DECODE_ATTENTION = args.no_decode_attention
    if args.decode_linear_rows is not None:  # an experiment: the op's limit, read at compile and at run time
        import torch_ext.kernels.decode_linear as decode_linear

        decode_linear.MAX_ROWS = args.decode_linear_rows
    if args.log:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("torch_ext").setLevel(logging.INFO)
    if not args.smoke and not torch.cuda.is_available():
        print("bench/inference_floor.py needs a CUDA GPU (or --smoke for a CPU check of the script).")
        return 0
    args.batches = [int(b) for b in args.batches.split(",")]
    args.columns = set(args.columns.split(",")) | {"ro"}
    if args.smoke:
        args.batches, args.rounds, args.iters = [1, 2], 1, 2
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = dynamo.accumulated_recompile_limit = 64
    batches = sorted(set(args.batches) | (set(CAPTURE) if args.serving or args.serving_only else set()))
    bandwidth = copy_bandwidth() if not args.smoke else 1e10
    results = {}
    for model in args.models.split(","):
        setup = H.Setup(argparse.Namespace(batches=batches, smoke=args.smoke, kv_heads=args.kv_heads,
                                           context=args.context, model=model))
        if not args.serving_only:
            results[model] = step_table(args, setup, bandwidth)
        if args.serving or args.serving_only:
            serving_table(args, setup)
        del setup
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if len(results) > 1:
        summary_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
