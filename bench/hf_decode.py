"""Decode step of a Hugging Face LlamaForCausalLM on a StaticCache: torch_ext beside transformers'
recommended torch.compile, on one GPU.

    python bench/hf_decode.py [--batches 1,8,32] [--rounds 5] [--iters 50] [--skip ext-piecewise]
                              [--no-warm-process]
    python bench/hf_decode.py --smoke      # tiny config on the CPU: runs every path end to end

Model: transformers LlamaForCausalLM, 16 layers, hidden 2048, 16 heads of 128, MLP 5632, vocab 32000,
bf16, random weights, "sdpa" attention. Per batch B: a StaticCache of 256 positions and an eager
prefill of 255 tokens; the timed step decodes one token per sequence at position 255. StaticCache
keeps its write position in a 0-d tensor per layer (`layer.cumulative_length`, advanced in place by
`update`, and read back by the model as `get_seq_length()` for the positions), so between timed
steps one foreach copy puts every layer back to 255: every step writes the same position.

Columns (logits checked against eager: relative L2 error):
  eager          the model as written
  hf-ro          torch.compile(model.forward, mode="reduce-overhead", fullgraph=True), as transformers
                 recommends (its StaticCache marks its tensors static, so CUDA graphs are used)
  ext-full       torch_ext.compile, cudagraph_mode="full" (the whole step one CUDA graph), guard-free
                 dispatch
  ext-piecewise  torch_ext.compile split at aten::scaled_dot_product_attention (one compile per
                 distinct piece), cudagraph_mode="piecewise": SDPA runs eagerly between the graphs
  ext-piecewise-bool-mask  (only with --with) the same with additive_attention_masks=False: each eager
                 SDPA call converts HF's bool mask itself
Two times per step, median ms: "GPU" from CUDA events around steps enqueued back to back (the host
runs ahead, so host time is hidden while it is shorter than the GPU's), and "synced" the wall time of
a step followed by a synchronize (host + GPU, as in a generate loop that reads each token or checks
for EOS on the host). Ratios to hf-ro come from interleaved rounds (each round times every column in
turn; the median of the per-round ratios is reported): host-bound steps follow the host's speed.
"First call" is the compile (Dynamo, Inductor, torch_ext's split) plus one step, summed over the
batches; "warm process" is the same in a second process with the same Inductor and torch_ext cache
directories. Graphs are captured in the calls after it. Each column has its own cache directories,
but the first compiled column also pays the process's one-time Inductor start-up.

Levers (target: torch_ext <= 0.90x hf-ro at B = 1 and 8). On an H200 (torch 2.11,
bench/results/hf_decode_h200_torch2.11.log) ext-full is 1.00 / 1.00 / 1.03x hf-ro on the GPU and
0.88 / 0.89 / 0.92x synced at B = 1 / 8 / 32: both run the same kernels (1.2 ms per step on the GPU)
and the host part is what differs:
  * guard-free dispatch skips Dynamo's guards (they check every parameter and the cache object's
    attributes): ~35 us of host time per call against ~200 us for hf-ro. Hidden in "GPU" while the
    GPU step is longer; it shows in "synced" and in smaller or faster-to-run models;
  * dynamic=False compiles one graph per batch size, so the KV caches (batch in dim 0) are read in
    place by the graphs (with a symbolic batch they would be inputs copied in and out per replay);
  * full mode does not split: split at SDPA (one compile per distinct layer, faster to compile), the
    step took 3.5% more GPU time, since eager SDPA turns HF's boolean mask into an additive one on
    every call (a fill and a where per layer) where Inductor does it once for all layers;
  * piecewise is bound by the host (16 eager SDPA calls and 17 replays); SDPA's own conversion of HF's
    bool mask is made once in the graph (rewrite/attention_mask.py), and pieces that read a tensor
    expanded over the batch (stride 0) are captured too; SDPA allocates its result, copied into the
    next graph's static input (an attention op writing into an `out` buffer avoids that);
  * the GEMVs are two thirds of the GPU time: fusing q/k/v and gate/up (concatenated weights) is the
    next lever on the GPU side, for hf-ro and torch_ext alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # torch_ext, uninstalled too

from harness import print_table  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

COLUMNS = ("eager", "hf-ro", "ext-full", "ext-piecewise", "ext-piecewise-bool-mask")
OPT_IN = ("ext-piecewise-bool-mask",)  # run only when named in --with
COMPILED = COLUMNS[1:]
SDPA = "aten::scaled_dot_product_attention"


# Common served shapes, built from configs (random weights, nothing downloaded): name -> (family, fields).
# Each is its family's published config, trimmed to what shapes the step (layers, widths, heads, vocab).
MODELS = {
    "llama-1b": ("llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                               num_attention_heads=16, num_key_value_heads=16)),  # the bench shape (MHA)
    "llama3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)),
    "mistral-7b": ("mistral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, sliding_window=None)),
    "qwen2-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)),
    "gemma-2b": ("gemma", dict(vocab_size=32000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                               num_attention_heads=8, num_key_value_heads=1, head_dim=256)),  # MQA, GELU, 32k vocab
    "phi3-mini": ("phi3", dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False)),
}
_SMOKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def model_config(name: str = "llama-1b", smoke: bool = False, kv_heads: int | None = None):
    """A transformers config of MODELS[name] (smoke: the same family, tiny); kv_heads overrides the
    preset's key/value heads."""
    import transformers

    family, fields = MODELS[name]
    fields = dict(fields)
    if smoke:
        fields.update(_SMOKE, num_key_value_heads=kv_heads or (2 if fields["num_key_value_heads"] < fields[
            "num_attention_heads"] else 4), head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif kv_heads:
        fields["num_key_value_heads"] = kv_heads
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "gemma": transformers.GemmaConfig, "phi3": transformers.Phi3Config}[family]
    return cls(max_position_embeddings=8192, attn_implementation="sdpa", **fields)


