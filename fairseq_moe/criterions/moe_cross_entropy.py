"""Criterions moe_cross_entropy and moe_label_smoothed_cross_entropy.

loss = task loss + moe_gate_loss_wt * balance loss + moe_z_loss_wt * z-loss. The logged `loss` and
`nll_loss` stay the task's own (comparable with a dense run); the router terms are logged beside them.
"""
from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from .moe_loss import MoELossConfig, add_moe_loss, check_moe_loss_config, reduce_moe_metrics


class MoECriterionMixin:
    """Adds the router losses to the parent criterion's loss; keeps the parent's metrics."""

    def init_moe(self, cfg):
        check_moe_loss_config(cfg)
        self.moe_cfg = cfg

    def forward(self, model, sample, reduce=True):
        # (adaptive softmax, which these criterions cannot train, is refused before: refusals.py)
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        loss = add_moe_loss(self.moe_cfg, model, loss, sample_size, logging_output)
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs):
        super().reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)


@dataclass
class MoECrossEntropyConfig(CrossEntropyCriterionConfig, MoELossConfig):
    pass


@register_criterion("moe_cross_entropy", dataclass=MoECrossEntropyConfig)
class MoECrossEntropyCriterion(MoECriterionMixin, CrossEntropyCriterion):
    def __init__(self, task, sentence_avg, moe_gate_loss_wt, moe_gate_loss_combine_method,
                 moe_gate_loss_transform, moe_z_loss_wt):
        super().__init__(task, sentence_avg)
        self.init_moe(MoELossConfig(moe_gate_loss_wt, moe_gate_loss_combine_method,
                                    moe_gate_loss_transform, moe_z_loss_wt))


L = MoELossConfig  # its defaults are the loss flags' defaults, also as keyword arguments below


@dataclass
class MoELabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, MoELossConfig):
    pass


@register_criterion("moe_label_smoothed_cross_entropy", dataclass=MoELabelSmoothedCrossEntropyConfig)
class MoELabelSmoothedCrossEntropyCriterion(MoECriterionMixin, LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 moe_gate_loss_wt=L.moe_gate_loss_wt, moe_gate_loss_combine_method=L.moe_gate_loss_combine_method,
                 moe_gate_loss_transform=L.moe_gate_loss_transform, moe_z_loss_wt=L.moe_z_loss_wt):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.init_moe(MoELossConfig(moe_gate_loss_wt, moe_gate_loss_combine_method,
                                    moe_gate_loss_transform, moe_z_loss_wt))
