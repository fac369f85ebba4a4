"""Every set-up the plugin refuses, in one table: what, the flags involved, the message, and why.

A refusal is a combination of flags (and of where the run is: experts spread over ranks or not) that
cannot work with MoE layers, or would silently do something else than the flags say. Each is checked
once, before any update: at "start" (the parsed flags, before fairseq's main runs: whose own checks can end a run
before any other stage, as its iopath import for --write-checkpoints-asynchronously does; checked again at
"trainer", for ranks whose start the plugin did not see), at "build" (the model's flags, on every rank, before
any weight exists) or at "trainer" (fairseq builds its Trainer: the whole config, hydra runs too, the model and
the criterion).
A bad value of a single flag is checked where it is read (MoEConfig.validate, the task, the criterion,
compat.torchrun_on_cpu). tests/fairseq_moe/test_refusals.py runs every entry with its example.
"""
import argparse
from dataclasses import dataclass, field
from typing import Callable

from fairseq_moe_layer import ROUTINGS

from .errors import FlagError


@dataclass
class Context:
    """Where the check runs: the flags (one flat Namespace), whether the experts are spread over
    ranks, and at the trainer stage the model, the criterion and the task's config."""
    flags: argparse.Namespace
    spread: bool = False
    model: object = None
    criterion: object = None
    task: object = None
    moe_task: bool = True  # the task is one of ours (its optimizer_step moves the routing biases)

    def flag(self, name, default=None):
        return getattr(self.flags, name, default)

    def layers(self):
        """The MoEConfig of every MoE layer of the model (trainer stage; none without a model), read from the
        layers themselves (the refusals sit below the fairseq models that hold them)."""
        from fairseq_moe_layer import MoELayer

        modules = self.model.modules() if hasattr(self.model, "modules") else ()
        return [m.cfg for m in modules if isinstance(m, MoELayer)]

    def loss(self, name):
        """A setting of the MoE criterion (MoELossConfig), None for another criterion."""
        return getattr(getattr(self.criterion, "moe_cfg", None), name, None)


@dataclass(frozen=True)
class Refusal:
    setup: str  # what is refused, in words
    flags: tuple  # the flags involved
    stage: str  # "start", "build" or "trainer" (STAGES)
    refused: Callable[[Context], bool]
    message: object  # str.format(**flags), or a callable(ctx) -> str
    why: str
    example: dict = field(default_factory=dict)  # Context fields that trigger it (flags: a dict; a callable
    # field: called to make the value), for the test

    def text(self, ctx):
        """The message for ctx."""
        return self.message(ctx) if callable(self.message) else self.message.format(**vars(ctx.flags))


def _mixes(routing):
    policy = ROUTINGS.get(routing)
    return policy is not None and policy.mixes_tokens


def _names(which):
    """The routing policies for which which(policy) holds, as a message lists them."""
    names = sorted(name for name, policy in ROUTINGS.items() if which(policy))
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "none"


def _first(which):
    """The first routing policy (by name) for which which(policy) holds: an example for the test."""
    return min(name for name, policy in ROUTINGS.items() if which(policy))


def _adaptive_softmax(ctx):
    decoder = getattr(ctx.model, "decoder", None)
    return getattr(decoder, "adaptive_softmax", None) is not None and hasattr(ctx.criterion, "moe_cfg")


def _model_routed_by(routing, **settings):
    """An example model: one MoE layer with this routing (for the test of the table)."""
    from torch import nn

    from fairseq_moe_layer import MoEConfig, MoELayer

    settings.setdefault("top_k", ROUTINGS[routing].only_top_k or 2)
    return nn.Sequential(MoELayer(MoEConfig(model_dim=4, ffn_dim=4, num_experts=2, routing=routing, **settings)))