def llama_config(smoke: bool, kv_heads: int | None = None):
    return model_config("llama-1b", smoke, kv_heads)


def describe_model(config) -> str:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    return (f"{config.model_type} {config.num_hidden_layers}x{config.hidden_size}, heads {heads}/{kv}, "
            f"MLP {config.intermediate_size}, vocab {config.vocab_size}"
            f"{', tied' if getattr(config, 'tie_word_embeddings', False) else ''}")


class Setup:
    """The model, and per batch size its prefilled StaticCache, step tokens and position reset."""

    def __init__(self, args):
        from transformers import AutoModelForCausalLM, StaticCache

        self.device = "cpu" if args.smoke else "cuda"
        dtype = torch.float32 if args.smoke else torch.bfloat16
        self.context = 16 if args.smoke else getattr(args, "context", None) or 256
        config = model_config(getattr(args, "model", None) or "llama-1b", args.smoke, getattr(args, "kv_heads", None))
        torch.manual_seed(0)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in its dtype: an 8B model never exists in float32
        try:
            with torch.device(self.device):  # initialise the weights where they live (fast on a GPU)
                self.model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
        finally:
            torch.set_default_dtype(default_dtype)
        self.caches, self.tokens, self.lengths, self.starts = {}, {}, {}, {}
        g = torch.Generator().manual_seed(1)
        for b in args.batches:
            prompt = torch.randint(0, config.vocab_size, (b, self.context - 1), generator=g).to(self.device)
            cache = StaticCache(config=config, max_cache_len=self.context)
            with torch.no_grad():
                self.model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            self.caches[b] = cache
            self.tokens[b] = torch.randint(0, config.vocab_size, (b, 1), generator=g).to(self.device)
            self.lengths[b] = [layer.cumulative_length for layer in cache.layers]
            self.starts[b] = [length.clone() for length in self.lengths[b]]  # all at context - 1

    def reset(self, b: int) -> None:
        torch._foreach_copy_(self.lengths[b], self.starts[b])  # one launch for all layers

    def step(self, fn, b: int):
        return fn(input_ids=self.tokens[b], past_key_values=self.caches[b], use_cache=True)


