"""Task `moe_translation`: fairseq's translation task plus expert statistics (see expert_stats.py)."""
from dataclasses import dataclass

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .expert_stats import ExpertStatsConfig, MoETaskMixin


@dataclass
class MoETranslationConfig(TranslationConfig, ExpertStatsConfig):
    pass


@register_task("moe_translation", dataclass=MoETranslationConfig)
class MoETranslationTask(MoETaskMixin, TranslationTask):
    cfg: MoETranslationConfig
    moe_task_name = "moe_translation"
