from setuptools import setup

# variables/ and hops/ live at the top of the repository (as the layout asks) but install
# inside the torch_ext namespace, so no generic top-level module names reach site-packages.
setup(
    name="torch_ext",
    version="0.1.0",
    description="Wrap-semantics HOP tracing and a piecewise Inductor + CUDA-graph backend for torch.compile",
    python_requires=">=3.10",
    packages=[
        "torch_ext",
        "torch_ext.backend",
        "torch_ext.backend.split",
        "torch_ext.backend.compile",
        "torch_ext.backend.passes",
        "torch_ext.backend.rewrite",
        "torch_ext.backend.runtime",
        "torch_ext.backend.runtime.cudagraph",
        "torch_ext.backend.warm_start",
        "torch_ext.backend.dispatch",
        "torch_ext.compat",
        "torch_ext.demo",
        "torch_ext.kernels",
        "torch_ext.variables",
        "torch_ext.hops",
    ],
    package_dir={
        "torch_ext": "torch_ext",
        "torch_ext.variables": "variables",
        "torch_ext.hops": "hops",
    },
    install_requires=["torch>=2.9.1", "expecttest", "pytest", "depyf", "tqdm"],
    entry_points={
        "torch_dynamo_backends": ["torch_ext = torch_ext.backend:torch_ext_backend"],
    },
)