def make_column(name: str, model, cache_root: str):
    """The callable a column times (a compiled one compiles at its first call)."""
    if name == "eager":
        return model
    if name == "hf-ro":
        return torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    import torch_ext

    mode = name.removeprefix("ext-").removesuffix("-bool-mask")
    config = torch_ext.CompileConfig(
        splitting_ops=(SDPA,) if mode == "piecewise" else (), cudagraph_mode=mode, guard_free_dispatch=True,
        cache_dir=os.path.join(cache_root, "torch_ext"), progress_bar=False,
        additive_attention_masks=not name.endswith("-bool-mask"))
    return torch_ext.compile(model, config, dynamic=False)  # one graph per batch size: caches read in place


def first_calls(setup: Setup, columns, batches) -> tuple[dict, dict]:
    """Compile each column with one call per batch size (largest first); returns the columns and the
    seconds of those first calls, summed over the batch sizes."""
    fns, seconds = {}, {}
    for name in columns:
        # Each column its own Inductor cache (read at compile time): a column must not find another's pieces.
        root = os.path.join(os.environ["TORCH_EXT_BENCH_CACHE_ROOT"], name)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
        fn = make_column(name, setup.model, root)
        total = 0.0
        for b in sorted(batches, reverse=True):  # the smallest compiled last: its dispatch check is tried first
            setup.reset(b)
            sync(setup.device)
            start = time.perf_counter()
            with torch.no_grad():
                setup.step(fn, b)
            sync(setup.device)
            total += time.perf_counter() - start
        fns[name], seconds[name] = fn, total
    return fns, seconds


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(setup: Setup, fn, b: int, iters: int) -> tuple[float, float]:
    """Median ms of one decode step: on the GPU (CUDA events, steps enqueued back to back) and synced
    (wall time of a step and a synchronize). The position reset is outside both timed spans."""
    synced = []
    with torch.no_grad():
        for _ in range(3):  # warm-up, CUDA-graph capture, first replay
            setup.step(fn, b)
            setup.reset(b)
        for _ in range(iters):
            sync(setup.device)
            start = time.perf_counter()
            setup.step(fn, b)
            sync(setup.device)
            synced.append((time.perf_counter() - start) * 1e3)
            setup.reset(b)
        if setup.device != "cuda":
            return statistics.median(synced), statistics.median(synced)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            setup.step(fn, b)
            end.record()
            setup.reset(b)
        torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), statistics.median(synced)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def logits_errors(setup: Setup, fns: dict, batches) -> dict:
    """Relative error of each column's logits against eager's, at every batch (same cache, same position)."""
    errors = {}
    with torch.no_grad():
        for b in batches:
            setup.reset(b)
            expected = setup.step(setup.model, b).logits.float().clone()
            setup.reset(b)
            for name, fn in fns.items():
                actual = setup.step(fn, b).logits.float().clone()  # graph outputs are overwritten by the next replay
                setup.reset(b)
                errors[name] = max(errors.get(name, 0.0), rel_err(actual, expected))
    return errors


