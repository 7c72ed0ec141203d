"""Warm start of Hugging Face `generate` (static cache) in real processes on one cache dir: the
second process loads the programs saved by the first (prefill and decode: one entry per kind of
call), traces nothing and gives the same tokens as eager; a changed model config or dtype never
loads the old programs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from torch_ext import compat

pytest.importorskip("transformers")
WORKER = os.path.join(os.path.dirname(__file__), "hf_generate_worker.py")
pytestmark = [pytest.mark.skipif(not compat.HAS_AOT_COMPILE, reason="this torch has no AOT compile: no warm start"),
              pytest.mark.slow]  # each test runs two or three fresh processes (~15 s each on CI)


def run_worker(cache_dir, *extra, timeout=600):
    out = subprocess.run([sys.executable, WORKER, str(cache_dir), *extra], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(counters) -> tuple[int, int, int]:
    return counters["warm_start_loads"], counters["warm_start_saves"], counters["warm_start_fallbacks"]


@pytest.mark.parametrize("arch, pieces", [("llama", "inductor"), ("mistral", "fx")])
def test_second_process_loads_generate_programs_and_gives_eagers_tokens(tmp_path, arch, pieces):
    extra = ("--arch", arch) + (("--fx-pieces",) if pieces == "fx" else ())
    cold = run_worker(tmp_path, *extra)
    assert cold["tokens"] == cold["expected"]
    assert warm(cold["counters"]) == (0, 2, 0)  # prefill and decode, traced and saved
    again = run_worker(tmp_path, *extra)
    assert warm(again["counters"]) == (2, 0, 0)
    assert again["dynamo_frames"].get("total", 0) == 0  # Dynamo never saw a frame
    assert again["tokens"] == cold["tokens"] == again["expected"]
    if pieces == "inductor":
        assert again["counters"]["inductor_compiles"] == 0 and again["counters"]["cache_hits"] > 0


@pytest.fixture(scope="module")
def saved_default_model(tmp_path_factory):
    """The cache dir of one process of the default model (copied by each test that starts from it)."""
    cache_dir = tmp_path_factory.mktemp("default_model")
    first = run_worker(cache_dir, "--fx-pieces")
    assert warm(first["counters"]) == (0, 2, 0)
    return cache_dir


@pytest.mark.parametrize("change", [("--layers", "3"), ("--dtype", "float64"), ("--rope-theta", "500.0")],
                         ids=["config layers", "dtype", "config value"])
def test_changed_config_or_dtype_does_not_load_the_old_program(tmp_path, saved_default_model, change):
    shutil.copytree(saved_default_model, tmp_path, dirs_exist_ok=True)
    changed = run_worker(tmp_path, "--fx-pieces", *change)
    assert warm(changed["counters"]) == (0, 2, 0)  # traced and saved anew, nothing loaded
    assert changed["tokens"] == changed["expected"]


def test_another_prompt_length_gets_the_dynamic_prefill_saved_for_the_next_process(tmp_path, saved_default_model):
    shutil.copytree(saved_default_model, tmp_path, dirs_exist_ok=True)  # the default prompt: 6 tokens
    longer = run_worker(tmp_path, "--fx-pieces", "--prompt", "9")
    # generate sizes the static cache to prompt + new tokens: both saved programs load and refuse the
    # calls (other sizes), both dynamic ones are traced and saved
    assert warm(longer["counters"]) == (2, 2, 0) and longer["tokens"] == longer["expected"]
    third = run_worker(tmp_path, "--fx-pieces", "--prompt", "11")
    assert warm(third["counters"]) == (4, 0, 0) and third["dynamo_frames"].get("total", 0) == 0
    assert third["tokens"] == third["expected"]


def test_guard_free_dispatch_serves_many_generates_from_the_loaded_programs(tmp_path):
    """Each generate passes a new cache object, which guard-free dispatch checks by identity: the saved
    guards take the call and its variant replaces the oldest, never a trace (nor a torch.compile)."""
    run_worker(tmp_path, "--fx-pieces", "--guard-free")
    served = run_worker(tmp_path, "--fx-pieces", "--guard-free", "--generates", "6")
    assert warm(served["counters"]) == (2, 0, 0) and served["dynamo_frames"].get("total", 0) == 0
    assert served["tokens"] == served["expected"]
