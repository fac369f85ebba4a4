"""The `moe_transformer_lm` model: fairseq's transformer_lm (embeddings, adaptive input, positions, norms,
flags: all fairseq's) with MoE in every N-th layer, so fairseq-eval-lm, -generate and the hub work as with it.
"""

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model
from fairseq.models import transformer_lm as dense_lm
from fairseq.models.transformer import TransformerDecoder

from .. import patches
from .moe_transformer import TINY, MoEModelMixin, MoETransformerDecoder, add_moe_args, moe_arch, prepare_moe_build


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
        # transformer_lm's build_model builds `TransformerDecoder` by name: ours, so that its embedding and
        # output choices stay fairseq's own (a model built by another thread meanwhile would get ours too).
        with patches.scoped(dense_lm, "TransformerDecoder", MoETransformerLMDecoder):
            model = super().build_model(args, task)
        return model.finish_moe(args)


moe_transformer_lm = moe_arch("moe_transformer_lm", "moe_transformer_lm", dense_lm.base_lm_architecture)
moe_transformer_lm_gpt = moe_arch("moe_transformer_lm", "moe_transformer_lm_gpt", dense_lm.transformer_lm_gpt)
moe_transformer_lm_gpt2_small = moe_arch("moe_transformer_lm", "moe_transformer_lm_gpt2_small",
                                         dense_lm.transformer_lm_gpt2_small)
# GPU sizes: fairseq's GPT-2 medium and big, and GPT-3's sizes (Brown et al. 2020, table 2.1) as fairseq's
# transformer_lm_gpt3_* (the dense sizes; the experts multiply the FFN parameters, not the compute per token).
for _size in ("gpt2_medium", "gpt2_big", "gpt3_small", "gpt3_medium", "gpt3_large", "gpt3_xl"):
    moe_arch("moe_transformer_lm", f"moe_transformer_lm_{_size}", getattr(dense_lm, f"transformer_lm_{_size}"))
# For CPU runs: 4 layers, d=128, ffn 512, 4 heads; layers 2 and 4 are MoE with 4 experts (TINY: dropless at eval).
moe_transformer_lm_tiny = moe_arch("moe_transformer_lm", "moe_transformer_lm_tiny", dense_lm.base_lm_architecture,
                                   **TINY, decoder_embed_dim=128, decoder_ffn_embed_dim=512, decoder_layers=4,
                                   decoder_attention_heads=4)
