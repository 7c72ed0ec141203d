"""Serving a Hugging Face model with `generate`: how long a process takes to be ready, cold (empty
caches) and warm (a second process on the same cache dirs), torch_ext beside torch.compile.

    python bench/hf_generate.py [--new-tokens 64] [--prompt 128] [--batch 1] [--columns eager,hf-auto,ext,ro]
    python bench/hf_generate.py --smoke      # tiny model on the CPU: every path end to end
    python bench/hf_generate.py --columns hf-auto,ext --warm-repeats 3   # warm processes vary: several
    python bench/hf_generate.py --columns ext-bg --profile-switch --warm-rtc  # the switch to a program, profiled;
                                 # and a warm process compiling our CUDA kernels again (as before they were kept)

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
  ext-bg   ext with background_compile=True: a call whose program is not ready runs the forward
           eagerly while the compile thread loads or compiles it (the first generate runs eagerly, cold
           or warm); "ready s" is when every program is (torch_ext.wait_compiled())
Per process, the phases to the first token (what a server waits for), each from the process's start
or its own: "torch+hf" (importing torch and
transformers), "imports" (with torch_ext for its columns; the others import it after their first generate), "model" (building it), "first token" (from
the first generate's call to its first new token: compile or load of the prefill program, the
prefill), "programs" (torch_ext: finding the programs, loaded or traced and compiled; "inductor": of
which Inductor compiles and artifact loads), "capture" (torch_ext's CUDA-graph captures, all of
them), "longest gap" (the longest wait between two tokens of the first generate: the decode
program's load or compile, warm-up and capture), "switch" (torch_ext: the slowest call that ran a program in
the first two generates, to the end of its GPU work: the first call of a program, which loads its kernels,
warms up and captures; for ext-bg it may come in the second generate), "to 1st token" (from the process's start, the compile call included), "first generate" and "process" (start to its end),
"ready" (from the first generate's call until every program is loaded or compiled: ext-bg keeps
compiling after its eager first generate), "eager-calls" (ext-bg's calls run eagerly meanwhile).
Then the steady state, a third generate: "ms/token" (its new tokens over its time, as before),
"median gap" (the median time between two tokens: the decode step as a server sees it, without the
graphs generate's new cache captures again), "max gap", and torch_ext's captures, re-captures and
uncaptured calls in it. Ratios are to hf-auto in the same phase.
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

COLUMNS = ("eager", "hf-auto", "ext", "ext-split", "ext-bg")  # and "ro" on request (--columns): it fails under generate on 2.11


def child(args) -> None:
    started = float(os.environ["HF_GENERATE_SPAWNED"])
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache, "inductor")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    imports_torch = time.time() - started
    if args.child.startswith("ext"):  # the others import torch_ext after their first generate: not in their times
        import torch_ext
    imports = time.time() - started
    model_start = time.time()

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
    model_s = time.time() - model_start

    class Times:  # a generate streamer: the time of each put (the prompt's first, then each new token)
        def __init__(self):
            self.at = []

        def put(self, value):
            self.at.append(time.perf_counter())  # generate puts tokens moved to the CPU: synchronized
            if len(self.at) == 2:
                self.first_token_wall = time.time()  # the first new token, on the clock the parent started

        def end(self):
            pass

        def gaps(self):
            return sorted(b - a for a, b in zip(self.at[1:], self.at[2:]))

    def generate(times=None):
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                             cache_implementation="static", min_new_tokens=args.new_tokens, streamer=times)
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
    elif column in ("ext", "ext-split", "ext-bg"):
        model.forward = torch_ext.compile(model.forward, torch_ext.CompileConfig(
            cache_dir=os.path.join(args.cache, "torch_ext"), progress_bar=False, guard_free_dispatch=True,
            background_compile=column == "ext-bg",
            cudagraph_mode="full" if device == "cuda" else "none",
            splitting_ops=("aten::scaled_dot_product_attention",) if column == "ext-split" else ()))
    # hf-auto compiles model.__call__: a wrapper on forward would be traced (and break its graph)
    slowest = watch_first_program_calls(model, args.profile_switch) if column.startswith("ext") else {}
    first_times = Times()
    sampler = StackSampler() if args.sample_gap else None
    t = time.perf_counter()
    tokens = generate(first_times)
    first = time.time() - start
    process = time.time() - started
    import torch_ext
    from torch_ext.backend import counters
    from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats
    if slowest:
        print_longest_gap(first_times.at, slowest["calls"], sampler)
    if args.profile:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
    torch_ext.wait_compiled()  # ext-bg: the programs compiled meanwhile (others: nothing to wait for)
    ready = time.time() - start
    eager_calls = counters.background_eager_calls
    generate()  # the graphs of a new cache are captured in the calls after the first
    if sampler:
        sampler.stop()
    if slowest:
        model.forward = slowest["forward"]
        print_slowest_program_calls(slowest["calls"], sampler)
    if slowest.get("profile"):
        import pstats

        print(f"slowest program call of the first two generates: {slowest['seconds'] * 1e3:.0f} ms (caller's "
              "thread)", file=sys.stderr)
        stats = pstats.Stats(slowest["profile"], stream=sys.stderr)
        stats.sort_stats("cumulative").print_stats(90)
        stats.sort_stats("tottime").print_stats(25)
        stats.print_callers(r"\(compile\)|\(_do_import\)")  # who compiled (Triton, NVRTC) or imported in it
    steady = Times()
    graphs = dict(vars(cudagraph_stats))
    if args.profile_steady:  # where a steady generate's host time goes, by own time (stderr)
        import cProfile
        import pstats

        steady_profiler = cProfile.Profile()
        steady_profiler.enable()
    t_steady = time.perf_counter()
    generate(steady)
    per_token = (time.perf_counter() - t_steady) / args.new_tokens * 1e3
    if args.profile_steady:
        steady_profiler.disable()
        print("steady generate profile", file=sys.stderr)
        pstats.Stats(steady_profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    gaps = steady.gaps()
    if args.triton_files:
        print_triton_files()
    print(json.dumps({
        "imports": imports, "imports_torch": imports_torch, "model": model_s, "first_token": first_times.at[1] - t,
        "to_first_token": first_times.first_token_wall - started, "first": first,
        "process": process, "ready": ready, "eager_calls": eager_calls, "programs": counters.warm_start_seconds,
        "inductor": counters.compile_seconds + counters.load_seconds, "capture": cudagraph_stats.capture_seconds,
        "longest_gap": max(first_times.gaps()) * 1e3, "switch": slowest.get("seconds", 0.0) * 1e3,
        "ms_per_token": per_token,
        "median_gap": gaps[len(gaps) // 2] * 1e3, "max_gap": gaps[-1] * 1e3,
        "steady_graphs": {k: getattr(cudagraph_stats, k) - graphs[k] for k in ("captures", "recaptures", "uncaptured_runs")},
        "tokens": tokens[:, args.prompt:].tolist(), "device": torch.cuda.get_device_name() if
        device == "cuda" else "cpu", "torch": torch.__version__,
        "loads": counters.warm_start_loads, "saves": counters.warm_start_saves,
        "frames": int(torch._dynamo.utils.counters["frames"].get("total", 0))}))


def print_triton_files() -> None:
    """Which of our Triton kernels (not Inductor's triton_*) each Triton cache dir holds, by cache key (stderr): whether
    a warm process finds what the cold one compiled."""
    import glob

    for root in sorted({os.environ.get("TRITON_CACHE_DIR") or "(unset)", os.path.expanduser("~/.triton/cache")}):
        found = sorted(glob.glob(os.path.join(root, "*", "*.json")))
        ours = sorted(f"{os.path.basename(os.path.dirname(f))[:10]}:{os.path.basename(f)[:-5]}" for f in found
                      if not os.path.basename(f).startswith(("__grp__", "triton_")))  # Inductor's: triton_*
        print(f"triton files: {root}: {len(found)} json files; ours: {' '.join(ours)}", file=sys.stderr)


def watch_first_program_calls(model, profile: bool) -> dict:
    """The slowest forward call that ran a program (not one ext-bg ran eagerly) in the first two generates: where
    the switch to a program is, cold or warm, however long the compile thread takes (the second generate
    comes after torch_ext.wait_compiled()). Timed to the end of its GPU work; with --profile-switch each call
    is profiled on the caller's thread and the slowest one's profile kept."""
    import cProfile
    import functools

    import torch

    from torch_ext.backend import counters

    inner = model.forward
    slowest = {"forward": inner, "seconds": 0.0, "profile": None, "calls": []}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        eager_before = counters.background_eager_calls
        ids = kwargs.get("input_ids", args[0] if args else None)
        slowest["calls"].append([time.perf_counter(), None, eager_before, getattr(ids, "shape", ())])  # end, eager: below
        if profile and not slowest.get("first_profiled"):
            out, seconds, report = _profile_call(inner, args, kwargs)
            slowest["calls"][-1][1:3] = [time.perf_counter(), counters.background_eager_calls > eager_before]
            if counters.background_eager_calls == eager_before:  # the program's first call: the switch
                slowest["first_profiled"] = True
                print(report, file=sys.stderr)
                if seconds > slowest["seconds"]:  # profiled, so slower than unprofiled
                    slowest.update(seconds=seconds, profile=None)
            return out
        profiler = cProfile.Profile() if profile else None
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        try:
            return inner(*args, **kwargs)
        finally:
            if profiler:
                profiler.disable()
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            slowest["calls"][-1][1:3] = [time.perf_counter(), counters.background_eager_calls > eager_before]
            if counters.background_eager_calls == eager_before and seconds > slowest["seconds"]:
                slowest.update(seconds=seconds, profile=profiler)

    model.forward = forward
    return slowest


class StackSampler:
    """Every thread's innermost Python frames each 2 ms, timed (--sample-gap): what the other threads ran while a
    call was slow."""

    IDLE = ("(wait)", "(_recv_msg)", "(check)", "(get)", "(select)")  # a thread waiting holds nothing

    def __init__(self):
        import threading

        self.samples = []  # (perf_counter, thread name, where)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")
        self._thread.start()

    def _run(self):
        import threading
        import traceback

        names = {}
        while not self._done.wait(0.002):
            now = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                if ident == self._thread.ident:
                    continue
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                stack = traceback.extract_stack(frame)[-4:]
                where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}({f.name})" for f in reversed(stack))
                self.samples.append((now, names.get(ident, str(ident)), where))

    def stop(self):
        self._done.set()
        self._thread.join()

    def report(self, start: float, end: float, label: str, top: int = 14) -> str:
        import collections

        counts = collections.Counter((name, where) for at, name, where in self.samples if start <= at <= end
                                     and not where.split(" <- ")[0].endswith(self.IDLE))
        return "\n".join(f"{label}: sampled {n:4d}x {name[:16]:16s} {where}" for (name, where), n in counts.most_common(top))


def print_longest_gap(token_times: list, calls: list, sampler: StackSampler | None = None) -> None:
    """Which forward calls the first generate's longest wait between two tokens holds, eager or program, and how
    long each took (stderr): a stall's cause (a switch to a program, or eager steps slowed by the compile thread)."""
    if len(token_times) < 3:
        return
    gaps = [(b - a, i) for i, (a, b) in enumerate(zip(token_times[1:], token_times[2:]), start=1)]
    length, i = max(gaps)
    start, end = token_times[i], token_times[i + 1]
    inside = [f"{'eager' if eager else 'program'} {(stop - begin) * 1e3:.0f} ms" for begin, stop, eager, _ in calls
              if stop is not None and begin < end and stop > start]
    median = sorted(g for g, _ in gaps)[len(gaps) // 2]
    print(f"longest gap: {length * 1e3:.0f} ms after token {i} of {len(token_times) - 1} (median {median * 1e3:.1f} ms); "
          f"calls in it: {', '.join(inside) or 'none'}", file=sys.stderr)
    if sampler:
        print(sampler.report(start, end, "longest gap"), file=sys.stderr)


def print_slowest_program_calls(calls: list, sampler: StackSampler | None, top: int = 3) -> None:
    """The first two generates' slowest calls that ran a program (call number, input shape, ms), and with
    --sample-gap the stacks sampled during the slowest (stderr): what the switch to a program spends."""
    done = [(stop - begin, n, begin, stop, shape) for n, (begin, stop, eager, shape) in enumerate(calls)
            if stop is not None and not eager]
    done.sort(reverse=True)
    print("slowest program calls: " + ", ".join(f"call {n} {tuple(shape)} {seconds * 1e3:.0f} ms"
                                               for seconds, n, _, _, shape in done[:top]), file=sys.stderr)
    if sampler and done:
        print(sampler.report(done[0][2], done[0][3], "slowest program call"), file=sys.stderr)


def _profile_call(inner, args, kwargs):
    """A call under torch.profiler (host ops, by self time) while a sampler records every
    thread's Python stack each 2 ms: what the switch waits on, C++ included (stderr)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    sync()
    sampler = StackSampler()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out = inner(*args, **kwargs)
        sync()
    end = time.perf_counter()
    sampler.stop()
    lines = [f"first program call under torch.profiler: {(end - start) * 1e3:.0f} ms",
             prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
             "Python stacks sampled every 2 ms during it (thread, innermost 4 frames; waiting threads left out)"]
    slow = [e for e in prof.events() if e.cpu_time_total > 20e3 and e.name.startswith("aten::")]
    lines += [f"slow op: {e.name} {e.cpu_time_total / 1e3:.1f} ms shapes {e.input_shapes}" for e in slow[:20]]
    lines.append(sampler.report(start, end, "first program call", top=30))
    return out, end - start, "\n".join(lines)


def run(column: str, cache: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", column, "--cache", cache, "--batch", str(args.batch),
           "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens)] + (["--smoke"] if args.smoke else []) \
        + (["--profile"] if args.profile else []) + (["--profile-steady"] if args.profile_steady else []) \
        + (["--profile-switch"] if args.profile_switch else []) + (["--triton-files"] if args.triton_files else []) \
        + (["--sample-gap"] if args.sample_gap else [])
    env = dict(os.environ, HF_GENERATE_SPAWNED=repr(time.time()))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode != 0:
        print(f"{column}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
        return {}
    if args.profile or args.profile_steady or args.profile_switch or args.triton_files or column.startswith("ext"):
        lines = [line for line in done.stderr.splitlines() if " ms torch_ext" in line or "(" in line
                 or "steady generate" in line or "slowest program call" in line or "  " in line
                 or "first program call" in line or "triton files" in line or "slow op" in line
                 or "longest gap:" in line]
        print(f"--- {column}\n" + "\n".join(lines[-260:]), file=sys.stderr)
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
    parser.add_argument("--warm-repeats", type=int, default=1,
                        help="warm processes per column (a process's steady state varies: one sample each)")
    parser.add_argument("--profile", action="store_true", help="cProfile each process's first generate (stderr)")
    parser.add_argument("--profile-steady", action="store_true",
                        help="cProfile each process's steady generate, by own time (stderr): host time warm vs cold")
    parser.add_argument("--triton-files", action="store_true",
                        help="each process lists our Triton kernels in the Triton cache dirs at its end (stderr)")
    parser.add_argument("--profile-switch", action="store_true",
                        help="cProfile the slowest call that ran a program in the first two generates (stderr): the switch")
    parser.add_argument("--sample-gap", action="store_true",
                        help="torch_ext columns: sample every thread's Python stack during the first generate and "
                             "print the longest gap's most common stacks (stderr): what stalls the token stream")
    parser.add_argument("--warm-rtc", action="store_true",
                        help="torch_ext columns: one more warm process with the compiled kernel modules deleted "
                             "(phase warm-rtc: our CUDA kernels compiled again with NVRTC, as before they were kept)")
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
            warm = [f"warm{i + 1}" if i else "warm" for i in range(args.warm_repeats)]
            phases = ["cold"] if column == "eager" else ["cold", *warm]
            if args.warm_rtc and column.startswith("ext"):
                phases.append("warm-rtc")
            for phase in phases:
                if phase == "warm-rtc":
                    shutil.rmtree(os.path.join(cache, "inductor", "torch_ext_cuda_modules"), ignore_errors=True)
                results[column, phase] = run(column, cache, args)
    info = next((r for r in results.values() if r), {})
    print(f"\nHF generate, LlamaForCausalLM{' (smoke)' if args.smoke else ' 16x2048 bf16'}, batch {args.batch}, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens; {info.get('device')}, torch {info.get('torch')}")
    expected = results.get(("eager", "cold"), {}).get("tokens")
    ready = (("imports_torch", "torch+hf s", "{:.2f}"), ("imports", "imports s", "{:.2f}"), ("model", "model s", "{:.2f}"), ("first_token", "first token s", "{:.2f}"),
             ("programs", "programs s", "{:.2f}"), ("inductor", "inductor s", "{:.2f}"), ("capture", "capture s", "{:.2f}"),
             ("longest_gap", "longest gap ms", "{:.0f}"), ("switch", "switch ms", "{:.0f}"),
             ("to_first_token", "to 1st token s", "{:.2f}"), ("first", "first generate s", "{:.2f}"),
             ("process", "process s", "{:.2f}"), ("ready", "ready s", "{:.2f}"))
    steady = (("ms_per_token", "ms/token", "{:.2f}"), ("median_gap", "median gap ms", "{:.2f}"),
              ("max_gap", "max gap ms", "{:.1f}"))
    for title, fields, ratios in (("To the first token", ready, ("first_token", "to_first_token", "first", "process")),
                                  ("Steady state (a third generate)", steady, ("ms_per_token", "median_gap"))):
        print(f"\n{title}")
        head = f"{'column':<9} {'phase':<8} " + " ".join(
            f"{label:>{max(len(label), 7)}}" + (f" {'x hf':>5}" if key in ratios else "") for key, label, _ in fields)
        extra = "  loads frames eager-calls tokens=eager" if fields is ready else "  captures recaptures uncaptured"
        print(head + extra)
        for (column, phase), r in results.items():
            if not r:
                print(f"{column:<9} {phase:<8} failed")
                continue
            base = results.get(("hf-auto", "warm" if phase.startswith("warm") else phase), {})
            cells = []
            for key, label, fmt in fields:
                cells.append(f"{fmt.format(r[key]):>{max(len(label), 7)}}")
                if key in ratios:
                    cells.append(f"{r[key] / base[key]:>5.2f}" if base.get(key) else f"{'-':>5}")
            if fields is ready:
                tail = f"  {r['loads']:>5} {r['frames']:>6} {r['eager_calls']:>11} {matching(r['tokens'], expected)}"
            else:
                g = r["steady_graphs"]
                tail = f"  {g['captures']:>8} {g['recaptures']:>10} {g['uncaptured_runs']:>10}"
            print(f"{column:<9} {phase:<8} " + " ".join(cells) + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