# What torch's FSDP behind --ddp-backend fully_sharded (fsdp.py) does not do: (flag, refused(ctx), why, example flags)
_FSDP_REFUSED = (
    ("--zero-sharding", lambda c: c.flag("zero_sharding", "none") != "none", "FSDP shards the optimizer state already",
     {"zero_sharding": "os"}),
    ("--use-sharded-state", lambda c: bool(c.flag("use_sharded_state", False)),
     "a checkpoint holds each dense tensor whole, as without FSDP", {"use_sharded_state": True}),
    ("--cpu-offload", lambda c: bool(c.flag("cpu_offload", False)), "offloading to the CPU is not built",
     {"cpu_offload": True}),
    ("--store-ema", lambda c: bool(c.flag("store_ema", False)),
     "the EMA copy would be a whole, unsharded model on every rank", {"store_ema": True}),
    ("--fp16", lambda c: bool(c.flag("fp16", False)) and not c.flag("memory_efficient_fp16", False),
     "a flat fp32 copy of sharded parameters is not built; add --memory-efficient-fp16", {"fp16": True}),
    ("--bf16", lambda c: bool(c.flag("bf16", False)) and not c.flag("memory_efficient_bf16", False),
     "fp32 master copies of sharded parameters are not built; add --memory-efficient-bf16", {"bf16": True}),
    ("--amp", lambda c: bool(c.flag("amp", False)),
     "torch's GradScaler unscales a device's gradients in one call, which cannot mix the sharded ones with the "
     "experts'", {"amp": True}),
    ("--use-bmuf", lambda c: bool(c.flag("use_bmuf", False)), "BMUF syncs whole models; nothing would be sharded",
     {"use_bmuf": True}),
    ("--moe-frozen-experts", lambda c: _frozen(c), "FSDP shards the routers' rows, which the freezing's gradient "
     "hooks would not reach (they would train)", {"moe_frozen_experts": "0,4"}),
)


def _frozen(c):
    """Whether --moe-frozen-experts freezes any expert (one count, or one per MoE layer)."""
    value = c.flag("moe_frozen_experts", 0)
    return bool(value) and any(int(v) for v in str(value).strip("[]").split(","))

