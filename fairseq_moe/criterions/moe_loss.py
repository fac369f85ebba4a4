"""The MoE part of a criterion: the weighted router losses and the per-interval MoE metrics.

Shared by moe_cross_entropy and moe_label_smoothed_cross_entropy, which add it to their parent's loss.
"""
from dataclasses import dataclass

import torch
from fairseq import metrics
from fairseq.dataclass import ChoiceEnum

from fairseq_moe_layer.options import refusal, setting

from ..errors import FlagError
from ..models.moe_ffn import moe_blocks

METRICS = ("moe_balance_loss", "moe_z_loss", "moe_dropped", "moe_imbalance", "moe_entropy", "moe_importance_loss",
           "moe_load_loss", "moe_cmr_gate")


COMBINE, TRANSFORMS, LOSS_TYPES = ("average", "sum"), ("none", "neg_log"), ("balance", "importance_load")


@dataclass
class MoELossConfig:
    """The MoE criterions' settings (options.setting, as the layer's: fairseq reads the help and the ChoiceEnum
    type, check_moe_loss_config the choices and ranges)."""
    moe_gate_loss_wt: float = setting(0.01, "weight of the balance loss (Switch: 0.01)", ge=0)
    moe_gate_loss_combine_method: ChoiceEnum(COMBINE) = setting(
        "average", "combine the balance losses of the MoE layers by average or sum", choices=COMBINE)
    moe_gate_loss_transform: ChoiceEnum(TRANSFORMS) = setting(
        "none", "transform of the combined balance loss before weighting", choices=TRANSFORMS)
    moe_z_loss_wt: float = setting(0.0, "weight of the router z-loss (ST-MoE: 0.001)", ge=0)
    moe_gate_loss_type: ChoiceEnum(LOSS_TYPES) = setting(
        "balance", "what --moe-gate-loss-wt weights: the GShard/Switch balance loss, or Shazeer et al.'s "
                   "CV(importance)^2 + CV(load)^2 (top-k routing with --moe-gate-noise gaussian)", choices=LOSS_TYPES)
    cmr_gate_loss_wt: float = setting(0.0, "--moe-cmr: weight of NLLB-MoE's CMR loss |mean gate - P|, P "
                                            "--cmr-gate-loss-p", "--cmr-gate-loss-wt", ge=0)
    cmr_gate_loss_p: float = setting(1.0, "--moe-cmr: the share of each token the CMR loss asks to go to the "
                                          "routed experts", "--cmr-gate-loss-p", ge=0, le=1)
    moe_log_per_layer: bool = setting(
        False, "also log each MoE layer's balance loss, dropped fraction, imbalance and entropy "
               "(moe_encoder1_balance, moe_decoder3_dropped, ...)")


def check_moe_loss_config(cfg):
    bad = refusal(MoELossConfig, cfg)
    if bad:
        raise FlagError(bad)


