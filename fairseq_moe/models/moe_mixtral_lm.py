"""The `moe_mixtral_lm` model: the decoder of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (Llama's skeleton) with an
MoE block (MoEFeedForward, as in moe_transformer) in every N-th layer and a dense SwiGLU MLP in the others.

Given the same weights it computes what transformers' MixtralForCausalLM computes at eval (dropless routing):
token embedding without scale or positions, pre-norm layers with RMSNorm, rotary positions (the NeoX halves) from 0,
grouped-query attention, SwiGLU, a final RMSNorm and an untied output projection. The flags cover the other three's
options: --qkv-bias (Qwen2-MoE), --attention-bias, --qk-norm head (Qwen3-MoE) or full (OLMoE), --decoder-head-dim
with H x hd != d (Qwen3-MoE). Their state-dict keys are HF's where the module is the same (self_attn.q_proj,
input_layernorm, mlp.gate_proj ...); an MoE block is `fc1`, as every tool of the package expects.
Letters: B batch, T tokens of this call, S keys (cached + new), d model, H heads, K kv heads, hd head dim, V vocab.
"""
import torch
import torch.nn.functional as F
from torch import nn

from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.models import FairseqIncrementalDecoder, FairseqLanguageModel, register_model
from fairseq.models.transformer_lm import DEFAULT_MAX_TARGET_POSITIONS
from fairseq.utils import get_available_activation_fns

from ..errors import FlagError
from .moe_ffn import MoEFeedForward, token_ids
from .moe_transformer import TINY, MoEModelMixin, _wrap, add_moe_args, layer_settings, moe_arch, prepare_moe_build

QK_NORMS = ("none", "head", "full")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and cast back before the weight (HF's order: it matters in bf16)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rotary(positions, head_dim, theta, dtype):
    """(cos, sin) [T, hd] of rotary positions (fp32, then cast to the activations' dtype). Computed at each call, not
    kept as a buffer: a model cast to bf16 would round a buffer of frequencies too."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)  # [hd/2]
    freqs = positions.float()[:, None] * inv_freq[None]  # [T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x, cos, sin):
    """Rotary positions on x [B, heads, T, hd], the halves convention (GPT-NeoX, Llama and HF)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@with_incremental_state
class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions: kv head j serves query heads j*H/K .. (j+1)*H/K-1.
    Decoding step by step, the keys and values (after rotation) are cached in fairseq's incremental_state."""

    def __init__(self, args):
        super().__init__()
        d, H, K, hd = args.decoder_embed_dim, args.decoder_attention_heads, args.decoder_kv_heads, args.head_dim
        self.heads, self.kv_heads, self.head_dim, self.dropout = H, K, hd, args.attention_dropout
        qkv_bias = args.qkv_bias or args.attention_bias
        self.q_proj = nn.Linear(d, H * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, K * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, K * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(H * hd, d, bias=args.attention_bias)
        self.qk_norm = args.qk_norm
        if self.qk_norm != "none":  # per head over hd (Qwen3-MoE), or over the whole projection (OLMoE)
            per_head = self.qk_norm == "head"
            self.q_norm = RMSNorm(hd if per_head else H * hd, args.rms_norm_eps)
            self.k_norm = RMSNorm(hd if per_head else K * hd, args.rms_norm_eps)

    def forward(self, x, cos, sin, key_padding_mask=None, incremental_state=None):
        """x [B, T, d] -> [B, T, d]; cos, sin [T, hd]; key_padding_mask [B, S] (True: padding) or None."""
        B, T, _ = x.shape
        H, K, hd = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H*hd], [B, T, K*hd] (x2)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, K, hd).transpose(1, 2)  # [B, K, T, hd]
        v = v.view(B, T, K, hd).transpose(1, 2)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if incremental_state is not None:
            cache = self.get_incremental_state(incremental_state, "kv")
            if cache is not None:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)  # [B, K, S, hd]
            self.set_incremental_state(incremental_state, "kv", {"k": k, "v": v})
        S = k.shape[2]
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)  # [B, H, S, hd]
        scores = q @ k.transpose(2, 3) * hd ** -0.5  # [B, H, T, S]
        # Query t (position S - T + t) sees keys 0 .. S - T + t. finfo.min, not -inf: a row of padding alone
        # (left padding) stays finite, as in HF.
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).triu(S - T + 1)[None, None]  # [1, 1, T, S]
        if key_padding_mask is not None:
            mask = mask | key_padding_mask[:, None, None, :]
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, self.dropout, self.training)
        out = (probs @ v).transpose(1, 2).reshape(B, T, H * hd)  # [B, T, H*hd]
        return self.o_proj(out)

    def reorder_incremental_state(self, incremental_state, new_order):
        """Beam search: the cache's sentences in new_order."""
        cache = self.get_incremental_state(incremental_state, "kv")
        if cache is not None:
            self.set_incremental_state(incremental_state, "kv",
                                       {key: value.index_select(0, new_order) for key, value in cache.items()})