REFUSALS = (
    Refusal("product quantization noise with MoE layers", ("--quant-noise-pq",), "build",
            lambda c: (c.flag("quant_noise_pq", 0) or 0) > 0,
            "--quant-noise-pq is not supported with MoE layers: it would reach the dense layers but not the "
            "experts, which hold most of the FFN weights",
            "fairseq applies it to nn.Linear modules; the experts are stacked weights",
            {"flags": {"quant_noise_pq": 0.1}}),
    Refusal("NormFormer's FFN layer norm in MoE layers", ("--scale-fc",), "build",
            lambda c: bool(c.flag("scale_fc", False)),
            "--scale-fc (NormFormer's layer norm between fc1 and fc2) is not supported in MoE layers, whose "
            "experts compute fc1 and fc2 together",
            "the norm would sit inside the fused expert computation",
            {"flags": {"scale_fc": True}}),
    Refusal("offloading activations of MoE layers", ("--offload-activations",), "build",
            lambda c: bool(c.flag("offload_activations", False)),
            "--offload-activations is not supported with MoE layers (their checkpointing keeps the router "
            "losses in the graph and does not offload); use --checkpoint-activations",
            "MoE layers use torch's non-reentrant checkpoint, so that the router losses keep their gradients",
            {"flags": {"offload_activations": True}}),
    Refusal("routing by token id with activation checkpointing", ("--moe-routing", "--checkpoint-activations"),
            "build",
            lambda c: bool(c.flag("checkpoint_activations", False)) and bool(
                getattr(ROUTINGS.get(c.flag("moe_routing")), "needs_token_ids", False)),
            lambda c: f"--moe-routing {c.flag('moe_routing')} routes by token id, which --checkpoint-activations' "
            f"recompute in the backward pass no longer has: leave one of them out",
            "the token ids reach the MoE blocks for one forward (models/moe_ffn.token_ids); the checkpointed "
            "forward is recomputed during backward, after that",
            {"flags": {"moe_routing": _first(lambda p: p.needs_token_ids), "checkpoint_activations": True}}),
    Refusal("token-mixing routing in a decoder", ("--moe-routing", "--decoder-moe-freq"), "build",
            lambda c: _mixes(c.flag("moe_routing")) and bool(c.flag("moe_decoder_layer_ids")),
            lambda c: f"--moe-routing {c.flag('moe_routing')} cannot be used in decoder layers: it mixes the tokens "
            f"of a batch or sentence, so a token's output would depend on later tokens (--moe-freq "
            f"{c.flag('moe_freq')}, --decoder-moe-freq {c.flag('decoder_moe_freq')}). Keep MoE in the encoder only "
            f"(--moe-freq 0 --encoder-moe-freq N), or route the decoder with "
            f"{_names(lambda p: not p.mixes_tokens)}",
            "a causal decoder must not see the future, and incremental decoding sees one token at a time",
            {"flags": {"moe_routing": _first(lambda p: p.mixes_tokens), "moe_decoder_layer_ids": [1], "moe_freq": 2,
                       "decoder_moe_freq": 0}}),
    Refusal("LayerDrop or --eval-bleu with spread experts and a task that is not an MoE task",
            ("--encoder-layerdrop", "--decoder-layerdrop", "--eval-bleu", "--task"), "trainer",
            lambda c: c.spread and not c.moe_task and (bool(getattr(c.task, "eval_bleu", False)) or any(
                (getattr(getattr(c.model, side, None), f"{side}_layerdrop", 0) or 0) > 0
                for side in ("encoder", "decoder"))),
            "--encoder/decoder-layerdrop and --eval-bleu with the experts spread over ranks need --task "
            "moe_translation or moe_language_modeling: their steps keep the ranks' MoE layers together (the same "
            "layers skipped, beam searches in lockstep); with another task the ranks would wait for each other",
            "each MoE layer is an all-to-all of every rank",
            {"spread": True, "moe_task": False, "task": argparse.Namespace(eval_bleu=True)}),
    Refusal("AMP with spread experts", ("--amp",), "trainer", lambda c: c.spread and bool(c.flag("amp", False)),
            "--amp cannot be used with experts spread over ranks: torch's GradScaler decides on each rank alone "
            "whether a step overflowed, so an overflow in one rank's experts would skip the step there and take it "
            "on the others (their shared weights would drift apart); use --fp16 or --memory-efficient-fp16",
            "GradScaler.step skips the step on the ranks whose own gradients hold an inf, and fairseq retries the "
            "batch on all",
            {"spread": True, "flags": {"amp": True}}),
    Refusal("AMP over bf16 weights", ("--amp", "--bf16"), "start",
            lambda c: bool(c.flag("amp", False)) and bool(c.flag("bf16", False)) and not c.flag("tpu", False),
            "--amp cannot be combined with --bf16: fairseq casts the model to bf16 first, then AMP would step the bf16 "
            "weights without fp32 master copies (and enter fp16 autocast over them on CUDA); use --bf16 alone",
            "--bf16 trains through fairseq's FP16Optimizer (fp32 master weights, no loss scaler); AMP keeps fp32 "
            "weights and scales fp16 gradients", {"flags": {"amp": True, "bf16": True}}),
    Refusal("asynchronous checkpoint writes with spread experts", ("--write-checkpoints-asynchronously",),
            "start", lambda c: c.spread and bool(c.flag("write_checkpoints_asynchronously", False)),
            "--write-checkpoints-asynchronously is not supported with experts spread over ranks: a set's files "
            "must all be on disk before older sets are deleted",
            "no rank deletes an old checkpoint before every rank has written the new set",
            {"spread": True, "flags": {"write_checkpoints_asynchronously": True}}),
    *(Refusal(f"{flag} with fully sharded data parallel", (flag, "--ddp-backend"), "trainer",
              lambda c, on=on: c.flag("ddp_backend") == "fully_sharded" and on(c),
              f"{flag} cannot be used with --ddp-backend fully_sharded (torch's FSDP here, fsdp.py): {why}", why,
              {"flags": {"ddp_backend": "fully_sharded", **example}})
      for flag, on, why, example in _FSDP_REFUSED),
    Refusal("fully sharded data parallel for a model without experts", ("--ddp-backend",), "trainer",
            lambda c: c.flag("ddp_backend") == "fully_sharded" and c.model is not None and not c.layers(),
            "--ddp-backend fully_sharded with fairseq-moe loaded is torch's FSDP for models with MoE layers "
            "(fsdp.py); this model has none: train it with --ddp-backend legacy_ddp, or without --user-dir "
            "fairseq_moe (fairseq's fairscale FSDP)",
            "with the experts spread every rank saves, so every rank takes part in a save's gathering; fairseq saves "
            "a dense model on rank 0 alone, which may skip a save that the others would wait in",
            {"flags": {"ddp_backend": "fully_sharded"}, "model": argparse.Namespace()}),
    Refusal("Adafactor's --scale-parameter with ZeRO", ("--optimizer", "--scale-parameter", "--zero-sharding"),
            "trainer",
            lambda c: c.flag("optimizer") == "adafactor" and bool(c.flag("scale_parameter", False)) and
            c.flag("zero_sharding", "none") != "none",
            "--scale-parameter (Adafactor) cannot be used with --zero-sharding: fairseq's Adafactor carries each "
            "parameter's RMS-scaled learning rate into the next parameter's, a chain in parameter order that ranks "
            "stepping different parameters cannot reproduce",
            "fairseq's Adafactor step writes its per-parameter lr into the group, which the next parameter reads "
            "(with spread experts alone every rank steps the same dense parameters first, and the experts read it)",
            {"flags": {"optimizer": "adafactor", "scale_parameter": True, "zero_sharding": "os"}}),
    Refusal("the composite optimizer with spread experts", ("--optimizer",), "trainer",
            lambda c: c.spread and c.flag("optimizer") == "composite",
            "--optimizer composite is not supported with experts spread over ranks: its state (one optimizer per "
            "group of parameters) is not numbered by parameter, so a set cannot cut it per expert; use adam, "
            "adafactor, sgd, ...",
            "a set cuts the optimizer state along the expert dimension, found by each parameter's index",
            {"spread": True, "flags": {"optimizer": "composite"}}),
    Refusal("the neg_log balance-loss transform with routing that has no balance loss",
            ("--moe-gate-loss-transform", "--moe-routing"), "trainer",
            lambda c: c.loss("moe_gate_loss_transform") == "neg_log" and any(
                not ROUTINGS[layer.routing].balance_loss for layer in c.layers()),
            lambda c: f"--moe-gate-loss-transform neg_log cannot be used with --moe-routing "
            f"{_names(lambda p: not p.balance_loss)}: they have no balance loss (it is 0, and its log -inf)",
            "the balance loss of those policies is zero",
            {"model": lambda: _model_routed_by(_first(lambda p: not p.balance_loss)),
             "criterion": argparse.Namespace(moe_cfg=argparse.Namespace(moe_gate_loss_transform="neg_log"))}),
    Refusal("the aux-loss-free balancing bias with a task that is not an MoE task", ("--moe-bias-update-rate",
                                                                                   "--task"), "trainer",
            lambda c: any(layer.bias_update_rate for layer in c.layers()) and not c.moe_task,
            "--moe-bias-update-rate needs --task moe_translation or moe_language_modeling: their optimizer step "
            "moves the routing biases; with another task they would never move",
            "the bias update runs after every optimizer step, from the MoE task",
            {"model": lambda: _model_routed_by(_first(lambda p: "bias_update_rate" in p.options),
                                               bias_update_rate=0.01), "moe_task": False}),
    Refusal("the global balance loss with a task that is not an MoE task", ("--moe-balance-loss-scope", "--task"),
            "trainer",
            lambda c: any(layer.balance_loss_scope == "global" for layer in c.layers()) and not c.moe_task,
            "--moe-balance-loss-scope global needs --task moe_translation or moe_language_modeling (or another MoE "
            "task): they tell the layers which batch is fairseq's dummy one (a rank whose data ran out), whose "
            "tokens must count on no rank",
            "with another task a dummy batch's tokens would count in every rank's global loss",
            {"model": lambda: _model_routed_by(_first(lambda p: p.balance_loss), balance_loss_scope="global"),
             "moe_task": False}),
    Refusal("Shazeer's importance and load losses without noisy top-k gating",
            ("--moe-gate-loss-type", "--moe-routing", "--moe-gate-noise"), "trainer",
            lambda c: c.loss("moe_gate_loss_type") == "importance_load" and any(
                not ROUTINGS[layer.routing].balance_loss or layer.gate_noise != "gaussian" or not layer.gate_noise_scale
                for layer in c.layers()),
            lambda c: f"--moe-gate-loss-type importance_load needs --moe-routing {_names(lambda p: p.balance_loss)} "
            "and --moe-gate-noise gaussian with a --moe-gate-noise-scale > 0: its load term estimates, from that "
            "noise, how likely each expert is chosen",
            "Shazeer et al.'s load estimator is defined by the noise of noisy top-k gating",
            {"model": lambda: _model_routed_by(_first(lambda p: p.balance_loss)),
             "criterion": argparse.Namespace(moe_cfg=argparse.Namespace(moe_gate_loss_type="importance_load"))}),
    Refusal("a balance loss over sequences or ranks with a loss that does not read it", (
                "--moe-balance-loss-scope", "--moe-gate-loss-type", "--moe-gate-loss-transform"), "trainer",
            lambda c: any(layer.balance_loss_scope != "batch" for layer in c.layers()) and (
                c.loss("moe_gate_loss_type") == "importance_load" or c.loss("moe_gate_loss_transform") == "neg_log"),
            lambda c: "--moe-balance-loss-scope " + next(layer.balance_loss_scope for layer in c.layers()
                                                         if layer.balance_loss_scope != "batch")
            + " sets the GShard/Switch balance loss; it cannot be used with --moe-gate-loss-type importance_load "
              "(Shazeer's losses, over the micro-batch) or --moe-gate-loss-transform neg_log (the log of one rank's "
              "share of a global loss means nothing)",
            "the scope changes what the balance loss sums over; the other losses and the transform assume the "
            "micro-batch's",
            {"model": lambda: _model_routed_by(_first(lambda p: p.balance_loss), balance_loss_scope="global"),
             "criterion": argparse.Namespace(moe_cfg=argparse.Namespace(moe_gate_loss_type="balance",
                                                                        moe_gate_loss_transform="neg_log"))}),
    Refusal("frozen experts with weight decay", ("--moe-frozen-experts", "--weight-decay"), "trainer",
            lambda c: _frozen(c) and float(c.flag("weight_decay", 0) or 0) > 0,
            "--moe-frozen-experts cannot be combined with --weight-decay: the optimizers' decoupled decay shrinks "
            "the frozen experts and router rows whatever their (zeroed) gradients; train the grown model with "
            "--weight-decay 0",
            "fairseq's Adam and Adafactor apply weight decay to every parameter, gradient or not",
            {"flags": {"moe_frozen_experts": 4, "weight_decay": 0.0001}}),
    Refusal("adaptive softmax with the MoE criterions", ("--adaptive-softmax-cutoff", "--criterion"), "trainer",
            _adaptive_softmax,
            "--adaptive-softmax-cutoff cannot be trained with the MoE criterions (they need plain output "
            "logits); train the MoE model without adaptive softmax",
            "the parent criterions read plain logits; fairseq's adaptive_loss has no router losses",
            {"model": argparse.Namespace(decoder=argparse.Namespace(adaptive_softmax=object())),
             "criterion": argparse.Namespace(moe_cfg=None)}),
)