def add_moe_loss(cfg, model, loss, sample_size, logging_output):
    """loss + weighted router losses of the latest forward; fills the MoE metrics in logging_output."""
    auxes = [block.last_aux for _, block in moe_blocks(model) if block.last_aux is not None]
    if not auxes:
        return loss
    balance = torch.stack([a.balance_loss for a in auxes])
    z = torch.stack([a.z_loss for a in auxes]).mean()
    shazeer = cfg.moe_gate_loss_type == "importance_load"
    per_layer = torch.stack([a.importance_loss + a.load_loss for a in auxes]) if shazeer else balance
    gate_loss = per_layer.mean() if cfg.moe_gate_loss_combine_method == "average" else per_layer.sum()
    if cfg.moe_gate_loss_transform == "neg_log":
        gate_loss = -torch.log(gate_loss)
    # The task loss is a sum over sample_size items (fairseq divides by it later, summed over the ranks): scale alike.
    # A global balance loss (--moe-balance-loss-scope global) is each rank's share of one loss over every rank's
    # tokens: weighted by the sample size of every rank, so that the ranks' gradients add up to its gradient.
    if any(a.balance_share_of_global for a in auxes):  # (a batch whose loss is thrown away counts as none)
        ignored = any(block.moe.ignored for _, block in moe_blocks(model))
        balance_size = global_sample_size(0 if ignored else sample_size, balance.device)
    else:
        balance_size = sample_size
    loss = loss + balance_size * cfg.moe_gate_loss_wt * gate_loss + sample_size * cfg.moe_z_loss_wt * z
    cmr = [a for a in auxes if a.cmr_gate_sum is not None]
    if cfg.cmr_gate_loss_wt and not cmr:
        raise FlagError(f"--cmr-gate-loss-wt {cfg.cmr_gate_loss_wt} weights the gates of --moe-cmr, which the model "
                        f"does not have")
    if cmr:  # NLLB-MoE's: the gates' mean over every CMR layer's tokens, pulled towards --cmr-gate-loss-p
        used = sum(a.cmr_gate_sum for a in cmr) / max(sum(a.num_tokens for a in cmr), 1e-5)
        if cfg.cmr_gate_loss_wt:
            loss = loss + sample_size * cfg.cmr_gate_loss_wt * (used - cfg.cmr_gate_loss_p).abs()
        logging_output["moe_cmr_gate"] = used.detach() * sample_size
    n = len(auxes)
    # Metrics are means over layers, weighted by sample_size so that reduce_metrics can average; 0-d tensors, as
    # fairseq's own criterions log: read from the device with fairseq's (once per logged step), not layer by layer.
    stats = torch.stack([torch.stack(a.statistics()) for a in auxes])  # [layers, (dropped, imbalance, entropy)]
    means = stats.mean(0) * sample_size
    logging_output["moe_balance_loss"] = balance.detach().mean() * balance_size  # (global: the ranks' sum is it)
    logging_output["moe_z_loss"] = z.detach() * sample_size
    logging_output["moe_dropped"], logging_output["moe_imbalance"], logging_output["moe_entropy"] = means.unbind()
    if shazeer:
        logging_output["moe_importance_loss"] = sum(a.importance_loss.detach() for a in auxes) / n * sample_size
        logging_output["moe_load_loss"] = sum(a.load_loss.detach() for a in auxes) / n * sample_size
    if cfg.moe_log_per_layer:
        for name, block in moe_blocks(model):
            a = block.last_aux
            if a is None:
                continue
            side, _, index = name.split(".")[:3]  # encoder.layers.1.fc1 -> moe_encoder1_
            prefix = f"moe_{side}{index}_"
            dropped, imbalance, entropy = a.statistics()
            for key, value in (("balance", a.balance_loss.detach() * balance_size), ("dropped", dropped * sample_size),
                               ("imbalance", imbalance * sample_size), ("entropy", entropy * sample_size)):
                logging_output[prefix + key] = value
    return loss


def global_sample_size(sample_size, device):
    """The sample size summed over every rank, a 0-d tensor on device (an all-reduce: every rank's criterion runs once
    per micro-batch in training, dummy batches too, where the layers made a global balance loss)."""
    total = sample_size.detach().to(device, torch.float64) if torch.is_tensor(sample_size) else \
        torch.full((), float(sample_size), dtype=torch.float64, device=device)  # (a fill: no copy from the host)
    torch.distributed.all_reduce(total)
    return total.float()


def reduce_moe_metrics(logging_outputs):
    sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
    if not sample_size:
        return
    keys = sorted({key for log in logging_outputs for key in log if key.startswith("moe_")})
    for key in sorted(set(METRICS) & set(keys)) + [k for k in keys if k not in METRICS]:  # (per layer last)
        if any(key in log for log in logging_outputs):
            total = sum(log.get(key, 0) for log in logging_outputs)
            metrics.log_scalar(key, total / sample_size, sample_size, round=4)
