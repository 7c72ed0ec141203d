"""The compiled-module disk cache of our NVRTC kernels (kernels/module_cache.py), on the CPU: NVRTC and the
driver's loader are stood in for, the files are real. The GPU side (a real kernel loaded in a new process
without NVRTC) is in tests/test_decode_linear_mma_gpu.py."""
import logging
import os

import pytest
import torch

from torch_ext import compat
from torch_ext.kernels import module_cache


class FakeKernel:
    def __init__(self, image: bytes, name: str):
        self.image, self.name = image, name


@pytest.fixture
def nvrtc(monkeypatch, tmp_path):
    """NVRTC and cuModuleLoadData stood in for; the compiles made, the images loaded."""
    calls = {"compiled": [], "loaded": []}

    def nvrtc_compile(source, name):
        calls["compiled"].append(source)
        return b"IMAGE\n\n\x00" + source.encode(), "_Z" + name  # blank lines and NULs: an image is binary

    def load(image, name):
        if not image.startswith(b"IMAGE"):
            raise RuntimeError("CUDA error: device kernel image is invalid")
        calls["loaded"].append(image)
        return FakeKernel(image, name)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compat, "nvrtc_compile", nvrtc_compile)
    monkeypatch.setattr(compat, "load_cuda_module", load)
    monkeypatch.setattr(compat, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    calls["dir"] = tmp_path / module_cache.SUBDIR
    return calls


def test_a_second_process_loads_the_image_instead_of_compiling(nvrtc):
    first = module_cache.compiled("kernel A", "k")
    assert nvrtc["compiled"] == ["kernel A"]
    assert (first.image, first.name) == (b"IMAGE\n\n\x00kernel A", "_Zk")
    again = module_cache.compiled("kernel A", "k")  # as a new process would: the file, not NVRTC
    assert nvrtc["compiled"] == ["kernel A"]
    assert (again.image, again.name) == (first.image, first.name)
    other = module_cache.compiled("kernel B", "k")  # another source is another entry
    assert nvrtc["compiled"] == ["kernel A", "kernel B"] and other.image.endswith(b"kernel B")
    assert len(os.listdir(nvrtc["dir"])) == 2


def test_the_key_holds_the_device_and_the_versions(nvrtc, monkeypatch):
    module_cache.compiled("kernel A", "k")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    module_cache.compiled("kernel A", "k")
    monkeypatch.setattr(compat, "nvrtc_version", lambda: "13.1")
    module_cache.compiled("kernel A", "k")
    assert len(nvrtc["compiled"]) == 3 and len(os.listdir(nvrtc["dir"])) == 3


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "empty", "foreign"])
def test_a_damaged_file_is_compiled_again_and_replaced_never_loaded(nvrtc, caplog, damage):
    module_cache.compiled("kernel A", "k")
    (path,) = nvrtc["dir"].iterdir()
    data = path.read_bytes()
    damaged = {"flipped byte": data[:-1] + bytes([data[-1] ^ 1]), "truncated": data[:-3], "empty": b"",
               "foreign": b"\x7fELF not ours"}[damage]
    path.write_bytes(damaged)
    nvrtc["loaded"].clear()
    with caplog.at_level(logging.WARNING, logger="torch_ext.kernels"):
        kernel = module_cache.compiled("kernel A", "k")
    assert "damaged" in caplog.text and str(path) in caplog.text
    assert nvrtc["loaded"] == [b"IMAGE\n\n\x00kernel A"] and kernel.image == b"IMAGE\n\n\x00kernel A"
    assert len(nvrtc["compiled"]) == 2 and path.read_bytes() == data


def test_an_image_the_driver_refuses_is_compiled_again(nvrtc, caplog):
    module_cache.compiled("kernel A", "k")
    (path,) = nvrtc["dir"].iterdir()
    data = path.read_bytes()
    module_cache._save(str(path), b"REFUSED", "_Zk")  # intact on disk (its digest matches), not loadable here
    with caplog.at_level(logging.WARNING, logger="torch_ext.kernels"):
        kernel = module_cache.compiled("kernel A", "k")
    assert "refused" in caplog.text and kernel.image == b"IMAGE\n\n\x00kernel A"
    assert len(nvrtc["compiled"]) == 2 and path.read_bytes() == data


def test_a_refused_fresh_compile_raises_and_saves_nothing(nvrtc, monkeypatch):
    monkeypatch.setattr(compat, "nvrtc_compile", lambda source, name: (b"garbage", name))
    with pytest.raises(RuntimeError, match="invalid"):
        module_cache.compiled("kernel A", "k")
    assert not nvrtc["dir"].exists() or not list(nvrtc["dir"].iterdir())


def test_no_disk_cache_where_inductor_caches_are_forced_off(nvrtc):
    with torch._inductor.config.patch(force_disable_caches=True):  # an alias: patch, not setattr
        module_cache.compiled("kernel A", "k")
        module_cache.compiled("kernel A", "k")
    assert len(nvrtc["compiled"]) == 2 and not nvrtc["dir"].exists()


def test_an_unwritable_directory_costs_a_compile_only(nvrtc, monkeypatch, caplog):
    nvrtc["dir"].parent.mkdir(parents=True, exist_ok=True)
    nvrtc["dir"].write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger="torch_ext.kernels"):
        kernel = module_cache.compiled("kernel A", "k")
    assert kernel.image.endswith(b"kernel A") and "cannot save" in caplog.text


def test_no_nvrtc_means_no_compiler(monkeypatch):
    monkeypatch.setattr(compat, "nvrtc_available", lambda: False)
    assert module_cache.compiler() is None
