"""The `moe_transformer_lm` model: fairseq's decoder-only transformer LM with MoE in every N-th layer.

Layer i (0-based) is MoE when (i + 1) % freq == 0, freq being --decoder-moe-freq or else --moe-freq.
Everything else (embeddings, adaptive input, positions, norms, the flags) is fairseq's transformer_lm,
so `fairseq-eval-lm`, `fairseq-generate`/`-interactive` and the hub interface work as with it.
"""

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models import transformer_lm as dense_lm
from fairseq.models.transformer import TransformerDecoder

from .. import patches
from .moe_transformer import (MoEModelMixin, MoETransformerDecoder, add_moe_args, moe_base_architecture,
                              prepare_moe_build)


class MoETransformerLMDecoder(MoETransformerDecoder, TransformerDecoder):
    """fairseq's LM decoder (TransformerDecoder, built from args) whose layers MoETransformerDecoder picks."""


@register_model("moe_transformer_lm")
class MoETransformerLanguageModel(MoEModelMixin, dense_lm.TransformerLanguageModel):
    """Transformer language model whose FFN is a Mixture of Experts in every N-th layer."""

    @classmethod
    def add_args(cls, parser):
        # transformer_lm's flags (from its dataclass, no defaults: the archs set them) + ours.
        gen_parser_from_dataclass(parser, dense_lm.TransformerLanguageModelConfig(), delete_default=True)
        add_moe_args(parser, encoder=False)

    @classmethod
    def build_model(cls, args, task):
        args = prepare_moe_build(args, ("decoder",))
        # transformer_lm's build_model builds `TransformerDecoder` by name: let it build ours instead, so its
        # embedding and output choices stay fairseq's own rather than a copy of them. (A dense
        # transformer_lm built by another thread at the same moment would get ours too; fairseq builds
        # models on one.)
        with patches.scoped(dense_lm, "TransformerDecoder", MoETransformerLMDecoder):
            model = super().build_model(args, task)
        return model.finish_moe(args)


def _moe_lm(dense_arch):
    def arch(args):
        dense_arch(args)
        moe_base_architecture(args)
    return arch


moe_transformer_lm = register_model_architecture("moe_transformer_lm", "moe_transformer_lm")(
    _moe_lm(dense_lm.base_lm_architecture))
moe_transformer_lm_gpt = register_model_architecture("moe_transformer_lm", "moe_transformer_lm_gpt")(
    _moe_lm(dense_lm.transformer_lm_gpt))
moe_transformer_lm_gpt2_small = register_model_architecture(
    "moe_transformer_lm", "moe_transformer_lm_gpt2_small")(_moe_lm(dense_lm.transformer_lm_gpt2_small))


@register_model_architecture("moe_transformer_lm", "moe_transformer_lm_tiny")
def moe_transformer_lm_tiny(args):
    """For CPU runs: 4 layers, d=128, ffn 512, 4 heads; layers 2 and 4 are MoE with 4 experts."""
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 128)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 512)
    args.decoder_layers = getattr(args, "decoder_layers", 4)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.moe_expert_count = getattr(args, "moe_expert_count", 4)
    # Dropless at eval: with a capacity there, a sentence's output depends on the rest of its batch
    # (and with few experts fairseq's 0.25 would drop tokens by construction: k / E >= 0.25).
    args.moe_eval_capacity_token_fraction = getattr(args, "moe_eval_capacity_token_fraction", 0.0)
    moe_transformer_lm(args)
