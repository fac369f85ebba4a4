"""Criterion moe_distillation: word-level knowledge distillation from a frozen teacher, with the router losses of an
MoE student.

    loss = (1 - a) * label-smoothed NLL + a * T^2 * sum over target tokens of KL(q_T || p_T)

p_T = softmax(student logits / T), q_T = softmax(teacher logits / T): Kim & Rush (2016)'s word-level KD with Hinton
et al. (2015)'s temperature (T^2 keeps the term's gradients the size of T = 1's). --kd-topk K keeps the teacher's K
most likely tokens of each position, renormalised (q_T over those K, as Tan et al. (2019) keep the top 8): the
term is then sum_K q_T (log q_T - log p_T), which is >= 0 too (p_T is the student's full softmax). a: --kd-alpha,
T: --kd-temperature. Padding and --ignore-prefix-size's prefix count in neither term. For an MoE student the MoE
router losses are added as moe_label_smoothed_cross_entropy adds them (moe_loss.py); the logged `loss` is the
distillation objective without them, `nll_loss` the student's own, `kd_loss` the mean KL term (bits per token, as
fairseq logs its losses).

The teacher (--kd-teacher: a checkpoint file or set, as --path takes it; MoE or dense) is loaded once at build time
with the student's task (its dictionaries: a teacher of another vocabulary is refused by name), frozen, kept in eval
mode and out of the criterion's modules (fairseq neither trains it nor saves it with the student's checkpoints); it
is moved to the student's device and 16-bit dtype at its first forward. On W ranks each rank loads the teacher as
fairseq-generate does: an MoE teacher's experts spread over the ranks, which compute its forward together, as the
student's ranks do.

Sequence-level KD (Kim & Rush's other variant) needs no criterion: the teacher translates the training set with
fairseq-generate and the student trains on that (docs/shipping.md).
"""
import math
import os
from argparse import Namespace
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fairseq import metrics
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from fairseq_moe_layer.options import refusal, setting

from ..errors import CheckpointError, FlagError
from .moe_cross_entropy import MoECriterionMixin
from .moe_loss import MoELossConfig, add_moe_loss


@dataclass
class DistillationConfig:
    """The distillation settings (options.setting: fairseq reads the help, check_distillation the ranges)."""
    kd_teacher: str = setting("", "the teacher: a checkpoint file or set (as --path takes it), MoE or dense, trained "
                                  "with the student's dictionaries", "--kd-teacher", metavar="PATH")
    kd_alpha: float = setting(0.5, "weight of the distillation term; 1 - it weights the label-smoothed NLL",
                              "--kd-alpha", ge=0, le=1)
    kd_temperature: float = setting(1.0, "the temperature T of both softmaxes in the distillation term (which is "
                                         "scaled by T^2)", "--kd-temperature", gt=0)
    kd_topk: int = setting(0, "keep the teacher's K most likely tokens per position, renormalised (0: the whole "
                              "vocabulary)", "--kd-topk", ge=0, metavar="K")


def check_distillation(cfg):
    bad = refusal(DistillationConfig, cfg)
    if bad:
        raise FlagError(bad)
    if not cfg.kd_teacher:
        raise FlagError("--criterion moe_distillation needs --kd-teacher PATH (the teacher's checkpoint file or set)")


def kd_term(student_logits, teacher_logits, keep, temperature, topk=0, reduce=True):
    """KL(q_T || p_T) at each kept position (see the module's docstring), summed where reduce. student_logits,
    teacher_logits: [..., V]; keep: [...] bool (the target tokens that count); -> a 0-d fp32 tensor, or [n] (every
    position, flat; 0 where not kept) without reduce."""
    student = student_logits.float() / temperature
    if topk:  # (the teacher's K first: only [.., K] of it in fp32; the student's normaliser from its logsumexp)
        top, index = teacher_logits.topk(min(topk, teacher_logits.shape[-1]), dim=-1)
        log_q = F.log_softmax(top.float() / temperature, dim=-1)
        log_p = student.gather(-1, index) - student.logsumexp(-1, keepdim=True)
    else:
        log_q = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
        log_p = F.log_softmax(student, dim=-1)
    per_position = F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    per_position = torch.where(keep, per_position, 0.0)  # (not a boolean index: no read of the device)
    return per_position.sum() if reduce else per_position.reshape(-1)


def _embedding_rows(state, side):
    w = state["model"].get(f"{side}.embed_tokens.weight")
    return None if w is None else w.shape[0]


def _check_vocabulary(path, state, task):
    """One line naming --kd-teacher where the teacher's vocabulary is not the student's: its embedding sizes, then the
    dictionary files of the teacher's data folder where that folder is here."""
    for side, dictionary in (("encoder", getattr(task, "source_dictionary", None)),
                             ("decoder", getattr(task, "target_dictionary", None))):
        rows = _embedding_rows(state, side)
        if rows is not None and dictionary is not None and rows != len(dictionary):
            raise FlagError(f"--kd-teacher {path}: its {side} has a vocabulary of {rows} types, the student's "
                            f"dictionary {len(dictionary)}: distillation needs the teacher's dictionaries")
    task_cfg = (state.get("cfg") or {}).get("task")  # (a dict, or an argparse task's Namespace)
    theirs = str((vars(task_cfg) if isinstance(task_cfg, Namespace) else task_cfg or {}).get("data") or "")
    theirs = theirs.split(os.pathsep)[0]
    ours = str(getattr(getattr(task, "cfg", None), "data", None) or getattr(getattr(task, "args", None), "data", "")
               or "").split(os.pathsep)[0]  # (fairseq's legacy tasks keep theirs in task.args)
    if not theirs or not ours or not os.path.isdir(theirs) or os.path.realpath(theirs) == os.path.realpath(ours):
        return
    for name in sorted(os.listdir(theirs)):
        mine = os.path.join(ours, name)
        if name.startswith("dict") and name.endswith(".txt") and os.path.isfile(mine):
            with open(os.path.join(theirs, name), encoding="utf-8") as a, open(mine, encoding="utf-8") as b:
                if [line.split(" ")[0] for line in a] != [line.split(" ")[0] for line in b]:
                    raise FlagError(f"--kd-teacher {path}: its dictionary {os.path.join(theirs, name)} is not the "
                                    f"student's {mine}: distillation needs the teacher's dictionaries")


