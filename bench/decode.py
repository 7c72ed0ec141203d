"""Decode-step benchmark: torch_ext's CUDA graphs against torch.compile, on one GPU.

    python bench/decode.py [--batches 1,8,32,128] [--iters 200] [--layers 16] [--rounds 5]
                           [--skip compile,reduce-overhead] [--attention triton,custom_op,...]

Model: a 16-layer Llama-style decoder (hidden 2048, 16 heads of 128, SwiGLU MLP 5632, RMSNorm,
rotary), bf16, random weights, no embedding or LM head. One decode step at context 256: each of the
B sequences writes its new k/v at position 255 of a preallocated KV cache (one tensor per layer,
key and value stacked) and attends over 256 positions. The attention is an opaque custom op (the
splitting op) that writes the cache in place and its result into a buffer the model allocates
just before the call; by default it is one Triton kernel (bench/dev/decode_attention.py, checked
against SDPA first), --attention picks an SDPA backend instead, or "custom_op": what users write,
a plain torch.library.custom_op that writes the cache and returns SDPA's result. A comma-separated
--attention measures each in turn, in one run.

Columns (median ms over CUDA-event timed steps, and that over the HBM floor):
  eager            the model as written
  compile          torch.compile(dynamic=True), Inductor defaults
  reduce-overhead  torch.compile(mode="reduce-overhead", dynamic=True): cudagraph trees skip
                   graphs whose inputs are mutated (the KV cache), so it runs without them
  hand-graph       per batch size, torch.cuda.CUDAGraph captured by hand over torch.compile(dynamic=False)
                   (the input copied into its static buffer inside the timed step)
  ext-piecewise    torch_ext, cudagraph_mode="piecewise", guard-free dispatch
  ext-full         torch_ext, cudagraph_mode="full", guard-free dispatch
  ext-full+pw      torch_ext, cudagraph_mode="full_and_piecewise" (full graphs at every capture size;
                   piecewise graphs behind them for calls a full graph cannot serve)
  ext-pw+fusion    ext-piecewise with post_grad_passes=(FuseAddRMSNormPass(),)
HBM floor: (weight bytes + KV bytes read) / device-to-device copy bandwidth measured here.
Every variant's output is checked against eager (relative L2 error of the step's output).
Ratios to hand-graph are also given from interleaved rounds (see the end of main): host-bound
steps follow the host's speed, which drifts between columns run minutes apart.
Where the time of a step goes: bench/dev/decode_profile.py.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harness import copy_bandwidth, print_table  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, MLP, CONTEXT, EPS = 2048, 16, 128, 5632, 256, 1e-6
POS = CONTEXT - 1
DTYPE = torch.bfloat16


_LIB = None
# How the attention op attends: "triton", one kernel that also writes the cache and writes into the
# op's output buffer (bench/dev/decode_attention.py); or softmax(q k^T) v through SDPA after a cache
# write, copied into that buffer: "auto" lets torch's dispatcher pick (cuDNN on an H200 with torch
# 2.11), the others call one SDPA backend directly (fewer host calls).
SDPA = {
    "auto": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    "efficient": lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False)[0],
    "flash": lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0],
    "cudnn": lambda q, k, v: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)[0],
}
ATTENTION = ("triton",) + tuple(SDPA) + ("custom_op",)
attention_impl = "triton"


def define_attention():
    """The attention op, registered straight with the dispatcher at the CUDA and CPU keys (vLLM's
    direct_register_custom_op): piecewise graphs pay its host cost 16 times per step, and at
    batch 1 a step is about as host-bound as GPU-bound on the H200 machines. Per call this adds
    about 3 us to calling the function; torch_ext's splitting_op(..., autograd=False), which also
    guards gradients, about 8; torch.library.custom_op 18-30 (bench/dev/splitting_op_cost.py). Safe
    here: the benchmark runs without grads. It writes into `out`, allocated by the model just
    before the call (vLLM's attention-with-output shape): under piecewise CUDA graphs that buffer
    is an output of the graph before the op, so the graph after it reads the result where it is
    instead of copying it into a static buffer. One KV cache tensor per layer (key and value
    stacked, as vLLM lays it out)."""
    global _LIB
    if _LIB is not None:
        return
    triton_attention = None
    if torch.cuda.is_available():
        from dev.decode_attention import decode_attention as triton_attention
    _LIB = torch.library.Library("decode_bench", "DEF")
    _LIB.define("attention(Tensor q, Tensor kv, Tensor(a!) kv_cache, int pos, Tensor(b!) out) -> ()")

    def attention(q, kv, kv_cache, pos: int, out):
        """q, out: (B, heads, head_dim); kv: (B, 2, heads, head_dim), the new key and value;
        kv_cache: (max_batch, 2, heads, context, head_dim)."""
        if q.is_cuda and attention_impl == "triton":
            triton_attention(q, kv, kv_cache, pos, out)
            return
        b = q.shape[0]
        kv_cache[:b, :, :, pos] = kv
        cache = kv_cache[:b, :, :, :pos + 1]
        attend = SDPA[attention_impl] if q.is_cuda and attention_impl in SDPA else SDPA["auto"]
        out.copy_(attend(q[:, :, None], cache[:, 0], cache[:, 1])[:, :, 0])

    for device in ("CUDA", "CPU"):
        _LIB.impl("attention", attention, device)
    torch.library.register_fake("decode_bench::attention", lambda q, kv, kv_cache, pos, out: None, lib=_LIB)

    @torch.library.custom_op("decode_bench::sdpa_attention", mutates_args=("kv_cache",))
    def sdpa_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, pos: int) -> torch.Tensor:
        """--attention custom_op: the op as users write it (returns its result, SDPA inside)."""
        b = q.shape[0]
        kv_cache[:b, :, :, pos] = kv
        cache = kv_cache[:b, :, :, :pos + 1]
        return F.scaled_dot_product_attention(q[:, :, None], cache[:, 0], cache[:, 1]).squeeze(2)

    sdpa_attention.register_fake(lambda q, kv, kv_cache, pos: torch.empty_like(q))


def splitting_op_name() -> str:
    return "decode_bench::sdpa_attention" if attention_impl == "custom_op" else "decode_bench::attention"


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, r):
        h = r.float()
        var = h.pow(2).mean(-1, keepdim=True)
        return (h * torch.rsqrt(var + EPS)).to(r.dtype) * self.weight


def rotate(x, cos, sin):
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm = RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.post_norm = RMSNorm(HIDDEN)
        self.gate_up = nn.Linear(HIDDEN, 2 * MLP, bias=False)
        self.down = nn.Linear(MLP, HIDDEN, bias=False)

    def forward(self, h, kv_cache, cos, sin, pos: int):
        b = h.shape[0]
        q, k, v = self.qkv(self.input_norm(h)).view(b, 3, HEADS, HEAD_DIM).unbind(1)
        kv = torch.stack((rotate(k, cos, sin), v), dim=1)
        q = rotate(q, cos, sin)
        if attention_impl == "custom_op":
            a = torch.ops.decode_bench.sdpa_attention(q, kv, kv_cache, pos)
        else:
            a = torch.empty_like(q)
            torch.ops.decode_bench.attention(q, kv, kv_cache, pos, a)
        h = h + self.o(a.reshape(b, HIDDEN))
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.norm = RMSNorm(HIDDEN)
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        angles = torch.outer(torch.arange(CONTEXT).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x, kv_caches: list[torch.Tensor], pos: int):
        cos, sin = self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)
        h = x
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, kv_cache, cos, sin, pos)
        return self.norm(h)


def time_steps(step, inputs, iters: int) -> float:
    """Median ms of `step(x)` over CUDA-event timed calls, cycling through inputs."""
    for x in inputs[:3]:
        step(x)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for i, (start, end) in enumerate(events):
        start.record()
        step(inputs[i % len(inputs)])
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class HandGraphs:
    """One torch.cuda.CUDAGraph per batch size over torch.compile(dynamic=False)."""

    def __init__(self, model, caches, batches):
        self.compiled = torch.compile(model, dynamic=False)
        self.caches = caches
        self.graphs, self.static_in, self.static_out = {}, {}, {}
        self.capture_s, self.capture_bytes, self.batches = 0.0, 0, batches

    def setup(self):
        for b in sorted(self.batches, reverse=True):
            x = torch.randn(b, HIDDEN, dtype=DTYPE, device="cuda")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # compile, autotune, warm
                    self.compiled(x, self.caches, POS)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # torch.cuda.graph() empties the cache itself: measure from there
            before, start = torch.cuda.memory_reserved(), time.perf_counter()
            graph = torch.cuda.CUDAGraph()  # each in its own pool (torch.cuda.graph's default)
            with torch.cuda.graph(graph):
                out = self.compiled(x, self.caches, POS)
            torch.cuda.synchronize()
            self.capture_s += time.perf_counter() - start
            self.capture_bytes += torch.cuda.memory_reserved() - before
            self.graphs[b], self.static_in[b], self.static_out[b] = graph, x, out

    def __call__(self, x, caches, pos):
        b = x.shape[0]
        self.static_in[b].copy_(x)
        self.graphs[b].replay()
        return self.static_out[b]


INTERLEAVED = ("hand-graph", "ext-piecewise", "ext-full", "ext-full+pw", "ext-pw+fusion")


def set_attention(name: str) -> None:
    global attention_impl
    if name not in ATTENTION:
        raise ValueError(f"--attention {name!r}: expected one of {ATTENTION}")
    attention_impl = name


def ext_config(mode: str, batches, cache_dir: str, fusion: bool = False):
    from torch_ext.backend import CompileConfig
    from torch_ext.backend.passes import FuseAddRMSNormPass

    return CompileConfig(
        splitting_ops=(splitting_op_name(),), compile_sizes=tuple(batches), cache_dir=cache_dir,
        cudagraph_mode=mode, cudagraph_capture_sizes=tuple(batches), guard_free_dispatch=True,
        post_grad_passes=(FuseAddRMSNormPass(),) if fusion else (), progress_bar=False)


def build(layers: int, max_batch: int):
    """The model (bf16, random weights, eval, no grads) and its KV caches, on the GPU."""
    torch.manual_seed(0)
    model = Decoder(layers).to(device="cuda", dtype=DTYPE).eval()
    for p in model.parameters():
        p.requires_grad_(False)
        if p.dim() == 2:
            p.normal_(0, 0.02)
    for buf in ("cos", "sin"):  # keep the rotary tables fp32 (cast per step, as HF does)
        setattr(model, buf, getattr(model, buf).float())
    shape = (max_batch, 2, HEADS, CONTEXT, HEAD_DIM)
    return model, [torch.randn(shape, dtype=DTYPE, device="cuda") for _ in model.layers]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds for the ratios to hand-graph")
    parser.add_argument("--skip", default="", help="comma-separated columns to leave out")
    parser.add_argument("--attention", default=attention_impl,
                        help=f"comma-separated, each one of {ATTENTION}: how the attention op attends")
    args = parser.parse_args()
    attentions = args.attention.split(",")
    for name in attentions:
        set_attention(name)  # checks the names before anything runs
    if not torch.cuda.is_available():
        print("bench/decode.py measures CUDA graphs and needs a CUDA GPU; torch.cuda.is_available() is False "
              "here. Run it on a machine with an NVIDIA GPU.")
        return 0
    status = 0
    for name in attentions:
        set_attention(name)
        print(f"\n===== attention: {name} =====", flush=True)
        status = max(status, bench(args))
    return status


def bench(args) -> int:
    if attention_impl == "triton":
        from dev.decode_attention import check

        err = check("cuda")
        print(f"attention kernel vs float64 SDPA: max rel err {err:.1e}", flush=True)
        if not err < 1e-2:
            print("ATTENTION KERNEL MISMATCH")
            return 1

    import torch_ext.backend.dispatch as dispatch
    from torch_ext.backend.runtime.cudagraph.manager import capture_sizes, cudagraph_stats

    define_attention()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("torch_ext.backend.cudagraph").setLevel(logging.INFO)  # why a region runs without graphs
    batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    model, caches = build(args.layers, max(batches))
    bw = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = {b: 2 * args.layers * b * HEADS * CONTEXT * HEAD_DIM * 2 for b in batches}
    floor_ms = {b: (weight_bytes + kv_bytes[b]) / bw * 1e3 for b in batches}
    inputs = {b: [torch.randn(b, HIDDEN, dtype=DTYPE, device="cuda") for _ in range(4)] for b in batches}
    check = {b: torch.randn(b, HIDDEN, dtype=DTYPE, device="cuda") for b in batches}
    cache_dir = tempfile.mkdtemp(prefix="torch_ext_decode_")

    results, notes, errors = {}, {}, {}
    kept = {}  # columns that stay valid after torch._dynamo.reset(), for the interleaved rounds

    def run_column(name, make, setup=None):
        if name in skip:
            return
        torch._dynamo.reset()
        cudagraph_stats.reset()
        start = time.perf_counter()
        try:
            fn = make()
            if setup is not None:
                setup(fn)
            for b in sorted(batches, reverse=True):  # compile at a batch > 1 first (0/1 specialization)
                x = inputs[b][0]
                if b == max(batches):
                    torch._dynamo.mark_dynamic(x, 0)
                with torch.no_grad():
                    fn(x, caches, POS)
            torch.cuda.synchronize()
            ready = time.perf_counter() - start
            errs = {}
            with torch.no_grad():
                for b in batches:
                    expected = model(check[b], caches, POS).clone()
                    errs[b] = rel_err(fn(check[b], caches, POS), expected)
                    uncaptured = cudagraph_stats.uncaptured_runs
                    results[(name, b)] = time_steps(lambda x: fn(x, caches, POS), inputs[b], args.iters)
                    if cudagraph_stats.uncaptured_runs != uncaptured:  # a region fell back to running without graphs
                        print(f"[{name}] B={b}: {cudagraph_stats.uncaptured_runs - uncaptured} uncaptured region runs "
                              "while timing (see the torch_ext.backend.runtime.cudagraph.manager log)", flush=True)
            if name in INTERLEAVED:
                kept[name] = fn
            errors[name] = max(errs.values())
            notes[name] = f"ready in {ready:.1f} s"
            if cudagraph_stats.captures:
                notes[name] += (f"; {cudagraph_stats.captures} graphs captured in {cudagraph_stats.capture_seconds:.2f} s, "
                                f"pool +{cudagraph_stats.capture_bytes / 2**20:.0f} MiB reserved, static inputs "
                                f"{cudagraph_stats.static_input_bytes / 2**20:.2f} MiB")
            if isinstance(fn, HandGraphs):
                notes[name] += (f"; {len(fn.graphs)} graphs captured in {fn.capture_s:.2f} s, "
                                f"+{fn.capture_bytes / 2**20:.0f} MiB reserved")
            print(f"[{name}] {notes[name]}; max rel err vs eager {errors[name]:.2e}; "
                  + ", ".join(f"B={b}: {results[(name, b)]:.3f} ms" for b in batches), flush=True)
        except Exception as e:  # one column failing must not lose the others
            notes[name] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"[{name}] {notes[name]}", flush=True)
            import traceback

            traceback.print_exc()

    def ext(mode, fusion=False):
        cfg = ext_config(mode, batches, cache_dir, fusion)
        compiled = dispatch.compile(model, cfg)

        def capture(fn):
            first = inputs[max(batches)][0]
            torch._dynamo.mark_dynamic(first, 0)
            with torch.no_grad():
                fn(first, caches, POS)  # compile (guard-free dispatch arms after it)
                capture_sizes(lambda b: fn(inputs[b][1], caches, POS), cfg)

        return compiled, capture

    run_column("eager", lambda: model)
    run_column("compile", lambda: torch.compile(model, dynamic=True))
    run_column("reduce-overhead", lambda: torch.compile(model, mode="reduce-overhead", dynamic=True))
    hand = {}
    run_column("hand-graph", lambda: hand.setdefault("g", HandGraphs(model, caches, batches)),
               setup=lambda g: g.setup())
    for name, mode, fusion in (("ext-piecewise", "piecewise", False), ("ext-full", "full", False),
                               ("ext-full+pw", "full_and_piecewise", False), ("ext-pw+fusion", "piecewise", True)):
        compiled, capture = ext(mode, fusion) if name not in skip else (None, None)
        run_column(name, lambda c=compiled: c, setup=capture)

    columns = [c for c in ("eager", "compile", "reduce-overhead", "hand-graph", "ext-piecewise", "ext-full",
                           "ext-full+pw", "ext-pw+fusion") if any((c, b) in results for b in batches)]
    print()
    print(f"Decode step: {args.layers} layers, hidden {HIDDEN}, {HEADS} heads, MLP {MLP}, context {CONTEXT}, "
          f"bf16, attention {attention_impl}, on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(f"HBM floor = (weights {weight_bytes / 1e9:.3f} GB + KV read) / {bw / 1e12:.2f} TB/s "
          "(device-to-device copy, read+write). Cells: median ms (x floor).")
    header = ["batch", "floor ms"] + columns
    rows = []
    for b in batches:
        row = [str(b), f"{floor_ms[b]:.3f}"]
        for c in columns:
            t = results.get((c, b))
            row.append("-" if t is None else f"{t:.3f} ({t / floor_ms[b]:.2f}x)")
        rows.append(row)
    print_table(header, rows)
    print()
    for c in columns + [c for c in notes if c not in columns]:
        err = f"; max rel err vs eager {errors[c]:.1e}" if c in errors else ""
        print(f"  {c}: {notes.get(c, '')}{err}")
    if "hand-graph" in kept and len(kept) > 1:
        # The columns above ran one after another; steps bound by the host (piecewise at small
        # batches) follow the host's speed, which drifts on a shared machine. Ratios to hand-graph
        # therefore come from interleaved rounds: every kept column timed once per round.
        rounds = {(c, b): [] for c in kept for b in batches}
        with torch.no_grad():
            for _ in range(args.rounds):
                for b in batches:
                    for c, fn in kept.items():
                        rounds[(c, b)].append(time_steps(lambda x: fn(x, caches, POS), inputs[b], args.iters // 4))
        print(f"\nRatios to hand-graph, medians of {args.rounds} interleaved rounds (min-max over rounds in brackets):")
        for c in kept:
            if c == "hand-graph":
                continue
            cells = []
            for b in batches:
                per_round = [t / h for t, h in zip(rounds[(c, b)], rounds[("hand-graph", b)])]
                cells.append(f"B={b}: {statistics.median(per_round):.2f} [{min(per_round):.2f}-{max(per_round):.2f}]")
            print(f"  {c} / hand-graph: " + ", ".join(cells))
    bad = [c for c, e in errors.items() if not e < 3e-2]
    if bad:
        print(f"OUTPUT MISMATCH vs eager (rel err >= 3e-2): {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
