"""The plugin registers its model, architectures, criterions and task with fairseq."""
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY

import fairseq_moe  # noqa: F401  (loaded as a plugin by conftest.py)


def test_everything_registered():
    assert "moe_transformer" in MODEL_REGISTRY
    for arch in ("moe_transformer", "moe_transformer_tiny", "moe_transformer_iwslt_de_en",
                 "moe_transformer_wmt_en_de", "moe_transformer_vaswani_wmt_en_de_big"):
        assert ARCH_MODEL_REGISTRY[arch].__name__ == "MoETransformerModel", arch
    assert {"moe_cross_entropy", "moe_label_smoothed_cross_entropy"} <= set(CRITERION_REGISTRY)
    assert "moe_transformer_lm" in MODEL_REGISTRY
    for arch in ("moe_transformer_lm", "moe_transformer_lm_tiny", "moe_transformer_lm_gpt",
                 "moe_transformer_lm_gpt2_small", *(f"moe_{a}" for a in GPU_LM_ARCHS)):
        assert ARCH_MODEL_REGISTRY[arch].__name__ == "MoETransformerLanguageModel", arch
    assert {"moe_translation", "moe_language_modeling"} <= set(TASK_REGISTRY)


GPU_LM_ARCHS = ("transformer_lm_gpt2_medium", "transformer_lm_gpt2_big", "transformer_lm_gpt3_small",
                "transformer_lm_gpt3_medium", "transformer_lm_gpt3_large", "transformer_lm_gpt3_xl")


def test_gpu_lm_archs_have_the_dense_sizes():
    """moe_transformer_lm_gpt2_medium ... _gpt3_xl: the dense arch's sizes and settings, plus the MoE defaults."""
    from argparse import Namespace

    from fairseq.models import ARCH_CONFIG_REGISTRY

    for arch in GPU_LM_ARCHS:
        dense, moe = Namespace(), Namespace()
        ARCH_CONFIG_REGISTRY[arch](dense)
        ARCH_CONFIG_REGISTRY[f"moe_{arch}"](moe)
        assert {k: v for k, v in vars(moe).items() if k in vars(dense)} == vars(dense), arch
        assert moe.moe_expert_count == 8 and moe.moe_freq == 2, arch