def load_teacher(path, task):
    """The teacher model of checkpoint path (file or set; on W ranks this rank's part, its experts spread), built
    with task (the student's), frozen and in eval mode, on the CPU in fp32."""
    from fairseq import checkpoint_utils, models

    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(path)  # (the plugin's: a file or a set, this rank's experts)
        _check_vocabulary(path, state, task)
        cfg = state["cfg"]
        model = models.build_model(cfg.model, task, from_checkpoint=True)
    except FlagError as e:  # (the teacher's own settings, or its experts and this world size)
        raise FlagError(e.args[0] if str(e).startswith("--kd-teacher") else f"--kd-teacher {path} (its own "
                        f"settings): {e}") from None
    except (CheckpointError, FileNotFoundError, IsADirectoryError) as e:
        raise FlagError(f"--kd-teacher {path}: {e}") from None
    try:
        model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    except RuntimeError as e:  # (torch's report after its first line: the keys missing, unexpected or of other sizes)
        detail = " ".join(line.strip() for line in str(e).strip().splitlines()[1:])
        raise FlagError(f"--kd-teacher {path}: its weights do not fit the model its own settings build: "
                        f"{detail[:300]}") from None
    decoder = getattr(model, "decoder", None)
    if getattr(decoder, "adaptive_softmax", None) is not None:
        raise FlagError(f"--kd-teacher {path}: a teacher with an adaptive softmax has no plain logits to distil")
    outputs = getattr(getattr(decoder, "output_projection", None), "out_features", None)
    target = getattr(task, "target_dictionary", None)
    if outputs is not None and target is not None and outputs != len(target):
        raise FlagError(f"--kd-teacher {path}: its output has {outputs} types, the student's dictionary "
                        f"{len(target)}: distillation needs the teacher's dictionaries")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@dataclass
class MoEDistillationConfig(LabelSmoothedCrossEntropyCriterionConfig, MoELossConfig, DistillationConfig):
    pass


@register_criterion("moe_distillation", dataclass=MoEDistillationConfig)
class MoEDistillationCriterion(MoECriterionMixin, LabelSmoothedCrossEntropyCriterion):
    """Word-level KD from --kd-teacher (see the module's docstring); the MoE router losses of an MoE student."""

    @classmethod
    def build_criterion(cls, cfg, task):
        check_distillation(cfg)
        criterion = super().build_criterion(cfg, task)
        criterion.kd_alpha, criterion.kd_temperature, criterion.kd_topk = cfg.kd_alpha, cfg.kd_temperature, cfg.kd_topk
        # A plain attribute, not a submodule: fairseq would otherwise move, cast, train and save it with the student.
        criterion.__dict__["teacher"] = load_teacher(cfg.kd_teacher, task)
        return criterion

    def teacher_logits(self, sample, student):
        """The teacher's logits for sample's inputs, without a graph; the teacher moved to the student's device, and
        to the dtype of its weights where those are 16-bit (--fp16, --bf16; under --amp the weights stay fp32 and so
        does the teacher, autocast computing it as it computes the student) at its first call."""
        teacher = self.__dict__["teacher"]
        p, mine = next(teacher.parameters()), next(student.parameters())
        dtype = mine.dtype if mine.dtype in (torch.float16, torch.bfloat16) else torch.float32
        if p.device != mine.device or p.dtype != dtype:
            teacher.to(device=mine.device, dtype=dtype)
        teacher.eval()
        with torch.no_grad():
            return teacher(**sample["net_input"])[0]

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        ls_loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        if not reduce:  # (fairseq's are [N, 1] where it ignores padding)
            ls_loss, nll_loss = ls_loss.reshape(-1), nll_loss.reshape(-1)
        teacher = self.teacher_logits(sample, model)
        student, target = net_output[0], model.get_targets(sample, net_output)
        if teacher.shape != student.shape:
            raise FlagError(f"--kd-teacher: the teacher's output {tuple(teacher.shape)} is not the student's "
                            f"{tuple(student.shape)} for the same batch")
        if self.ignore_prefix_size > 0:
            student, teacher = student[:, self.ignore_prefix_size:], teacher[:, self.ignore_prefix_size:]
            target = target[:, self.ignore_prefix_size:]
        kd = kd_term(student, teacher, target.ne(self.padding_idx), self.kd_temperature, self.kd_topk, reduce)
        a, T = self.kd_alpha, self.kd_temperature
        loss = (1 - a) * ls_loss + a * T * T * kd
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "kd_loss": kd.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"], logging_output["total"] = n_correct.data, total.data
        return add_moe_loss(self.moe_cfg, model, loss, sample_size, logging_output), sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs):
        super().reduce_metrics(logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        if ntokens:
            kd = sum(log.get("kd_loss", 0) for log in logging_outputs)
            metrics.log_scalar("kd_loss", kd / ntokens / math.log(2), ntokens, round=3)
