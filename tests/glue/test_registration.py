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
                 "moe_transformer_lm_gpt2_small"):
        assert ARCH_MODEL_REGISTRY[arch].__name__ == "MoETransformerLanguageModel", arch
    assert {"moe_translation", "moe_language_modeling"} <= set(TASK_REGISTRY)
