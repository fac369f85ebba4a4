"""Criterions moe_cross_entropy and moe_label_smoothed_cross_entropy.

loss = task loss + moe_gate_loss_wt * balance loss + moe_z_loss_wt * z-loss. The logged `loss` and
`nll_loss` stay the task's own (comparable with a dense run); the router terms are logged beside them.
"""
from dataclasses import dataclass, fields

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from .moe_loss import MoELossConfig, add_moe_loss, check_moe_loss_config, reduce_moe_metrics


class MoECriterionMixin:
    """Adds the router losses to the parent criterion's loss; keeps the parent's metrics. The parent's
    __init__ stays as it is: its MoELossConfig is read from the criterion's config at build time."""

    @classmethod
    def build_criterion(cls, cfg, task):
        criterion = super().build_criterion(cfg, task)
        moe_cfg = MoELossConfig(**{f.name: getattr(cfg, f.name, f.default) for f in fields(MoELossConfig)})
        check_moe_loss_config(moe_cfg)
        criterion.moe_cfg = moe_cfg
        return criterion

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
    pass


@dataclass
class MoELabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, MoELossConfig):
    pass


@register_criterion("moe_label_smoothed_cross_entropy", dataclass=MoELabelSmoothedCrossEntropyConfig)
class MoELabelSmoothedCrossEntropyCriterion(MoECriterionMixin, LabelSmoothedCrossEntropyCriterion):
    pass
