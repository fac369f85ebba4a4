"""Task `moe_language_modeling`: fairseq's language_modeling task plus expert statistics
(see expert_stats.py). fairseq-eval-lm needs no task of ours: --task language_modeling reads our models."""
from dataclasses import dataclass

from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from .expert_stats import ExpertStatsConfig, MoETaskMixin


@dataclass
class MoELanguageModelingConfig(LanguageModelingConfig, ExpertStatsConfig):
    pass


@register_task("moe_language_modeling", dataclass=MoELanguageModelingConfig)
class MoELanguageModelingTask(MoETaskMixin, LanguageModelingTask):
    moe_task_name = "moe_language_modeling"
