"""A training step with activation checkpointing: eager, Inductor, torch_ext without a split and
torch_ext split at attention, side by side.

    python bench/checkpoint_training.py                     # CPU: saved-for-backward bytes (+ step time)
    python bench/checkpoint_training.py --device cuda        # GPU: also peak memory, step time
    python bench/checkpoint_training.py --smoke             # tiny sizes, every path end to end

Models (random weights, train mode):
  hf-llama   transformers LlamaForCausalLM, gradient_checkpointing_enable(use_reentrant=False),
             SDPA attention; split at aten::scaled_dot_product_attention; loss from labels
  custom-op  blocks under torch.utils.checkpoint(use_reentrant=False) whose attention is a
             torch.library custom op with its own autograd formula (tests/checkpoint_models.py);
             split at that op
Columns: eager; inductor = torch.compile(model, fullgraph=True); ext = torch_ext backend without a
splitting op; ext-split = split at attention (the training graph differentiated once: backend/joint.py);
ext-split-pieces = split at attention, each piece differentiated on its own (differentiate_once=False,
the path before). Opt-in (name them in --columns; CUDA): inductor-ro = torch.compile(mode="reduce-overhead");
ext-split-cg = ext-split with training_cudagraphs="pieces" (each piece replayed by Inductor's CUDA-graph trees);
ext-split-cg-whole = training_cudagraphs="whole" (the forward and the backward one graph each, attention inside).
Rows: MiB the forward keeps for backward (torch_ext.testing.activation_bytes), peak memory of a whole
step above the weights (CUDA; "-" for the CUDA-graph columns: a replay writes pool memory the
allocator counts as free, so neither row sees it; one pool serves every graph column of a process);
with --reserved, each column's peak reserved memory over 4 steps in a process of its own, above what
the loaded model held (graph pools counted whole, allocator rounding included); median step time
(forward + backward) from interleaved rounds, and on CUDA the host's ms per step (until the step's
Python returns, no sync) beside the GPU's (events around the steps). --checkpoint off: the same models
without activation checkpointing. Ratios are to inductor. In every round each column first runs
--warmup untimed steps (the step after a switch pays for the other column's allocations), and Python's
garbage collector runs before each timed block and is off during it (a collection would land in one
column's block: a host-bound step is mostly Python).

    python bench/checkpoint_training.py --layers 4 --hidden 64 --batch 2 --seq 32   # CPU host cost
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # checkpoint_models, hf_models

import torch  # noqa: E402

from harness import model_arguments, print_table  # noqa: E402

COLUMNS = ("eager", "inductor", "ext", "ext-split", "ext-split-pieces")
OPT_IN = ("inductor-ro", "ext-split-cg", "ext-split-cg-whole")  # CUDA graphs: run only when named in --columns


def build(name: str, args, checkpointing: bool = True):
    if name == "hf-llama":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
            max_position_embeddings=max(args.seq, 64), attn_implementation="sdpa")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        return model, ids, "aten::scaled_dot_product_attention", \
            lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False).loss
    import checkpoint_models as cm

    model = cm.CheckpointedModel(layers=args.layers, d=args.hidden, attention=cm.CUSTOM, checkpointing=checkpointing)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    return model, x, cm.CUSTOM, lambda m, x: m(x)


def compiled(column: str, model, splitting_op: str):
    from torch_ext.backend import CompileConfig, make_backend

    if column == "eager":
        return model
    if column == "inductor":
        return torch.compile(model, fullgraph=True)
    if column == "inductor-ro":
        return torch.compile(model, fullgraph=True, mode="reduce-overhead")
    ops = (splitting_op,) if column.startswith("ext-split") else ()
    config = CompileConfig(cache_dir=None, splitting_ops=ops, differentiate_once=column != "ext-split-pieces",
                           training_cudagraphs={"ext-split-cg": "pieces", "ext-split-cg-whole": "whole"}.get(column, False))
    return torch.compile(model, backend=make_backend(config), fullgraph=True)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def on_gpu(args, dtype, name: str, checkpointing: bool, column: str):
    """`name` built, on the GPU in train mode, compiled as `column`: (model, batch, step callable, loss_of)."""
    model, batch, op, loss_of = build(name, args, checkpointing)
    model = model.to("cuda", dtype).train()
    batch = batch.to("cuda", dtype) if batch.is_floating_point() else batch.to("cuda")
    return model, batch, compiled(column, model, op), loss_of


def train_steps(model, run, batch, loss_of, steps: int) -> None:
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss_of(run, batch).backward()
    torch.cuda.synchronize()


def reserved_peak(args, dtype, name: str, checkpointing: bool, column: str) -> float:
    """MiB the caching allocator reserves at its peak over a few steps of `column`, above what it held
    with the model loaded, in this process: a CUDA-graph pool counts whole (--reserved runs each
    column in a process of its own)."""
    model, batch, run, loss_of = on_gpu(args, dtype, name, checkpointing, column)
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    train_steps(model, run, batch, loss_of, 4)
    return (torch.cuda.max_memory_reserved() - base) / 2**20


def reserved_row(args, name: str, checkpointing: bool, columns) -> dict:
    """reserved_peak of each column, each in a fresh process (one pool, one allocator per column)."""
    import json
    import subprocess

    out = {}
    for column in columns:
        if column == "eager":
            continue
        argv = [sys.executable, os.path.abspath(__file__), "--device", "cuda", "--models", name,
                "--checkpoint", "on" if checkpointing else "off", "--reserved-of", column]
        for flag in ("layers", "hidden", "heads", "vocab", "batch", "seq"):
            argv += [f"--{flag}", str(getattr(args, flag))]
        if args.dtype:
            argv += ["--dtype", args.dtype]
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        lines = done.stdout.strip().splitlines()
        out[column] = json.loads(lines[-1]) if done.returncode == 0 and lines else float("nan")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default="hf-llama,custom-op")
    model_arguments(p, layers=4, hidden=256, heads=4, vocab=1024, batch=4, seq=128)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per column per round")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--checkpoint", default="on", choices=("on", "off", "both"))
    p.add_argument("--columns", default=",".join(COLUMNS))
    p.add_argument("--reserved", action="store_true",
                   help="CUDA: also each column's peak reserved memory, a fresh process per column")
    p.add_argument("--reserved-of", default=None, help=argparse.SUPPRESS)  # the child of --reserved
    args = p.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.vocab, args.batch, args.seq, args.rounds, args.iters = 2, 64, 128, 2, 16, 1, 1
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    from torch_ext.testing import activation_bytes

    if args.reserved_of:
        name, checkpointing = args.models, args.checkpoint == "on"
        print(reserved_peak(args, dtype, name, checkpointing, args.reserved_of))
        return

    columns = tuple(args.columns.split(","))
    # Every column compiles HF's shared forward code objects again (another backend each; both
    # checkpoint cases in one process): raise Dynamo's limits so no column runs eagerly or fails.
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 64
    cases = [(n, c) for n in args.models.split(",") for c in {"on": (True,), "off": (False,), "both": (True, False)}[args.checkpoint]]
    for name, checkpointing in cases:
        model, batch, op, loss_of = build(name, args, checkpointing)
        model = model.to(args.device, dtype).train()
        if batch.is_floating_point():
            batch = batch.to(args.device, dtype)
        else:
            batch = batch.to(args.device)
        runs = {c: compiled(c, model, op) for c in columns}

        def step(column):
            model.zero_grad(set_to_none=True)
            loss_of(runs[column], batch).backward()

        saved, peak, errors = {}, {}, {}
        grads = {}
        for column in columns:  # compile, then measure memory once per column
            step(column)
            step(column)
            sync(args.device)
            grads[column] = [p.grad.float().cpu() for p in model.parameters() if p.grad is not None]  # off the device: not in the peak
            model.zero_grad(set_to_none=True)
            out, nbytes = activation_bytes(lambda: loss_of(runs[column], batch))
            saved[column] = nbytes / 2**20
            out.backward()
            del out
            model.zero_grad(set_to_none=True)
            if args.device == "cuda":
                sync(args.device)
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step(column)
                sync(args.device)
                peak[column] = (torch.cuda.max_memory_allocated() - base) / 2**20
        for column in (columns if "eager" in grads else ()):
            num = sum(((a - b).norm() ** 2).item() for a, b in zip(grads[column], grads["eager"]))
            den = sum((b.norm() ** 2).item() for b in grads["eager"])
            errors[column] = (num / max(den, 1e-30)) ** 0.5
        times, host, gpu = ({c: [] for c in columns} for _ in range(3))
        for _ in range(args.rounds):  # interleaved: host speed drifts between rounds
            for column in columns:
                for _ in range(args.warmup):
                    step(column)
                gc.collect()
                gc.disable()
                sync(args.device)
                if args.device == "cuda":
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                start, host_s = time.perf_counter(), 0.0
                for _ in range(args.iters):
                    t = time.perf_counter()
                    step(column)
                    host_s += time.perf_counter() - t
                if args.device == "cuda":
                    end.record()
                sync(args.device)
                gc.enable()
                times[column].append((time.perf_counter() - start) / args.iters * 1e3)
                host[column].append(host_s / args.iters * 1e3)
                if args.device == "cuda":
                    gpu[column].append(begin.elapsed_time(end) / args.iters)
        step_ms = {c: statistics.median(v) for c, v in times.items()}
        use_reserved = args.reserved and args.device == "cuda"
        reserved = reserved_row(args, name, checkpointing, columns) if use_reserved else {}

        def row(label, values, fmt="{:.2f}", graphs_unseen=False):
            base = values.get("inductor")
            return [label] + ["-" if graphs_unseen and c in OPT_IN else
                              f"{fmt.format(values[c])} ({values[c] / base:.2f}x)" if base else fmt.format(values[c])
                              for c in columns]

        print(f"\n{name}, checkpointing {'on' if checkpointing else 'off'}: {args.layers} layers, hidden "
              f"{args.hidden}, batch {args.batch} x seq {args.seq}, {dtype}, {args.device}, torch {torch.__version__}; "
              "grad rel. err vs eager: " + ", ".join(f"{c} {errors[c]:.1e}" for c in columns if "eager" in errors))
        rows = [row("saved for backward MiB", saved, graphs_unseen=True)]
        if peak:
            rows.append(row("peak step memory MiB", peak, graphs_unseen=True))
        if reserved:
            rows.append(row("peak reserved MiB, own process", {c: reserved.get(c, float("nan")) for c in columns}))
        rows.append(row("step ms (median)", step_ms))
        if args.device == "cuda":
            rows.append(row("host ms per step", {c: statistics.median(v) for c, v in host.items()}))
            rows.append(row("GPU ms per step", {c: statistics.median(v) for c, v in gpu.items()}))
        print_table(["", *columns], rows)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
