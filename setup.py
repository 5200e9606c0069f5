"""areal-mcore: AReaL v0.2 "boba" RL recipe on a megatron-core actor with SGLang rollout."""

from setuptools import find_packages, setup

# Ranges, for installs into NVIDIA containers (docs/install.md): torch is a range, not a pin,
# so GPU users keep the CUDA build their container ships. The Makefile installs from the lock
# files in locks/ instead (exact versions and hashes, the CPU torch 2.13.0); `make lock`
# regenerates them from these ranges and `make check-latest` tries the newest they allow.
INSTALL_REQUIRES = [
    "torch>=2.6",
    # A tested range, not a pin, so NVIDIA containers keep their megatron-core: `make test`
    # runs the megatron tests on both ends (0.16.1 on Python 3.11, 0.19.2 on 3.12; 0.17+
    # needs Python >= 3.12). Version-dependent code lives in areal_mcore/model/mcore_compat.py.
    "megatron-core>=0.16.1,<0.20",
    # megatron's dist_checkpointing saves hang without psutil, which it does not declare.
    "psutil",
    "omegaconf>=2.3",
    "numpy",
    "pyyaml",
    "safetensors",
    "tqdm",
    # the trainer's per-step scalars and its reward/accuracy plot
    "tensorboard",
    "matplotlib",
    # areal-mcore launch (Slurm jobs with requeue); 1.5.4 is tested against slurm-wlm 22.05
    "submitit>=1.5",
    # the boba reward; antlr4 4.13.2 is the LaTeX parser runtime it needs
    "math-verify[antlr4_13_2]==0.9.0",
    # the embedded rollout server (HTTP both ways) and its model; the engine uses the
    # transformers 5 cache API (DynamicCache layers).
    "aiohttp>=3.9",
    "transformers>=5.0",
    # dataset.path as Parquet/JSON files, folders, save_to_disk folders and hub ids
    # (data/sources.py); JSONL needs nothing beyond the standard library.
    "datasets>=3",
    # `areal-mcore doctor`'s GPU checks (NVML); pure Python, it loads the driver's
    # libnvidia-ml at run time and reports its absence as an NVML error.
    "nvidia-ml-py",
]

EXTRAS_REQUIRE = {
    # NVIDIA apex is not on PyPI; it comes with NVIDIA's PyTorch containers and is
    # detected at run time (areal_mcore/accel.py), like transformer-engine.
    "gpu": ["transformer-engine[pytorch]", "sglang"],
    # triton: the kernels' tests run it on CPU through its interpreter (3.9 is tested;
    # GPU installs get it with CUDA torch anyway).
    # msgspec + pydantic: the contract tests run SGLang's own request structs (tests/_sglang.py).
    "dev": ["pytest", "hypothesis", "pytest-timeout", "pytest-xdist", "ruff", "triton", "msgspec", "pydantic", "wandb"],
    # trainer.wandb (trainer/wandb_log.py); imported only when trainer.wandb.mode is not disabled.
    "wandb": ["wandb"],
}

setup(
    name="areal-mcore",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.10",
    packages=find_packages(include=["areal_mcore", "areal_mcore.*"]) + ["areal_mcore.kernels"],
    # The top-level kernels/ folder ships inside the package as areal_mcore.kernels.
    package_dir={"areal_mcore.kernels": "kernels"},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["areal-mcore=areal_mcore.cli:main"]},
)
