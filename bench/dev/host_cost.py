"""CPU host cost of a split model against Inductor: an inference call, a training step, and 8 threads
calling one compiled model, on one intra-op thread (torch.set_num_threads(1)) where the host's Python
is what differs.

    python bench/dev/host_cost.py                    # tiny HF Llama: 8 layers, hidden 64, batch 1 x 8
    python bench/dev/host_cost.py --rows inference --rounds 15
    python bench/dev/host_cost.py --rows training,checkpointed --layers 4   # issue 46's CPU case

Columns: inductor = torch.compile(model); ext = the torch_ext backend without a splitting op;
ext-split = split at aten::scaled_dot_product_attention (training: differentiated once); ext-dispatch =
ext-split through torch_ext.compile with guard-free dispatch (on request: --columns). Rows: us per
inference call (no_grad), us per training step (forward with labels + backward), the same step with
HF gradient checkpointing on (non-reentrant, a copy of the model; the split keeps each layer's
recompute), calls/s of `--threads`
threads calling one compiled model under no_grad against one thread's (each output checked against
eager on its input; wrong ones counted). Medians of interleaved rounds (the columns take turns in every
round: a shared machine's speed drifts); ratios to inductor.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import threading
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, ".."))

import torch  # noqa: E402

from harness import model_arguments, print_table  # noqa: E402

SPLIT_AT = "aten::scaled_dot_product_attention"


def build_model(args):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, 64), attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def compiled(column: str, model):
    import torch_ext
    from torch_ext.backend import CompileConfig

    if column == "inductor":
        return torch.compile(model)
    if column == "ext-dispatch":  # torch_ext.compile: guard-free dispatch, one call at a time from its check on
        return torch_ext.compile(model, CompileConfig(splitting_ops=(SPLIT_AT,), cache_dir=None, guard_free_dispatch=True))
    ops = (SPLIT_AT,) if column == "ext-split" else ()
    return torch.compile(model, backend=torch_ext.backend(CompileConfig(splitting_ops=ops, cache_dir=None)))


def timed_us(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def threaded(run, inputs, expected, threads: int, calls: int) -> tuple[float, int]:
    """calls/s of `threads` threads making `calls` calls each (started together), and wrong outputs."""
    barrier, wrong, lock = threading.Barrier(threads), [0], threading.Lock()

    def work(t):
        barrier.wait()
        with torch.no_grad():
            for i in range(calls):
                k = (t + i) % len(inputs)
                if not torch.allclose(run(inputs[k]), expected[k], rtol=1e-4, atol=1e-4):
                    with lock:
                        wrong[0] += 1

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    return threads * calls / (time.perf_counter() - start), wrong[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p, layers=8, hidden=64, heads=4, vocab=128, batch=1, seq=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--columns", default="inductor,ext,ext-split")
    p.add_argument("--rows", default="inference,training,checkpointed,threads")
    args = p.parse_args()
    torch.set_num_threads(1)
    # Every column and row compiles the same HF forward: 3 columns x 3 rows are 9 graphs of one function,
    # past Dynamo's default limit of 8 (the ninth would run eagerly).
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 64
    columns, rows = args.columns.split(","), args.rows.split(",")
    model = build_model(args)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(4)]
    ids = inputs[0]
    infer = {c: compiled(c, model) for c in columns}
    # One model per training row: switching checkpointing on and off would change what Dynamo guards
    # (each enable makes a new checkpoint function) and recompile until it gave up.
    trained = {"training": model}
    if "checkpointed" in rows:
        trained["checkpointed"] = copy.deepcopy(model)
        trained["checkpointed"].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trained = {r: m for r, m in trained.items() if r in rows}
    train = {(r, c): compiled(c, m) for r, m in trained.items() for c in columns}
    model.eval()
    with torch.no_grad():
        expected = [model(input_ids=x, use_cache=False).logits for x in inputs]
        for c, m in infer.items():
            for x, want in zip(inputs, expected):  # compile; check against eager
                assert torch.allclose(m(input_ids=x, use_cache=False).logits, want, rtol=1e-4, atol=1e-4), c
    call = {c: (lambda m=m: m(input_ids=ids, use_cache=False).logits) for c, m in infer.items()}
    runs = {c: (lambda x, m=m: m(input_ids=x, use_cache=False).logits) for c, m in infer.items()}

    def step(r, c):
        trained[r].zero_grad(set_to_none=True)
        train[r, c](input_ids=ids, labels=ids, use_cache=False).loss.backward()

    for r, m in trained.items():  # train mode only around the training rows: the other rows run `model` in eval
        m.train()
        for c in columns:
            step(r, c), step(r, c)
        m.eval()
    samples = {(r, c): [] for r in ("inference", "training", "checkpointed", "1 thread", "n threads", "ratio")
               for c in columns}
    wrong = {c: 0 for c in columns}
    for _ in range(args.rounds):  # interleaved: every column in every round
        for c in columns:
            if "inference" in rows:
                with torch.no_grad():
                    samples["inference", c].append(timed_us(call[c], args.iters))
            for r, m in trained.items():
                m.train()
                samples[r, c].append(timed_us(lambda: step(r, c), max(1, args.iters // 3)))
                m.eval()
            if "threads" in rows:
                one, bad1 = threaded(runs[c], inputs, expected, 1, args.iters * args.threads)
                many, bad = threaded(runs[c], inputs, expected, args.threads, args.iters)
                samples["1 thread", c].append(one)
                samples["n threads", c].append(many)
                samples["ratio", c].append(many / one)  # within a round: the machine's drift cancels
                wrong[c] += bad1 + bad

    med = {k: statistics.median(v) for k, v in samples.items() if v}
    table = []
    for r, label, unit in (("inference", "inference call", "us"), ("training", "training step", "us"),
                           ("checkpointed", "training step, checkpointed", "us"),
                           ("1 thread", "1 thread", "calls/s"), ("n threads", f"{args.threads} threads", "calls/s")):
        if (r, columns[0]) not in med:
            continue
        base = med.get((r, "inductor"))
        cells = []
        for c in columns:
            v, spread = med[r, c], samples[r, c]
            cell = f"{v:.0f} [{min(spread):.0f}-{max(spread):.0f}]"
            if base:
                cell += f" {v / base:.2f}x"
            if r == "n threads":
                ratios = samples["ratio", c]
                cell += (f", {med['ratio', c]:.2f}x of 1 thread (per round: "
                         f"{' '.join(f'{x:.2f}' for x in ratios)})")
                if wrong[c]:
                    cell += f", {wrong[c]} wrong"
            cells.append(cell)
        table.append([f"{label} ({unit})"] + cells)
    print(f"\ntiny HF Llama: {args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq}, float32, "
          f"cpu, 1 intra-op thread, torch {torch.__version__}; median [min-max] of {args.rounds} interleaved rounds; "
          "ratios to inductor" + (f"; wrong outputs: {sum(wrong.values())}" if "threads" in rows else ""))
    print_table(["", *columns], table)


if __name__ == "__main__":
    main()
