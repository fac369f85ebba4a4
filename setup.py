"""fairseq-moe: Mixture-of-Experts transformers as a fairseq plugin."""
from setuptools import find_packages, setup

setup(
    name="fairseq-moe",
    version="0.1.0",
    description="Mixture-of-Experts transformers for fairseq: a plugin (--user-dir fairseq_moe)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # Three packages, three floors: fairseq_moe (the glue, the only one that imports fairseq), fairseq_moe_layer,
    # fairseq_moe_kernels (not "kernels": that would overwrite, or be overwritten by, Hugging Face's `kernels`).
    # The MoE layer is a package of its own, fairseq_moe_layer: a plain-PyTorch program imports it without
    # fairseq_moe/__init__ (the plugin's door to fairseq) ever running.
    packages=find_packages(include=["fairseq_moe", "fairseq_moe.*", "fairseq_moe_layer", "fairseq_moe_layer.*",
                                    "fairseq_moe_kernels", "fairseq_moe_kernels.*"]),
    package_data={"fairseq_moe_kernels": ["*.c"]},  # (cpu_adam.c: compiled at first use, cpu_adam.py)
    install_requires=[
        "torch>=2.1",
        # fairseq 0.12.2 does not install on Python 3.11; ve-fairseq ships fairseq 0.12.3 for it.
        'fairseq>=0.12.2; python_version < "3.11"',
        've-fairseq==0.12.3; python_version >= "3.11"',
        'triton; platform_system == "Linux"',
        "hydra-core>=1.0.7",
        "numpy",
        "sacrebleu>=2.0",
        "sentencepiece",
        "matplotlib",
        # fairseq's --tensorboard-logdir writes through torch.utils.tensorboard (needs the tensorboard
        # package) or, without it, tensorboardX: the small one.
        "tensorboardX",
    ],
    # transformers: export_hf / import_hf, and the tests that check them and moe_mixtral_lm against its NllbMoe, Mixtral,
    # Qwen2-MoE, Qwen3-MoE and OLMoE; 4.57 is the last series with NllbMoe beside torch 2.13. Never needed to train.
    extras_require={"test": ["pytest>=7", "pytest-xdist>=3", "transformers>=4.57,<4.58"],
                    "hf": ["transformers>=4.57,<4.58"]},
)
