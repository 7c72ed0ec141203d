"""The benchmarks a user runs, one entry point: which one answers your question, and run it.

    python bench/run.py                  # the list: each benchmark and the question it answers
    python bench/run.py NAME [ARGS...]   # run one (ARGS go to its script; --help shows them)

Each prints Markdown tables (harness.py: timing, interleaved rounds, the memory-bandwidth floor).
bench/dev/ holds the developers' tools (kernel checks and op benchmarks, profiles, host-cost
microbenchmarks); bench/experiments/ the finished kernel experiments, kept for their numbers;
bench/results/ the logs that the docs tables cite (docs/measurements/).
"""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (script, where it runs, the question it answers)
BENCHMARKS = {
    "compile": ("compile_time.py", "CPU",
                "How long does my model take to compile with torch_ext, cold and warm, beside torch.compile?"),
    "warm-start": ("hf_generate.py", "GPU (--smoke: CPU)",
                   "How long until a serving process gives its first token, cold and with warm caches?"),
    "decode": ("decode.py", "1 GPU",
               "Is a decode step faster than torch.compile (default, reduce-overhead)? A Llama-style decoder."),
    "hf-decode": ("hf_decode.py", "1 GPU (--smoke: CPU)",
                  "The same on a Hugging Face Llama with a StaticCache, beside transformers' own torch.compile."),
    "floor": ("inference_floor.py", "1 GPU (--smoke: CPU)",
              "How far is each way of running an HF Llama decode step from the memory-bandwidth floor?"),
    "training": ("checkpoint_training.py", "CPU or GPU (--device cuda)",
                 "Training with activation checkpointing: saved bytes, peak memory and step time beside Inductor."),
    "multi-gpu": ("tp_decode.py", "2 GPUs",
                  "Tensor-parallel decode (NCCL all-reduces) on 2 GPUs against 1."),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__.strip().splitlines()[0] + "\n")
        for name, (script, where, question) in BENCHMARKS.items():
            print(f"  {name:<11} {script:<24} {where:<27} {question}")
        print("\nGPU machines through the device tool: bash bench/gpu_check.sh (tests, benchmarks, profiles).")
        return 0
    if argv[0] not in BENCHMARKS:
        print(f"no benchmark {argv[0]!r}; one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    script = os.path.join(HERE, BENCHMARKS[argv[0]][0])
    return subprocess.call([sys.executable, script, *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