def training_flags(cfg):
    """fairseq's training config as one flat Namespace of flags, from the argparse Namespace or from the
    sectioned config that fairseq-hydra-train and fairseq-train build."""
    if isinstance(cfg, argparse.Namespace):
        return cfg
    flat = {}
    for section in ("common", "distributed_training", "optimization", "checkpoint", "ema"):
        flat.update(cfg.get(section) or {})
    if cfg.get("optimizer") is not None:  # a DictConfig, or a Namespace (legacy): its settings too (--scale-parameter)
        opt = cfg.optimizer
        for key, value in (vars(opt) if isinstance(opt, argparse.Namespace) else opt).items():
            flat.setdefault(key, value)
        flat["optimizer"] = getattr(opt, "_name", None)
    return argparse.Namespace(**flat)


STAGES = {"start": ("start",), "build": ("build",), "trainer": ("start", "trainer")}  # what each checks


def check(stage, ctx):
    """Raise FlagError for the first refusal of `stage` that applies to ctx."""
    for refusal in REFUSALS:
        if refusal.stage in STAGES[stage] and refusal.refused(ctx):
            raise FlagError(refusal.text(ctx))


def spread_by_flags(cfg):
    """Whether the experts will be spread over ranks, from the flags alone (no model, no process group yet):
    several ranks (build_expert_parallel in models/moe_transformer.py spreads an MoE model's experts over every
    rank of a job of several) and an MoE model (--moe-expert-count is a flag of the MoE architectures only)."""
    if isinstance(cfg, argparse.Namespace):
        world, model = getattr(cfg, "distributed_world_size", 1), cfg
    else:
        world, model = (cfg.get("distributed_training") or {}).get("distributed_world_size", 1), cfg.get("model")
    return (world or 1) > 1 and getattr(model, "moe_expert_count", None) is not None


def check_start(cfg):
    """The "start" refusals for fairseq's parsed config (or its Namespace of flags), on every rank, before
    fairseq's main and before any collective (compat.py's hooks around the ranks' start call it)."""
    check("start", Context(flags=training_flags(cfg), spread=spread_by_flags(cfg)))
