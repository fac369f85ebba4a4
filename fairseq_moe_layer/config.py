"""MoEConfig: every knob of one MoE layer, validated in one place.

Letter legend used across fairseq_moe_layer: T tokens, d model dim, f expert ffn dim,
E experts, k experts per token, C capacity (assignments an expert may take).
"""
import math
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Optional

from fairseq_moe_kernels import backend as kernel_backends

# The fairseq flag that sets each field, so that an error names what the user typed.
FLAGS = {"model_dim": "--encoder-embed-dim/--decoder-embed-dim", "ffn_dim": "--moe-expert-ffn-dim",
         "num_experts": "--moe-expert-count", "top_k": "--moe-top-k", "capacity_factor": "--moe-capacity-factor",
         "eval_capacity_token_fraction": "--moe-eval-capacity-token-fraction", "gate": "--moe-gate",
         "gate_fp32": "--moe-gating-use-fp32", "activation": "--activation-fn",
         "activation_dropout": "--activation-dropout", "kernel_backend": "--moe-kernel-backend",
         "routing": "--moe-routing", "gate_noise": "--moe-gate-noise", "gate_noise_scale": "--moe-gate-noise-scale",
         "eval_top_k": "--moe-eval-top-k", "second_expert_policy": "--moe-second-expert-policy",
         "normalize_gate_prob_before_dropping": "--moe-normalize-gate-prob-before-dropping",
         "batch_prioritized_routing": "--moe-batch-prioritized-routing",
         "random_token_selection": "--moe-random-token-selection",
         "expert_grad_normalization": "--moe-normalize-expert-grad", "score": "--moe-score",
         "bias_update_rate": "--moe-bias-update-rate", "expert_groups": "--moe-expert-groups",
         "topk_groups": "--moe-topk-groups", "shared_experts": "--moe-shared-expert-count",
         "soft_slots": "--moe-soft-slots", "top1_weight": "--moe-top1-weight"}
SECOND_EXPERT_POLICIES = ("all", "sampling", "random")
EXPERT_GRAD_NORMALIZATIONS = ("world_size", "sqrt_world_size")

ACTIVATIONS = ("relu", "gelu", "silu")


def _exact(x):
    """The decimal the user typed (repr gives the shortest round-tripping form), as a Fraction."""
    return Fraction(repr(float(x)))