def warm_process(args, columns) -> dict:
    """First-call seconds of `columns` in a new process that finds this one's caches."""
    cmd = [sys.executable, os.path.abspath(__file__), "--first-calls-only", "--batches",
           ",".join(map(str, args.batches)), "--skip", ",".join(c for c in COLUMNS if c not in columns),
           "--with", ",".join(c for c in OPT_IN if c in columns)]
    cmd += ["--smoke"] if args.smoke else []
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    for line in done.stdout.splitlines():
        if line.startswith("FIRST_CALLS "):
            return json.loads(line[len("FIRST_CALLS "):])
    print(f"warm process failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each times every column)")
    parser.add_argument("--iters", type=int, default=50, help="timed steps per column per round")
    parser.add_argument("--skip", default="", help="comma-separated columns to leave out")
    parser.add_argument("--with", dest="opt_in", default="", help=f"opt-in columns to add: {', '.join(OPT_IN)}")
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU (checks the script)")
    parser.add_argument("--no-warm-process", action="store_true", help="skip the second (warm-cache) process")
    parser.add_argument("--first-calls-only", action="store_true", help=argparse.SUPPRESS)  # the warm process
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        args.batches, args.rounds, args.iters = [1, 2], 2, 3
    if not args.smoke and not torch.cuda.is_available():
        print("bench/hf_decode.py needs a CUDA GPU (or --smoke for a CPU check of the script).")
        return 0
    skip = set(filter(None, args.skip.split(","))) | (set(OPT_IN) - set(args.opt_in.split(",")))
    columns = [c for c in COLUMNS if c not in skip]
    # Inductor's and torch_ext's caches start empty in this process; the warm process reuses them.
    os.environ.setdefault("TORCH_EXT_BENCH_CACHE_ROOT", tempfile.mkdtemp(prefix="torch_ext_hf_decode_"))
    dynamo = torch._dynamo.config  # every column compiles the same forward, one graph per batch size each
    dynamo.recompile_limit = dynamo.accumulated_recompile_limit = 64
    from torch_ext.backend.dispatch.dispatcher import GuardFreeDispatchWarning

    warnings.filterwarnings("ignore", category=GuardFreeDispatchWarning)  # a new batch size compiles: by design

    setup = Setup(args)
    fns, first = first_calls(setup, [c for c in columns if c in COMPILED], args.batches)
    if args.first_calls_only:
        print("FIRST_CALLS " + json.dumps(first))
        return 0
    fns = {"eager": setup.model, **fns} if "eager" in columns else fns
    errors = logits_errors(setup, {n: f for n, f in fns.items() if n != "eager"}, args.batches)
    warm = warm_process(args, list(first)) if first and not args.no_warm_process else {}

    times = {(c, b): [] for c in fns for b in args.batches}  # (GPU ms, synced ms) per round
    for _ in range(args.rounds):
        for b in args.batches:
            for name, fn in fns.items():
                times[(name, b)].append(time_steps(setup, fn, b, args.iters))

    device = torch.cuda.get_device_name() if setup.device == "cuda" else "CPU (smoke: timings say nothing)"
    print(f"\nHF LlamaForCausalLM decode step, {setup.model.config.num_hidden_layers} layers, hidden "
          f"{setup.model.config.hidden_size}, {'float32' if args.smoke else 'bf16'}, context {setup.context}, on "
          f"{device}, torch {torch.__version__}, transformers {__import__('transformers').__version__}")
    print(f"Cells: median ms over {args.rounds} rounds of {args.iters} steps; (x) median of the per-round ratios "
          "to hf-ro [min-max].")
    for kind, title in enumerate(("GPU ms per step (CUDA events, steps back to back)",
                                  "synced ms per step (host + GPU: a synchronize after each step)")):
        print(f"\n{title}")
        rows = []
        for b in args.batches:
            row = [str(b)]
            for name in fns:
                mine = [t[kind] for t in times[(name, b)]]
                cell = f"{statistics.median(mine):.3f}"
                if "hf-ro" in fns and name != "hf-ro":
                    ratios = [t / r[kind] for t, r in zip(mine, times[("hf-ro", b)])]
                    cell += f" ({statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}])"
                row.append(cell)
            rows.append(row)
        print_table(["batch"] + list(fns), rows)
    print()
    print_table(["column", "logits rel err vs eager", "first call s", "first call s, warm process"],
                [[n, f"{errors[n]:.1e}", f"{first[n]:.1f}", f"{warm[n]:.1f}" if n in warm else "-"] for n in first])
    # bf16: compiled code rounds differently from eager (2.5e-2 for every compiled column on an H200).
    bad = [n for n, e in errors.items() if not e < 5e-2]
    if bad:
        print(f"LOGITS MISMATCH vs eager (rel err >= 5e-2): {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
