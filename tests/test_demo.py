"""`python -m torch_ext demo` parts and `python -m torch_ext doctor`: each runs and prints the facts
it claims (what torch alone does is pinned per torch version here, where the demo detects it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_ext
from torch_ext import compat, doctor
from torch_ext.__main__ import main as cli
from torch_ext.demo import PARTS, beyond_torch, piecewise_backend, show, torch29
from torch_ext.graph_summary import summarize


def _lines_fit(text: str) -> bool:
    return all(len(line) <= show.WIDTH for line in text.splitlines())


def _row(out: str, name: str) -> list[str]:
    (line,) = [line for line in out.splitlines() if line.strip().startswith(name)]
    return line.split()


def test_graph_summary_lists_ops_per_called_subgraph():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    with torch_ext.installed():
        torch.compile(beyond_torch.uses_keep_and_scale, backend=capture, fullgraph=True)(
            torch.randn(3), torch.randn(3))
    assert summarize(graphs[0]) == [
        "forward       6 ops  invoke_subgraph×2, getitem×2, mul, add",
        "subgraph_0    1 op   mul",
    ]


def test_beyond_part_shows_torch_refusing_and_torch_ext_compiling(capsys):
    facts = beyond_torch.run()
    out = capsys.readouterr().out
    # Refused by torch alone on every tested version (2.9.1, 2.13, 2.14); compiled with torch_ext.
    assert out.count("torch alone          refused:") == 2
    assert "Encountered aliasing during higher order op tracing" in out
    assert out.count("torch_ext.install()  compiled, 1 graph;") == 2
    assert "outputs, grads equal eager (batch 3, 6, 10): True" in out
    assert "subgraph_0    1 op   mul" in out
    assert all(not f["vanilla_compiled"] and f["equal_eager"] for f in facts.values())
    assert _lines_fit(out)


def test_torch29_part_says_how_to_get_the_venv_when_absent(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch29, "PACKAGE_PARENT", tmp_path)
    monkeypatch.chdir(tmp_path)
    assert torch29.run() == {"skipped": True}
    out = capsys.readouterr().out
    assert "skipped: no .venv-torch2.9.1 here; `make test-2.9.1` builds it" in out


@pytest.mark.slow
def test_torch29_part_runs_its_probe_in_the_other_interpreter(monkeypatch, capsys):
    # This interpreter stands in for the 2.9.1 venv: the same subprocess, JSON and report.
    monkeypatch.setattr(torch29, "find_python", lambda: Path(sys.executable))
    facts = torch29.run()
    out = capsys.readouterr().out
    assert f"in .venv-torch2.9.1 (torch {torch.__version__}), a region returns a dataclass:" in out
    assert "torch_ext.install()  compiled, 1 graph; outputs, grads equal eager: True" in out
    if compat.TORCH_HAS_WRAP_SEMANTICS:  # 2.10+ traces a returned dataclass itself
        assert "torch alone          compiled, 1 graph" in out
    else:
        assert "torch alone          refused: NotImplementedError: UserDefinedObjectVariable(BlockOutput)" in out
    assert facts["torch_ext"]["equal_eager"]


@pytest.mark.slow
def test_backend_part_compiles_cold_then_loads_warm_in_a_new_process(capsys):
    facts = piecewise_backend.run()
    out = capsys.readouterr().out
    if compat.INDUCTOR_COMPILES_MUTATING_OPS_IN_REGIONS:
        assert "plain torch.compile (inductor), empty cache: compiled" in out and "equal eager: True" in out
    else:
        assert "plain torch.compile (inductor): refused" in out and "alias annotations" in out
    cold, warm = facts["cold"], facts["warm"]
    # 3 layers split at attention: 4 pieces, the 2 middle ones identical; compiled once each.
    assert (cold["pieces"], cold["unique_pieces"], cold["inductor_compiles"], cold["cache_hits"]) == (4, 3, 3, 0)
    assert (warm["pieces"], warm["unique_pieces"], warm["inductor_compiles"], warm["cache_hits"]) == (4, 3, 0, 3)
    assert cold["equal_eager"] and warm["equal_eager"]
    # The printed table: pieces, unique, compiles, hits, equal eager.
    assert _row(out, "cold, empty caches")[-5:] == ["4", "3", "3", "0", "True"]
    assert _row(out, "warm, new process")[-5:] == ["4", "3", "0", "3", "True"]
    assert "split graph: A > attention > B > attention > B > attention > C" in out
    assert _lines_fit(out)


def test_cli_help_lists_the_parts(capsys):
    with pytest.raises(SystemExit):
        cli(["demo", "--help"])
    out = capsys.readouterr().out
    for name, (_, description) in PARTS.items():
        assert f"  {name:<9} {description}" in out


def test_cli_runs_one_part_alone(capsys):
    assert cli(["demo", "--part", "beyond"]) == 0
    out = capsys.readouterr().out
    assert "== beyond:" in out and "== backend:" not in out and "== torch29:" not in out


def test_doctor_reports_versions_and_a_missing_cache_dir_without_creating_it(monkeypatch, tmp_path, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCH_EXT_CACHE_DIR", str(cache))
    assert doctor.main() == 0
    out = capsys.readouterr().out
    release = torch.__version__.split("+")[0]
    tested = "tested" if release in compat.TESTED_TORCH_VERSIONS else "NOT a tested version"
    assert f"torch           {torch.__version__} ({tested}; CI runs 2.9.1, 2.11.0, 2.13.0, 2.14.1, 2.15.0)" in out
    assert f"cache dir       {cache}  (from $TORCH_EXT_CACHE_DIR" in out
    assert "does not exist yet; the first compile can create it" in out
    assert "install()       not active in this process" in out
    assert not cache.exists()


def test_doctor_reports_cache_size_and_refuses_what_the_backend_refuses(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    (cache / "model").mkdir(parents=True, mode=0o700)
    os.chmod(cache, 0o700)
    (cache / "model" / "entry.bin").write_bytes(b"x" * 2**20)
    monkeypatch.setenv("TORCH_EXT_CACHE_DIR", str(cache))
    report = doctor.report()
    assert "1.0 MiB in 1 files, 1 model dirs; mode 700, owner you, writable" in report
    assert "the backend will use it" in report
    os.chmod(cache, 0o777)
    assert "the backend REFUSES it: torch_ext refuses cache directory" in doctor.report()
    with torch_ext.installed():
        assert "install()       active in this process" in doctor.report()


def test_doctor_names_cuda_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert doctor.cuda_line() == "1 device(s), torch built with CUDA 13.0; 0: NVIDIA H100 80GB HBM3 (sm_90)"


def test_doctor_command_runs():
    done = subprocess.run([sys.executable, "-m", "torch_ext", "doctor"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.__version__ in done.stdout and "cache dir" in done.stdout
