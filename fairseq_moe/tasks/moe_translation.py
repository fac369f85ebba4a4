"""Task `moe_translation`: fairseq's translation task plus expert statistics (see expert_stats.py)."""
from dataclasses import dataclass

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..errors import FlagError
from ..models.moe_ffn import moe_blocks
from .expert_stats import ExpertStatsConfig, MoETaskMixin


@dataclass
class MoETranslationConfig(TranslationConfig, ExpertStatsConfig):
    pass


@register_task("moe_translation", dataclass=MoETranslationConfig)
class MoETranslationTask(MoETaskMixin, TranslationTask):
    cfg: MoETranslationConfig
    moe_task_name = "moe_translation"

    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.init_moe_task(cfg)

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        if self.cfg.eval_bleu and any(block.moe.ep is not None for _, block in moe_blocks(model)):
            # Every MoE forward is then a collective, and beam search stops after a different
            # number of steps on each rank: the ranks would wait for each other forever.
            raise FlagError(
                "--eval-bleu cannot run with the experts spread over several ranks (beam search "
                "takes a different number of steps on each rank, and every MoE layer is a "
                "collective); validate the loss here and score BLEU with fairseq-generate"
            )
        return model
