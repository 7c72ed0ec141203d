"""Build the FlashInfer peer that bench/dev/flashinfer_peer.py runs on the GPU machines, on a CPU machine
with nvcc: `.whl/flashinfer_decode_sm90a.tar` (carried with `.whl/`; bench/gpu_check.sh's callers untar
it into /tmp/site) and FlashInfer's own wheel's dependency `apache-tvm-ffi` for the device's Python.

    python bench/dev/flashinfer_prebuild.py [--head-dims 64,128] [--work /tmp/flashinfer_prebuild]

Why: the GPU machines reach no registry and carry at most 64 MiB; the flashinfer-python wheel is 101
MB of sources that JIT-compile each kernel at first use (minutes of device time). This builds the
decode kernels (its CUDA-core decode module and its tensor-core prefill modules, bf16, per head dim)
for sm_90a, puts them where FlashInfer looks for ahead-of-time modules (flashinfer/data/aot/<name>/),
and keeps only the Python modules an import and a decode plan load, plus the templates the plan reads.
The kernels link against a stub libcuda (this machine has no driver); libcudart.so.13 is the one
torch loads there.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RECORD = r'''
import json, sys, torch
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, prefill
from flashinfer.jit.attention.modules import gen_batch_decode_module
for d in (int(x) for x in sys.argv[2].split(",")):
    args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, d, d, 0, False, False, False)
    specs = [gen_batch_decode_module(*args[:-1])]
    specs += [gen("fa2", *args) for gen in (prefill._gen_batch_prefill_primary_module,
                                            prefill._gen_batch_prefill_independent_paged_module)]
    for spec in specs:
        try:
            spec.build_and_load()  # compiles; the link fails here (no libcuda), relinked below
        except Exception:
            pass
        print("MODULE", spec.name, flush=True)
files = {getattr(m, "__file__", None) or "" for m in list(sys.modules.values())}
json.dump(sorted(f for f in files if f.startswith(sys.argv[1])), open(sys.argv[1] + "/loaded.json", "w"))
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--work", default="/tmp/flashinfer_prebuild")
    p.add_argument("--python-version", default="3.12", help="the GPU machines' Python (for apache-tvm-ffi)")
    args = p.parse_args()
    site, jit = os.path.join(args.work, "site"), os.path.join(args.work, "jit")
    os.makedirs(site, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(pip + ["install", "-q", "--no-deps", "--target", site, "flashinfer-python", "apache-tvm-ffi",
                          "requests", "urllib3", "idna", "certifi", "charset-normalizer", "einops", "tabulate",
                          "click", "nvidia-ml-py", "ninja"], check=True)
    env = {**os.environ, "PYTHONPATH": site, "FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": jit}
    out = subprocess.run([sys.executable, "-c", _RECORD, site, args.head_dims], env=env, text=True,
                         stdout=subprocess.PIPE, check=True).stdout
    names = [line.split()[1] for line in out.splitlines() if line.startswith("MODULE")]
    stub = os.path.join(args.work, "stub")
    os.makedirs(stub, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-x", "c", "-", "-o", os.path.join(stub, "libcuda.so"),
                    "-Wl,-soname,libcuda.so.1"], input="", text=True, check=True)
    cudart = os.path.dirname(glob.glob("/usr/local/cuda*/lib*/libcudart.so")[0])
    trim = os.path.join(args.work, "trim")
    shutil.rmtree(trim, ignore_errors=True)
    built = {os.path.basename(d): d for d, _, _ in os.walk(jit)}  # under jit/.cache/...: glob skips dot dirs
    for name in names:
        build = built[name]
        target = os.path.join(trim, "flashinfer", "data", "aot", name)
        os.makedirs(target)
        subprocess.run(["c++", *sorted(glob.glob(os.path.join(build, "*.o"))), "-shared", f"-L{cudart}", f"-L{stub}",
                        "-lcudart", "-lcuda", "-o", os.path.join(target, name + ".so")], check=True)
    package = os.path.join(site, "flashinfer")
    keep = {f for f in json.load(open(os.path.join(site, "loaded.json"))) if f.startswith(package)}
    for pattern in ("*.py", "jit/**/*.py", "attention/**/*.py", "utils/**/*.py", "data/csrc/batch_*.cu",
                    "data/csrc/batch_*.cuh", "data/csrc/*.jinja", "data/csrc/*.h"):
        keep |= set(glob.glob(os.path.join(package, pattern), recursive=True))
    for f in sorted(keep):
        dest = os.path.join(trim, os.path.relpath(f, site))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(f, dest)
    wheels = os.path.join(REPO, ".whl")
    os.makedirs(wheels, exist_ok=True)
    tar = os.path.join(wheels, "flashinfer_decode_sm90a.tar")
    subprocess.run(["tar", "cf", tar, "-C", trim, "flashinfer"], check=True)
    subprocess.run(pip + ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", args.python_version,
                          "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", wheels,
                          "apache-tvm-ffi"], check=True)
    print(f"{tar}: {os.path.getsize(tar) / 2**20:.1f} MiB, {len(names)} modules: " + ", ".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
