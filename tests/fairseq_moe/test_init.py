"""The plugin registers its model, architectures, criterions and task with fairseq; a routing policy and a
gate registered by a test get their flags, checks and tests from the registries."""
import pytest
import torch
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


@pytest.mark.slow
def test_a_new_policy_and_gate_get_everything_from_the_registries():
    """A routing policy and a gate registered by a test (tests/fairseq_moe_layer/throwaway.py), with no other edit: their
    --moe-routing/--moe-gate choice and help, docs/flags.md's table line, the generic checks and refusals from the
    policy's properties, the contract tests and the 2-rank check of every policy and gate."""
    import argparse

    from fairseq_moe import refusals
    from fairseq_moe.errors import FlagError
    from fairseq_moe.models.moe_transformer import add_moe_args
    from fairseq_moe_layer import MoEConfig
    from fairseq_moe_layer.options import flag_table

    from tests.fairseq_moe_layer import test_comm, test_gates, test_routing_policies, throwaway

    with throwaway.registered():
        parser = argparse.ArgumentParser()
        add_moe_args(parser)
        args = parser.parse_args(["--moe-routing", throwaway.POLICY, "--moe-gate", throwaway.GATE])
        assert (args.moe_routing, args.moe_gate) == (throwaway.POLICY, throwaway.GATE)
        assert throwaway.BestExpert.help in " ".join(parser.format_help().split())
        assert throwaway.BestExpert.help in flag_table(MoEConfig)
        with pytest.raises(ValueError, match="--moe-top-k"):  # only_top_k = 1
            MoEConfig(model_dim=4, ffn_dim=4, num_experts=4, top_k=2, routing=throwaway.POLICY).validate()
        criterion = argparse.Namespace(moe_cfg=argparse.Namespace(moe_gate_loss_transform="neg_log"))
        with pytest.raises(FlagError, match=throwaway.POLICY):  # no balance loss: neg_log refused, by name
            refusals.check("trainer", refusals.Context(flags=argparse.Namespace(), criterion=criterion,
                                                       model=refusals._model_routed_by(throwaway.POLICY)))
        for k, capacity in [(1, 5), (1, None)]:
            test_routing_policies.test_policy_contract(throwaway.POLICY, k, capacity)
        for shape in [(0, 8), (2, 0, 8)]:
            test_routing_policies.test_every_policy_takes_zero_tokens(throwaway.POLICY, shape)
        for dtype in (torch.float32, torch.bfloat16):
            test_gates.test_gate_contract(throwaway.GATE, dtype, True)
        test_gates.test_gate_inside_layer(throwaway.GATE)
    test_comm.spawn(throwaway.check_on_ranks, 2)
