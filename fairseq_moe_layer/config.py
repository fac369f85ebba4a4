"""MoEConfig: every knob of one MoE layer, validated in one place.

Its fields are settings (options.setting: flag, help, choices and range as data): the layer's own below, then
each routing policy's options (routing.Policy.options), added in the order the policies are registered.
validate() runs each setting's generic check, then the checks that tie settings together, then the policy's.

Letter legend used across fairseq_moe_layer: T tokens, d model dim, f expert ffn dim,
E experts, k experts per token, C capacity (assignments an expert may take).
"""
import dataclasses
import math
from dataclasses import dataclass, fields
from fractions import Fraction

from fairseq_moe_kernels import backend as kernel_backends

from .experts import EXPERT_KINDS
from .gates import GATES, NOISES
from .options import annotation, first_bad, flag_of, setting, settings
from .routing import _SEALED, ROUTINGS, TopK

ACTIVATIONS = ("relu", "gelu", "silu")


def _exact(x):
    """The decimal the user typed (repr gives the shortest round-tripping form), as a Fraction."""
    return Fraction(repr(float(x)))


@dataclass
class LayerSettings:
    """The settings every MoE layer has, whatever its routing policy. Their defaults are the defaults of their
    flags: the fairseq glue reads them from here (models/moe_transformer.py)."""

    model_dim: int = setting(dataclasses.MISSING, "model dimension d", "--encoder-embed-dim/--decoder-embed-dim",
                             type=int, ge=1, cli=False)
    ffn_dim: int = setting(dataclasses.MISSING, "hidden size f of each expert", "--moe-expert-ffn-dim", type=int,
                           ge=1, cli=False)
    num_experts: int = setting(8, "experts per MoE layer (tiny archs: 4); the fairseq flag also takes a "
                                  "comma-separated list, one count per MoE layer, encoder layers first",
                               "--moe-expert-count", ge=1, metavar="E[,E...]")
    top_k: int = setting(2, "experts per token (1 = Switch, 2 = GShard)", "--moe-top-k", ge=1, cli=False)
    capacity_factor: float = setting(
        1.0, "training capacity per expert = ceil(CF * k * T / E) (see --moe-capacity-rounding); 0 = dropless",
        ge=0, note="(0 = dropless)", metavar="CF")
    capacity_rounding: str = setting(
        "total", "how CF x k x T / E assignments round up: once, ceil(CF * k * T / E) (GShard, Tutel), or per "
                 "choice, k * ceil(CF * T / E) (fairseq's moe branch and NLLB-MoE, whose capacity is "
                 "2 * ceil(T / E) for top-2, ceil(T / E) for top-1)", choices=("total", "per_choice"))
    token_priority: str = setting(
        "position", "at capacity, which tokens an expert takes first (every first choice still goes before any "
                    "second one): position by position across the sentences of a batch (fairseq's time-major "
                    "activations: GShard's order), or sentence by sentence (batch-major: fairseq's moe branch and "
                    "NLLB-MoE)", choices=("position", "sentence"))
    capacity_counts_padding: bool = setting(
        False, "with --use-moe-pad-mask: the capacity counts every position of the batch, padding too, while the "
               "padding is still routed nowhere (fairseq's moe branch and NLLB-MoE, which trained with the pad mask); "
               "off: the capacity counts the real tokens only")
    eval_capacity_token_fraction: float = setting(
        0.25, "at validation/generation: ceil(FR * T) per expert; < 0: as training; 0: dropless (tiny archs: 0)",
        le=1, note="(< 0: as training, 0: dropless, else a fraction of the tokens)", metavar="FR")
    gate: str = setting(
        "linear", "the router, which makes each token's logits", choices=GATES)
    gate_fp32: bool = setting(True, "gate projection in fp32 (softmax and top-k are fp32 always)",
                              "--moe-gating-use-fp32", negative="--no-moe-gating-use-fp32")
    expert_kind: str = setting(
        "ffn", "the experts' kind: ffn, act(x W1 + b1) W2 + b2 with --activation-fn (fairseq's FFN), or swiglu, "
               "(silu(x W1_gate) * x W1_up) W2 without biases (Mixtral, Qwen-MoE, OLMoE, DeepSeek; shared experts "
               "too; --activation-fn then sets only the dense FFNs)", choices=EXPERT_KINDS)
    activation: str = setting("relu", "the experts' activation", "--activation-fn", choices=ACTIVATIONS, cli=False)
    activation_dropout: float = setting(0.0, "dropout after the experts' activation", "--activation-dropout",
                                        ge=0, lt=1, cli=False)
    kernel_backend: str = setting(
        "auto", "the layer's kernels: torch (PyTorch ops, a GEMM per expert), grouped_mm (the experts on PyTorch's "
                "grouped GEMM), or triton (the fused Triton kernels, which have not yet run on a GPU); auto = "
                "grouped_mm for bf16 on CUDA devices of compute capability 9.x/10.x (PyTorch's CUTLASS kernel), "
                "torch elsewhere (never triton); a backend that cannot run is an error at start-up",
        choices=kernel_backends.BACKENDS)
    routing: str = setting(TopK.name, "who goes where", choices=ROUTINGS)
    gate_noise: str = setting(
        "none", "training-only router noise: jitter multiplies the gate's input by U(1-S, 1+S) (Switch, "
                "DeepSpeed), gaussian adds N(0, S^2) to the logits (Tutel)", choices=NOISES)
    gate_noise_scale: float = setting(0.01, "S of --moe-gate-noise", ge=0, note="(and < 1 with jitter)",
                                      metavar="S")
    eval_top_k: int = setting(None, "experts per token at validation and generation (none: --moe-top-k)",
                              type=int, ge=1, metavar="K")
    expert_grad_normalization: str = setting(
        "world_size", "spread experts: divide their gradients by W (W ranks == 1 process) or by sqrt(W x "
                      "replicas) (the moe branch's option)", "--moe-normalize-expert-grad",
        choices=("world_size", "sqrt_world_size"))
    expert_output_masking: float = setting(
        0.0, "NLLB-MoE's expert output masking: in training each expert output (one token at one of its experts) is "
             "zeroed with probability P, not rescaled; at validation and generation every one is scaled by 1 - P",
        "--moe-eom", ge=0, lt=1, metavar="P")
    final_output_masking: float = setting(
        0.0, "NLLB-MoE's final output masking: in training a token's whole MoE output is zeroed with probability P, "
             "not rescaled; at validation and generation it is scaled by 1 - P", "--moe-fom", ge=0, lt=1,
        metavar="P")
    shared_experts: int = setting(
        0, "always-on experts beside the routed ones, summed into every token's output (DeepSeekMoE); plain "
           "parameters, replicated (data parallel) when the routed experts are spread", "--moe-shared-expert-count",
        ge=0, metavar="N")
    shared_expert_ffn_dim: int = setting(
        None, "hidden size of each shared expert (none: --moe-expert-ffn-dim; Qwen2-MoE's shared expert is wider "
              "than its routed ones)", "--moe-shared-expert-ffn-dim", type=int, ge=1, metavar="F")
    shared_expert_gate: bool = setting(
        False, "the shared experts' output scaled per token by sigmoid(x . g), g a learned [d] vector without bias "
               "(Qwen2-MoE's shared_expert_gate), before it joins the routed experts'")
    balance_loss_scope: str = setting(
        "batch", "the tokens the balance loss (--moe-gate-loss-wt) balances over: batch, each rank's micro-batch "
                 "(GShard, Switch, fairseq's moe branch: first choices counted, E^2 mean(P_e f_e)); sequence, each "
                 "sequence apart, then their mean (DeepSeek-V2/V3: every one of the k choices counted, "
                 "sum_e f_e P_e, f_e = E c_e / (k T)); global, the micro-batch of every data-parallel rank together "
                 "(Qwen's global-batch loss, Megatron-Core's global_aux_loss: the counts all-reduced in training, "
                 "pooled with those of the update's earlier micro-batches (--update-freq), each rank's share of "
                 "the probabilities; as sequence, every choice counted)", choices=("batch", "sequence", "global"))
    frozen_experts: int = setting(
        0, "the first N experts and their router rows do not train: their gradients are zeroed (a grown model's "
           "old experts: fairseq_moe.grow --freeze-old); the fairseq flag also takes one count per MoE layer",
        "--moe-frozen-experts", ge=0, metavar="N[,N...]")

    cmr: bool = setting(
        False, "NLLB-MoE's conditional MoE routing: the one shared expert (a dense FFN) and the routed experts mixed "
               "per token by a learned gate g = sigmoid(w . x + b): (1 - g) FFN(x) + g MoE(x) (the FFN is the one "
               "shared expert: the flag brings --moe-shared-expert-count 1)", "--moe-cmr")
    cmr_gate_drop: float = setting(0.0, "--moe-cmr: dropout on its gate g in training", "--cmr-gate-drop", ge=0, lt=1,
                                   metavar="P")

    def refuse(self, name, why):
        """Raise the ValueError that names the flag of field `name`."""
        f = next(f for f in fields(self) if f.name == name)
        raise ValueError(f"{flag_of(f)} ({name}) {why}, got {getattr(self, name)!r}")

    def validate(self):
        """Raise ValueError naming the flag for the first bad value; return self."""
        bad = self.refuse
        failed = first_bad(type(self), self)
        if failed:
            bad(failed[0].name, failed[1])
        policy = ROUTINGS[self.routing]
        if self.top_k > self.num_experts:
            raise ValueError(
                f"--moe-top-k (top_k={self.top_k}) must not exceed --moe-expert-count "
                f"(num_experts={self.num_experts})"
            )
        if self.frozen_experts > self.num_experts:
            bad("frozen_experts", f"must be at most --moe-expert-count {self.num_experts}")
        if self.frozen_experts and (self.gate != "linear" or not policy.picks_by_score):
            bad("frozen_experts", f"freezes a linear gate's rows of a routing that picks experts by their scores, one "
                                  f"row per expert (here --moe-gate {self.gate}, --moe-routing {self.routing})")
        if self.eval_top_k is not None and self.eval_top_k > self.num_experts:
            bad("eval_top_k", f"must be an integer in [1, --moe-expert-count {self.num_experts}]")
        if self.gate_noise == "jitter" and self.gate_noise_scale >= 1:
            bad("gate_noise_scale", "must be < 1 with jitter")
        for name in ("top_k", "eval_top_k"):
            if policy.only_top_k is not None and getattr(self, name) not in (None, policy.only_top_k):
                bad(name, f"must be {policy.only_top_k} with --moe-routing {self.routing}")
        if not policy.learned_router and self.gate_noise != "none":
            bad("gate_noise", f"has nothing to act on with --moe-routing {self.routing} (no router)")
        if self.cmr and self.shared_experts != 1:
            bad("cmr", f"mixes one dense FFN with the routed experts: needs --moe-shared-expert-count 1 (here "
                       f"{self.shared_experts})")
        if self.cmr_gate_drop and not self.cmr:
            bad("cmr_gate_drop", "is the dropout of --moe-cmr's gate, which is off")
        for name in ("expert_output_masking", "final_output_masking", "cmr", "shared_expert_gate"):
            if policy.slots and getattr(self, name):
                bad(name, f"applies to routed tokens, not to --moe-routing {self.routing}'s slots")
        if self.shared_expert_ffn_dim is not None and not self.shared_experts:
            bad("shared_expert_ffn_dim", "sizes the shared experts, of which there are none "
                                         "(--moe-shared-expert-count 0)")
        if self.shared_expert_gate and not self.shared_experts:
            bad("shared_expert_gate", "gates the shared experts, of which there are none (--moe-shared-expert-count 0)")
        if self.shared_expert_gate and self.cmr:
            bad("shared_expert_gate", "and --moe-cmr both gate the shared expert: choose one")
        if self.balance_loss_scope != "batch" and not policy.balance_loss:
            bad("balance_loss_scope", f"sets the balance loss, which --moe-routing {self.routing} has not (it "
                                      f"balances the load itself)")
        if self.capacity_counts_padding and not policy.has_capacity:
            bad("capacity_counts_padding", f"has no capacity to set with --moe-routing {self.routing}")
        if not policy.dropless and not self.capacity_factor > 0:
            bad("capacity_factor", f"must be > 0 with --moe-routing {self.routing} (it has no dropless form)")
        for other in ROUTINGS.values():  # another policy's options keep their defaults
            for name, f in other.options.items():
                if other is not policy and getattr(self, name) != f.default:
                    bad(name, f"applies to --moe-routing {other.name} (here {self.routing})")
        policy.check(self)
        return self

    def capacity(self, num_tokens, training):
        """Assignments each expert may take for num_tokens tokens, or None for dropless.

        Exact rational arithmetic on the factor as the user wrote it: in floats 1.1 * 2 * 45 / 3
        is 33.000000000000004, whose ceil would be one too many.
        """
        if not training and self.eval_capacity_token_fraction >= 0:
            if self.eval_capacity_token_fraction == 0:  # dropless, where the policy has that form
                return None if ROUTINGS[self.routing].dropless else self.capacity(num_tokens, True)
            return math.ceil(_exact(self.eval_capacity_token_fraction) * num_tokens)
        if self.capacity_factor == 0:
            return None
        if self.capacity_rounding == "per_choice":
            return self.top_k * math.ceil(_exact(self.capacity_factor) * num_tokens / self.num_experts)
        return math.ceil(_exact(self.capacity_factor) * self.top_k * num_tokens / self.num_experts)

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}


_OPTIONS = [(name, annotation(f), f) for policy in ROUTINGS.values() for name, f in policy.options.items()]
_TAKEN = [name for name, _, _ in _OPTIONS] + [f.name for f in fields(LayerSettings)]
if len(set(_TAKEN)) != len(_TAKEN):
    raise ValueError(f"two settings of the same name among the layer's and the policies' options: {sorted(_TAKEN)}")
MoEConfig = dataclasses.make_dataclass("MoEConfig", _OPTIONS, bases=(LayerSettings,))
_SEALED.append(True)
MoEConfig.__module__ = __name__  # (pickle and repr find it here)
MoEConfig.__doc__ = """Settings of one MoE layer: LayerSettings' and every routing policy's options (see each
field's metadata for its flag)."""
# The fairseq flag that sets each field, so that an error names what the user typed.
FLAGS = {f.name: flag_of(f) for f in settings(MoEConfig)}