class SwiGLU(nn.Module):
    """The dense MLP of the layers that are not MoE: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, d, f):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + ffn(norm(x)); the FFN is the MoE block `fc1` in MoE layers, else `mlp`."""

    def __init__(self, args, index):
        super().__init__()
        d, eps = args.decoder_embed_dim, args.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.self_attn = Attention(args)
        self.dropout = args.dropout
        self.use_pad_mask = args.use_moe_pad_mask
        if index in args.moe_decoder_layer_ids:
            self.fc1 = MoEFeedForward(*layer_settings(args, "decoder", index))
        else:
            self.mlp = SwiGLU(d, args.decoder_ffn_embed_dim)

    def forward(self, x, cos, sin, key_padding_mask=None, incremental_state=None, token_padding_mask=None):
        """x [B, T, d] -> [B, T, d]; key_padding_mask [B, S] of the keys, token_padding_mask [B, T] of x's tokens
        (its last T columns; one tensor for every layer: the MoE blocks keep what they read of it on it)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, key_padding_mask, incremental_state)
        x = x + F.dropout(h, self.dropout, self.training)
        h = self.post_attention_layernorm(x)
        if hasattr(self, "fc1"):  # the block is time-major: [T, B, d]
            self.fc1.padding_mask = token_padding_mask if self.use_pad_mask else None
            try:
                h = self.fc1(h.transpose(0, 1)).transpose(0, 1)
            finally:
                self.fc1.padding_mask = None
        else:
            h = self.mlp(h)
        return x + F.dropout(h, self.dropout, self.training)


class MoEMixtralDecoder(FairseqIncrementalDecoder):
    """Embedding, the layers, final RMSNorm, output projection. Step by step (incremental_state), the tokens after the
    cached ones are computed, at the positions that follow them."""

    def __init__(self, args, dictionary):
        super().__init__(dictionary)
        d, V = args.decoder_embed_dim, len(dictionary)
        self.padding_idx = dictionary.pad()
        self.head_dim, self.rope_theta = args.head_dim, args.rope_theta
        self.max_target_positions = args.max_target_positions
        self.embed_tokens = nn.Embedding(V, d, padding_idx=self.padding_idx)
        self.layers = nn.ModuleList(_wrap(DecoderLayer(args, i), args) for i in range(args.decoder_layers))
        self.norm = RMSNorm(d, args.rms_norm_eps)
        self.output_projection = nn.Linear(d, V, bias=False)
        if args.share_decoder_input_output_embed:
            self.output_projection.weight = self.embed_tokens.weight
        self.reset_parameters(args.init_std)

    def reset_parameters(self, std):
        """Linear and Embedding weights N(0, std), biases 0, the padding row 0, norms 1 (HF's init). The MoE blocks
        keep their own (MoELayer: each expert from its own seed, the same whichever rank holds it)."""
        for name, m in self.named_modules():
            if ".fc1" in name:
                continue
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        with torch.no_grad():
            self.embed_tokens.weight[self.padding_idx].zero_()

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only=False, **kwargs):
        """prev_output_tokens [B, T_all] -> (logits [B, T, V], {"attn", "inner_states"})."""
        x, extra = self.extract_features(prev_output_tokens, incremental_state=incremental_state)
        return (x if features_only else self.output_layer(x)), extra

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        cache = None if incremental_state is None else self.get_incremental_state(incremental_state, "padding")
        past = 0 if cache is None else cache["mask"].shape[1]  # positions cached
        tokens = prev_output_tokens[:, past:]  # [B, T]
        padding = new_padding = tokens.eq(self.padding_idx)  # [B, T]
        if cache is not None:
            padding = torch.cat([cache["mask"], padding], dim=1)  # [B, S]
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "padding", {"mask": padding})
        key_padding_mask = padding if padding.any() else None
        positions = torch.arange(past, past + tokens.shape[1], device=tokens.device)  # [T], from 0 as HF's
        x = self.embed_tokens(tokens)  # [B, T, d]
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, x.dtype)
        inner_states = [x]
        with token_ids(self, tokens):  # (hash routing: the token at each position)
            for layer in self.layers:
                x = layer(x, cos, sin, key_padding_mask=key_padding_mask, incremental_state=incremental_state,
                          token_padding_mask=None if key_padding_mask is None else new_padding)
                inner_states.append(x)
        return self.norm(x), {"attn": [None], "inner_states": inner_states}

    def output_layer(self, features, **kwargs):
        return self.output_projection(features)

    def max_positions(self):
        return self.max_target_positions

    def reorder_incremental_state(self, incremental_state, new_order):
        cache = self.get_incremental_state(incremental_state, "padding")
        if cache is not None:
            self.set_incremental_state(incremental_state, "padding", {"mask": cache["mask"].index_select(0, new_order)})


@register_model("moe_mixtral_lm")
class MoEMixtralLanguageModel(MoEModelMixin, FairseqLanguageModel):
    """Mixtral-style MoE language model (Llama's decoder; MoE FFN in every N-th layer, every layer by default)."""

    @classmethod
    def add_args(cls, parser):
        # No defaults here: fairseq suppresses the flags not typed, and the archs set them (mixtral_architecture).
        add = parser.add_argument
        add("--decoder-embed-dim", type=int, metavar="D", help="model width d (default 4096; tiny 64)")
        add("--decoder-ffn-embed-dim", type=int, metavar="F",
            help="width of the dense SwiGLU MLPs, and of each expert unless --moe-expert-ffn-dim (default 14336)")
        add("--decoder-layers", type=int, metavar="N", help="number of decoder layers (default 32)")
        add("--decoder-attention-heads", type=int, metavar="H", help="query heads (default 32)")
        add("--decoder-kv-heads", type=int, metavar="K",
            help="key/value heads (grouped-query attention; K divides H; default 8; H: plain multi-head)")
        add("--decoder-head-dim", type=int, metavar="HD",
            help="width of each head (default d / H; Qwen3-MoE's H x HD may differ from d)")
        add("--rope-theta", type=float, metavar="THETA", help="base of the rotary frequencies (default 1e6)")
        add("--rms-norm-eps", type=float, metavar="EPS", help="epsilon of every RMSNorm (default 1e-5)")
        add("--qkv-bias", action="store_true", help="biases on the q, k, v projections, none on o (Qwen2-MoE)")
        add("--attention-bias", action="store_true",
            help="biases on the q, k, v and o projections (HF's attention_bias)")
        add("--qk-norm", choices=QK_NORMS,
            help="RMSNorm of queries and keys before the rotary positions: per head over the head dim (head: "
                 "Qwen3-MoE) or over the whole projection (full: OLMoE) (default none)")
        add("--init-std", type=float, metavar="STD",
            help="std of the normal init of the Linear and Embedding weights outside the MoE blocks (default 0.02)")
        add("--dropout", type=float, metavar="P", help="dropout on the residual branches (default 0)")
        add("--attention-dropout", type=float, metavar="P", help="dropout on the attention weights (default 0)")
        add("--activation-fn", choices=get_available_activation_fns(),
            help="the experts' activation with --moe-expert-kind ffn (default silu; the dense MLPs are SwiGLU)")
        add("--share-decoder-input-output-embed", action="store_true",
            help="tie the output projection to the token embedding (default untied)")
        add("--checkpoint-activations", action="store_true",
            help="recompute each layer in the backward pass (torch's non-reentrant checkpoint) to save memory")
        add_moe_args(parser, encoder=False)

    @classmethod
    def build_model(cls, args, task):
        check_flags(args)
        if getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = getattr(args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)
        args = prepare_moe_build(args, ("decoder",))
        args.head_dim = args.decoder_head_dim or args.decoder_embed_dim // args.decoder_attention_heads
        return cls(MoEMixtralDecoder(args, task.target_dictionary)).finish_moe(args)


def check_flags(args):
    """One FlagError naming the flag for each value the model cannot take (before anything is built)."""
    for flag in ("decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads",
                 "decoder_kv_heads"):
        if getattr(args, flag) < 1:
            raise FlagError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    H, K, hd, d = args.decoder_attention_heads, args.decoder_kv_heads, args.decoder_head_dim, args.decoder_embed_dim
    if H % K:
        raise FlagError(f"--decoder-kv-heads {K} must divide --decoder-attention-heads {H}")
    if hd is None and d % H:
        raise FlagError(f"--decoder-embed-dim {d} is not a multiple of --decoder-attention-heads {H}: "
                        f"give --decoder-head-dim")
    if (hd or d // H) % 2 or (hd is not None and hd < 2):
        raise FlagError(f"--decoder-head-dim {hd or d // H} must be even and >= 2 (rotary positions turn pairs)")
    for flag in ("rope_theta", "rms_norm_eps", "init_std"):
        if not getattr(args, flag) > 0:
            raise FlagError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    for flag in ("dropout", "attention_dropout"):
        if not 0 <= getattr(args, flag) < 1:
            raise FlagError(f"--{flag.replace('_', '-')} must be in [0, 1), got {getattr(args, flag)}")


def mixtral_architecture(args):
    """Mixtral-8x7B's sizes and settings (and the MoE ones: every layer, 8 swiglu experts, k 2 by default)."""
    for key, value in dict(
            decoder_embed_dim=4096, decoder_ffn_embed_dim=14336, decoder_layers=32, decoder_attention_heads=32,
            decoder_kv_heads=8, decoder_head_dim=None, rope_theta=1e6, rms_norm_eps=1e-5, qkv_bias=False,
            attention_bias=False, qk_norm="none", init_std=0.02, dropout=0.0, attention_dropout=0.0,
            activation_fn="silu", share_decoder_input_output_embed=False, checkpoint_activations=False,
            # Mixtral is dropless: at eval here too (training keeps the layer's capacity unless set).
            moe_freq=1, moe_expert_count=8, moe_expert_kind="swiglu", moe_eval_capacity_token_fraction=0.0).items():
        setattr(args, key, getattr(args, key, value))


moe_mixtral_lm = moe_arch("moe_mixtral_lm", "moe_mixtral_lm", mixtral_architecture)
# For CPU runs: 2 layers of d 64, 4 heads sharing 2 kv heads, SwiGLU 128 wide, 4 experts in every layer.
moe_mixtral_lm_tiny = moe_arch("moe_mixtral_lm", "moe_mixtral_lm_tiny", mixtral_architecture, **TINY,
                               decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=2,
                               decoder_attention_heads=4, decoder_kv_heads=2)