@dataclass
class MoEConfig:
    """Settings of one MoE layer (see FLAGS for the fairseq flag behind each field). Its defaults are
    the defaults of those flags: the fairseq glue reads them from here (models/moe_transformer.py)."""

    model_dim: int
    ffn_dim: int
    num_experts: int = 8
    top_k: int = 2
    # C = ceil(capacity_factor * k * T / E) in training; 0 means dropless (no token is dropped).
    capacity_factor: float = 1.0
    # At eval: < 0 uses the training capacity, 0 is dropless, in (0, 1] gives C = ceil(fraction * T).
    eval_capacity_token_fraction: float = 0.25
    gate: str = "linear"
    # Compute the gate projection in fp32 even when the model runs in fp16/bf16.
    gate_fp32: bool = True
    activation: str = "relu"
    activation_dropout: float = 0.0
    # Kernels of the layer: torch (kernels/reference.py), triton (fused), auto = triton on CUDA.
    kernel_backend: str = "auto"
    # Who goes where (routing.ROUTINGS): topk, expert_choice, dense.
    routing: str = "topk"
    # Training-only noise: jitter multiplies the gate's input by U(1 - scale, 1 + scale) (Switch,
    # DeepSpeed); gaussian adds N(0, scale^2) to the logits (Tutel's gate noise). Eval is noise-free.
    gate_noise: str = "none"
    gate_noise_scale: float = 0.01
    # Experts per token at validation and generation (None: top_k).
    eval_top_k: Optional[int] = None
    # Options of topk routing (routing.route): fairseq's moe branch and DeepSpeed.
    second_expert_policy: str = "all"
    normalize_gate_prob_before_dropping: bool = False
    batch_prioritized_routing: bool = False
    random_token_selection: bool = False
    # With the experts spread over W ranks, an expert's gradient is divided by W (data parallelism's
    # average: W ranks == 1 process) or, as the moe branch's option, by sqrt(W * replicas).
    expert_grad_normalization: str = "world_size"
    # Top-k routing's scores: softmax over the experts, or sigmoid per expert (DeepSeek-V3).
    score: str = "softmax"
    # With k = 1, the chosen expert's output is scaled by its router probability ("prob": Switch, the router
    # learns through the output) or taken as it is ("one": the weights renormalised over the one choice, as
    # for k >= 2; Mixtral/Megatron's softmax over the chosen; an upcycled model then starts exactly dense).
    top1_weight: str = "prob"
    # > 0: the aux-loss-free balancing bias (DeepSeek-V3): a per-expert bias added to the scores for
    # choosing only, moved by this much toward balance after every optimizer step (update_routing_bias).
    bias_update_rate: float = 0.0
    # Group-limited top-k: the experts in expert_groups groups; each token's k experts come from its
    # topk_groups best groups (None: all groups).
    expert_groups: int = 1
    topk_groups: Optional[int] = None
    # Always-on experts beside the routed ones (DeepSeekMoE): y = routed(x) + sum of the shared experts'
    # outputs. Replicated on every rank (data parallel) when the routed experts are spread.
    shared_experts: int = 0
    # Soft MoE (routing "soft"): slots per expert; each slot is a softmax-weighted mixture of the tokens
    # of one group (a sentence in fairseq), each token a softmax-weighted mixture of the slots' outputs.
    soft_slots: int = 1

    def validate(self):
        """Raise ValueError naming the flag for the first bad value; return self."""
        from .gates import GATES, NOISES  # late imports: neither imports config
        from .routing import ROUTINGS

        def bad(name, why):
            raise ValueError(f"{FLAGS[name]} ({name}) {why}, got {getattr(self, name)!r}")

        for name in ("model_dim", "ffn_dim", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(name, "must be an integer >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"--moe-top-k (top_k={self.top_k}) must not exceed --moe-expert-count "
                f"(num_experts={self.num_experts})"
            )
        if not math.isfinite(self.capacity_factor) or self.capacity_factor < 0:
            bad("capacity_factor", "must be >= 0 (0 = dropless)")
        frac = self.eval_capacity_token_fraction
        if not math.isfinite(frac) or frac > 1:
            bad("eval_capacity_token_fraction", "must be < 0 (as training), 0 (dropless) or in (0, 1]")
        if self.gate not in GATES:
            bad("gate", f"must be one of {sorted(GATES)}")
        if self.activation not in ACTIVATIONS:
            bad("activation", f"must be one of {list(ACTIVATIONS)} in an MoE layer")
        if not 0.0 <= self.activation_dropout < 1.0:
            bad("activation_dropout", "must be in [0, 1)")
        if self.kernel_backend not in kernel_backends.BACKENDS:
            bad("kernel_backend", f"must be one of {list(kernel_backends.BACKENDS)}")
        if self.routing not in ROUTINGS:
            bad("routing", f"must be one of {sorted(ROUTINGS)}")
        for name in ("top_k", "eval_top_k"):
            if self.routing == "hash" and getattr(self, name) not in (None, 1):
                bad(name, "must be 1 with --moe-routing hash (a token id maps to one expert)")
        if self.routing == "hash" and self.gate_noise != "none":
            bad("gate_noise", "has nothing to act on with --moe-routing hash (no router)")
        if self.routing == "expert_choice" and not self.capacity_factor > 0:
            bad("capacity_factor", "must be > 0 with --moe-routing expert_choice (each expert takes "
                                   "ceil(CF * k * tokens / experts) tokens; it has no dropless form)")
        if self.gate_noise not in NOISES:
            bad("gate_noise", f"must be one of {list(NOISES)}")
        if not math.isfinite(self.gate_noise_scale) or not 0 <= self.gate_noise_scale < (
                1 if self.gate_noise == "jitter" else math.inf):
            bad("gate_noise_scale", "must be >= 0 (and < 1 with jitter)")
        if self.second_expert_policy not in SECOND_EXPERT_POLICIES:
            bad("second_expert_policy", f"must be one of {list(SECOND_EXPERT_POLICIES)}")
        for name in ("second_expert_policy", "normalize_gate_prob_before_dropping"):
            if getattr(self, name) not in ("all", False) and (self.top_k < 2 or self.routing != "topk"):
                bad(name, f"applies to the second and later choices of --moe-routing topk (here "
                          f"--moe-routing {self.routing}, --moe-top-k {self.top_k})")
        for name in ("batch_prioritized_routing", "random_token_selection"):
            if getattr(self, name) and self.routing != "topk":
                bad(name, f"applies to --moe-routing topk (here {self.routing})")
        if self.batch_prioritized_routing and self.random_token_selection:
            bad("random_token_selection", "and --moe-batch-prioritized-routing are two different priorities: "
                                          "choose one")
        if not isinstance(self.shared_experts, int) or isinstance(self.shared_experts, bool) or self.shared_experts < 0:
            bad("shared_experts", "must be an integer >= 0")
        if not isinstance(self.soft_slots, int) or isinstance(self.soft_slots, bool) or self.soft_slots < 1:
            bad("soft_slots", "must be an integer >= 1")
        if self.soft_slots != 1 and self.routing != "soft":
            bad("soft_slots", f"applies to --moe-routing soft (here {self.routing})")
        if self.score not in ("softmax", "sigmoid"):
            bad("score", "must be softmax or sigmoid")
        if self.top1_weight not in ("prob", "one"):
            bad("top1_weight", "must be prob or one")
        if not (math.isfinite(self.bias_update_rate) and self.bias_update_rate >= 0):
            bad("bias_update_rate", "must be >= 0 (0: no balancing bias)")
        if not isinstance(self.expert_groups, int) or self.expert_groups < 1 or self.num_experts % self.expert_groups:
            bad("expert_groups", f"must be an integer >= 1 that divides --moe-expert-count {self.num_experts}")
        if self.topk_groups is not None and not (isinstance(self.topk_groups, int) and 1 <= self.topk_groups
                                                 <= self.expert_groups):
            bad("topk_groups", f"must be an integer in [1, --moe-expert-groups {self.expert_groups}]")
        if (self.expert_groups > 1) != (self.topk_groups is not None):
            bad("topk_groups", "and --moe-expert-groups G > 1 go together (group-limited routing needs both)")
        k_most = max(self.top_k, self.eval_top_k if isinstance(self.eval_top_k, int) else 0)
        if self.topk_groups is not None and k_most > self.topk_groups * (self.num_experts // self.expert_groups):
            bad("topk_groups", f"leaves fewer than --moe-top-k/--moe-eval-top-k {k_most} experts to choose from "
                               f"({self.topk_groups} groups of {self.num_experts // self.expert_groups})")
        for name, off in (("score", "softmax"), ("bias_update_rate", 0.0), ("topk_groups", None),
                          ("top1_weight", "prob")):
            if getattr(self, name) != off and self.routing != "topk":
                bad(name, f"applies to --moe-routing topk (here {self.routing})")
        if self.second_expert_policy == "sampling" and (self.score != "softmax" or self.bias_update_rate
                                                        or self.topk_groups is not None):
            bad("second_expert_policy", "sampling draws from the softmax over all the other experts: it cannot "
                                        "be combined with --moe-score sigmoid, --moe-bias-update-rate or "
                                        "--moe-topk-groups")
        if self.expert_grad_normalization not in EXPERT_GRAD_NORMALIZATIONS:
            bad("expert_grad_normalization", f"must be one of {list(EXPERT_GRAD_NORMALIZATIONS)}")
        if self.eval_top_k is not None and not (isinstance(self.eval_top_k, int) and 1 <= self.eval_top_k
                                                 <= self.num_experts):
            bad("eval_top_k", f"must be an integer in [1, --moe-expert-count {self.num_experts}]")
        return self

    def capacity(self, num_tokens, training):
        """Assignments each expert may take for num_tokens tokens, or None for dropless.

        Exact rational arithmetic on the factor as the user wrote it: in floats 1.1 * 2 * 45 / 3
        is 33.000000000000004, whose ceil would be one too many.
        """
        if not training and self.eval_capacity_token_fraction >= 0:
            if self.eval_capacity_token_fraction == 0:  # dropless (expert choice has no such form)
                return self.capacity(num_tokens, True) if self.routing == "expert_choice" else None
            return math.ceil(_exact(self.eval_capacity_token_fraction) * num_tokens)
        if self.capacity_factor == 0:
            return None
        return math.ceil(_exact(self.capacity_factor) * self.top_k * num_tokens / self.num_experts)

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}
