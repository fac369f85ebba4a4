"""Task `moe_translation_multi_simple_epoch`: fairseq's multilingual translation_multi_simple_epoch (its language
tokens, --lang-pairs, sampling over the pairs: the task NLLB-MoE trained with) plus what the MoE tasks add (MoE
losses and metrics through the criterion, expert statistics, lockstep validation with spread experts:
expert_stats.py). fairseq 0.12's task is an argparse task, so its flags are added here with the statistics' flags."""
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.tasks import register_task
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask

from .expert_stats import ExpertStatsConfig, MoETaskMixin


@register_task("moe_translation_multi_simple_epoch")
class MoETranslationMultiSimpleEpochTask(MoETaskMixin, TranslationMultiSimpleEpochTask):
    moe_task_name = "moe_translation_multi_simple_epoch"

    @staticmethod
    def add_args(parser):
        TranslationMultiSimpleEpochTask.add_args(parser)
        gen_parser_from_dataclass(parser, ExpertStatsConfig())
