"""Optimizers with the experts spread over ranks: ZeRO (ExpertZeRO), Adafactor (ExpertAdafactor) and --fp16's flat
fp32 copy (ExpertFlatFP16Optimizer).

## --zero-sharding os: the replicated parameters' optimizer state cut over the ranks

fairseq's ZeRO (fairscale's OSS) gives each parameter to one rank, which steps it and broadcasts the result. An
expert parameter holds different experts on each rank, so its owner's broadcast would overwrite the others'
experts. Here (ExpertZeRO, in place of fairseq's optim.shard_ when any parameter is an expert's):
- each dense parameter (marked without `.expert`: embeddings, attention, norms, routers, shared experts) has
  one owner among the data-parallel ranks, by a greedy split of their sizes in parameter order (the same on
  every rank); its owner alone keeps its optimizer state and steps it, then each rank broadcasts what it owns;
- every rank keeps the state of its own experts and steps them (each rank holds different ones).

The state dict is numbered like the unsharded optimizer's (one index per parameter, fairseq's order), holding
only this rank's entries, and says so under ZERO_KEY: a set saves each rank's dense entries in its own rank
file (checkpoints/sets.split), and a load merges every file's entries, from which each rank takes its own. So
a set resumes on any world size, with or without the flag, and a single file (consolidated, resharded) loads
into sharded ranks too. The gradients stay whole on every rank (data parallelism all-reduces them as before):
clipping and the loss scaler see every gradient.

## --optimizer adafactor: each expert its own parameter
fairseq's Adafactor treats a stacked expert tensor [E, ...] as one parameter: the factored statistics of a bias
[E, f] (its column means) and the scale of the update (the RMS of the parameter and of the update) mix the experts,
so a rank holding some of them cannot compute what one process computes. ExpertAdafactor (fairseq's Adafactor, in
its place) computes each expert of a parameter marked `.expert` as the moe branch's separate nn.Linear experts
would be: the same step of fairseq's code, on each slice [d, f] or [f]; its state (second-moment rows and columns,
RMS) is per expert along the first dimension, so a set cuts it like the experts. Other parameters: fairseq's step.

## --fp16: the flat fp32 copy
fairseq's FP16Optimizer keeps one flat fp32 tensor of every parameter: its state cannot be cut per expert, its
clipping norm takes in the experts (different on each rank), and it is built on torch.cuda.current_device().
ExpertFlatFP16Optimizer (in its place where a parameter is an expert's) keeps the dense parameters flat on their
device and each expert tensor apart, and numbers its state dict by parameter as the non-flat copy does.
"""
import math
import types

import torch
import torch.distributed as dist

from fairseq_moe_layer.experts import is_expert

from .masters import ExpertMasters, expert_fp16_class
from ..checkpoints.sets import ZERO_KEY  # in a state dict: {"world_size": W}: "state" holds one rank's entries
from ..errors import CheckpointError


def owners(sizes, world_size):
    """The rank that owns each of the parameters of these sizes (numel): each to the least loaded rank so far,
    largest first, ties to the lower index and the lower rank (deterministic: the same on every rank)."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ExpertZeRO(torch.optim.Optimizer):
    """An optimizer of optim_cls over param_groups whose dense parameters' state is sharded over group's ranks
    (see the module's docstring). param_groups keeps every parameter (fairseq sets the learning rate there and
    clips every gradient); the inner optimizer holds what this rank steps."""

    def __init__(self, param_groups, optim_cls, group=None, **defaults):
        super().__init__(param_groups, defaults)
        self.group = group
        together = dist.is_available() and dist.is_initialized()
        self.world_size, self.rank = (dist.get_world_size(group), dist.get_rank(group)) if together else (1, 0)
        params = [p for g in self.param_groups for p in g["params"]]
        dense = [i for i, p in enumerate(params) if not is_expert(p)]
        owner = owners([params[i].numel() for i in dense], self.world_size)
        self.owner = {i: r for i, r in zip(dense, owner)}  # global index -> its rank
        self.mine = [[i for i in self._indices(g) if self.owner.get(i, self.rank) == self.rank]
                     for g in range(len(self.param_groups))]  # per group: the global indices stepped here
        inner_groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[params[i] for i in mine])
                        for g, mine in zip(self.param_groups, self.mine)]
        self.inner = optim_cls([g for g in inner_groups if g["params"]], **defaults) if any(self.mine) else None
        self._inner_of = [g for g, mine in enumerate(self.mine) if mine]  # inner group -> its group here
        self._params = params
        self.state = self.inner.state if self.inner is not None else {}

    def _indices(self, g):
        first = sum(len(self.param_groups[j]["params"]) for j in range(g))
        return range(first, first + len(self.param_groups[g]["params"]))

    def __getattr__(self, name):  # the inner optimizer's supports_* (fairseq asks FairseqOptimizer.optimizer)
        if name.startswith("supports") or name == "disable_mem_eff_fp16_loading_hack":
            inner = self.__dict__.get("inner")
            return name == "disable_mem_eff_fp16_loading_hack" or getattr(inner, name, False)
        raise AttributeError(f"'ExpertZeRO' object has no attribute {name!r}")

    def _sync_groups(self):
        """The learning rate (and any other setting fairseq changed in param_groups) into the inner groups."""
        if self.inner is None:
            return
        for inner, g in zip(self.inner.param_groups, self._inner_of):
            inner.update({k: v for k, v in self.param_groups[g].items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        self._sync_groups()
        loss = self.inner.step(closure, **kwargs) if self.inner is not None else None
        self._broadcast()
        return loss

    def _broadcast(self):
        """Each dense parameter from its owner to every rank: one flat buffer per (owner, dtype)."""
        if self.world_size == 1:
            return
        buckets = {}
        for i, r in self.owner.items():
            buckets.setdefault((r, self._params[i].dtype, self._params[i].device), []).append(self._params[i])
        for (r, dtype, device), ps in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            dist.broadcast(flat, src=dist.get_global_rank(self.group, r) if self.group is not None else r,
                           group=self.group)
            if r != self.rank:
                offset = 0
                for p in ps:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _inner_to_global(self):
        return [i for g in self._inner_of for i in self.mine[g]]

    def state_dict(self):
        """This rank's entries, numbered like the unsharded optimizer's state dict."""
        groups = [dict({k: v for k, v in g.items() if k != "params"}, params=list(self._indices(j)))
                  for j, g in enumerate(self.param_groups)]
        state = {}
        if self.inner is not None:
            inner = self.inner.state_dict()
            to_global = self._inner_to_global()
            state = {to_global[j]: entry for j, entry in inner["state"].items()}
        return {"state": state, "param_groups": groups, ZERO_KEY: {"world_size": self.world_size}}

    def load_state_dict(self, state_dict):
        """From a state dict numbered like the unsharded optimizer's (all entries, or some ranks' only): the
        settings of every group, and the state of what this rank steps."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters per "
                             "group than this optimizer")
        for s, g in zip(saved, self.param_groups):
            g.update({k: v for k, v in s.items() if k != "params"})
        if self.inner is None:
            return
        # a saved group's own numbering of its parameters -> this optimizer's global index
        saved_index = {idx: i for j, s in enumerate(saved) for idx, i in zip(s["params"], self._indices(j))}
        by_global = {saved_index[k]: v for k, v in state_dict["state"].items() if k in saved_index}
        to_global = self._inner_to_global()
        inner_groups, first = [], 0  # (the inner optimizer numbers its parameters 0, 1, ... across its groups)
        for g in self._inner_of:
            inner_groups.append(dict({k: v for k, v in saved[g].items() if k != "params"},
                                     params=list(range(first, first + len(self.mine[g])))))
            first += len(self.mine[g])
        self.inner.load_state_dict({"state": {j: by_global[i] for j, i in enumerate(to_global) if i in by_global},
                                    "param_groups": inner_groups})
        # torch casts the loaded state to each parameter's dtype: with --memory-efficient-fp16 an fp16 parameter
        # keeps an fp32 state (fairseq's own hack does this for the unsharded optimizer; here, for what this rank
        # steps only). Copied: the state must not stay backed by a memory-mapped checkpoint file.
        for i in to_global:
            if i in by_global:
                p = self._params[i]
                self.inner.state[p] = {k: (v.clone() if k == "step" else v.to(p.device, copy=True))
                                       if torch.is_tensor(v) else v for k, v in by_global[i].items()}  # (torch
                # keeps a step counter on the CPU unless capturable)
        self.state = self.inner.state


def shard_with_experts(fairseq_shard):
    """fairseq's optim.shard_(optimizer, group), or ExpertZeRO where an expert's parameter is among the
    optimizer's (fairscale's OSS would broadcast one rank's experts over the others')."""

    def shard_(optimizer, group):
        torch_optimizer = optimizer.optimizer
        if not any(is_expert(p) for g in torch_optimizer.param_groups for p in g["params"]):
            return fairseq_shard(optimizer, group)
        optimizer.optimizer = ExpertZeRO(torch_optimizer.param_groups, type(torch_optimizer), group=group,
                                         **optimizer.optimizer_config)

    return shard_


def expert_adafactor_init(fairseq_init):
    """FairseqAdafactor.__init__, its torch optimizer an ExpertAdafactor."""

    def __init__(self, args, params):
        params = list(params)
        fairseq_init(self, args, params)
        self._optimizer = expert_adafactor_class()(params, **self.optimizer_config)

    return __init__


_CLASSES = {}


def expert_adafactor_class():
    """fairseq.optim.adafactor.Adafactor, with each expert of a `.expert` parameter stepped as its own parameter."""
    if "adafactor" in _CLASSES:
        return _CLASSES["adafactor"]
    from fairseq.optim.adafactor import Adafactor as fairseq_adafactor

    class ExpertAdafactor(fairseq_adafactor):
        def step(self, closure=None):
            loss = closure() if closure is not None else None
            for group in self.param_groups:
                experts = [p for p in group["params"] if is_expert(p) and p.grad is not None]
                if len(experts) < len(group["params"]):  # fairseq's step for the others, in their own group
                    others = [p for p in group["params"] if not is_expert(p)]
                    self._fairseq_step(group, others)
                for p in experts:
                    self._expert_step(group, p)
            return loss

        def _fairseq_step(self, group, params):
            everything = self.param_groups
            self.param_groups = [dict(group, params=params)]
            try:
                fairseq_adafactor.step(self)
            finally:
                group["lr"] = self.param_groups[0]["lr"]  # (fairseq's step writes its lr into the group)
                self.param_groups = everything

        def _expert_step(self, group, p):
            """fairseq's Adafactor step on each expert p[e] (vectorised over the first dimension)."""
            grad = p.grad.data.float() if p.grad.dtype in (torch.float16, torch.bfloat16) else p.grad.data
            E, shape = grad.shape[0], grad.shape[1:]
            factored, first_moment = len(shape) >= 2, group["beta1"] is not None
            state = self.state[p]
            if not factored and "exp_avg_sq_row" in state:  # fairseq's state of the stacked [E, f] (older runs):
                row, col = state.pop("exp_avg_sq_row"), state.pop("exp_avg_sq_col")  # its approximation of the
                state["exp_avg_sq"] = (row.unsqueeze(1) * col.unsqueeze(0) / row.mean()).to(grad)  # second moment
            if len(state) == 0:
                state["step"] = 0
                if first_moment:
                    state["exp_avg"] = torch.zeros_like(grad)
                if factored:
                    state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1]).to(grad)  # [E, d]
                    state["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:]).to(grad)  # [E, f]
                else:
                    state["exp_avg_sq"] = torch.zeros_like(grad)
            for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(grad)
            data = p.data.float() if p.data.dtype in (torch.float16, torch.bfloat16) else p.data
            per_expert = (E,) + (1,) * len(shape)  # a value per expert, broadcast over its slice

            def rms(t):  # [E]: each expert's root mean square
                return t.reshape(E, -1).norm(dim=1) / math.sqrt(t[0].numel())

            state["step"] += 1
            state["RMS"] = rms(data)
            step_size = group["lr"]
            if group["relative_step"]:
                floor = 1e-6 * state["step"] if group["warmup_init"] else 1e-2
                step_size = min(floor, 1.0 / math.sqrt(state["step"]))
            lr = (torch.clamp(state["RMS"], min=group["eps"][1]) * step_size if group["scale_parameter"]
                  else torch.full((E,), float(step_size), dtype=grad.dtype, device=grad.device)).view(per_expert)
            beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
            update = grad ** 2 + group["eps"][0]
            if factored:
                row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                update = self._approx_sq_grad(row, col).mul_(grad)  # (per expert: the means run over its rows)
            else:
                state["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                update = state["exp_avg_sq"].rsqrt().mul_(grad)
            update.div_((rms(update) / group["clip_threshold"]).clamp_(min=1.0).view(per_expert))
            update.mul_(lr)
            if first_moment:
                state["exp_avg"].mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
                update = state["exp_avg"]
            if group["weight_decay"] != 0:
                data.add_(data * (-group["weight_decay"] * lr))
            data.add_(-update)
            if p.data.dtype in (torch.float16, torch.bfloat16):
                p.data.copy_(data)

    _CLASSES["adafactor"] = ExpertAdafactor
    return ExpertAdafactor


def all_finite(tensors):
    """Whether every element of these tensors is finite, as a 0-d bool tensor on their device: from each one's
    smallest and largest element (aminmax propagates NaN; an inf is its own extreme), one reduction that allocates
    nothing, where torch.isfinite(t).all() writes a bool tensor of t's size first (18x slower on a CPU core for a
    134 MB expert gradient: 0.09 s against 0.005 s)."""
    finite = [torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all() for t in tensors if t.numel()]
    if not finite:  # (each in its own dtype: a float64 extreme past fp32's range is no overflow)
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    return torch.stack(finite).all()


def clip_grad_norm(original):
    """fairseq.utils.clip_grad_norm_ with experts. fairseq leaves the experts' gradients out of the norm (and clips
    them by the others'), so an overflow or a NaN in an expert's gradient went unseen: the fp16 loss scaler kept the
    step, and that rank's experts became inf. Here the norm is inf where any expert gradient, on any rank, is not
    finite (one all-reduce of a flag over the job): every rank skips the step (fp16: the scaler's overflow) or stops
    (fp32: fairseq's FloatingPointError) together. Gradients of a sharded model (DTensors): fsdp.clip_sharded."""
    from . import fsdp

    def clip(params, max_norm, aggregate_norm_fn=None):
        params = [params] if torch.is_tensor(params) else list(params)
        grads = [p.grad for p in params if p is not None and getattr(p, "grad", None) is not None]
        if any(fsdp.is_dtensor(g) for g in grads):
            norm = fsdp.clip_sharded(params, max_norm, aggregate_norm_fn)
        else:
            norm = original(params, max_norm, aggregate_norm_fn)
        if not any(p is not None and is_expert(p) for p in params):  # (on every rank alike: the flag's collective)
            return norm
        experts = [p.grad for p in params if p is not None and getattr(p, "grad", None) is not None and is_expert(p)]
        experts += [p.half_grad for p in params if getattr(p, "half_grad", None) is not None]  # (masters.py)
        bad = torch.zeros((), dtype=torch.float32, device=norm.device)
        if experts:
            bad = all_finite(experts).logical_not().to(bad)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return torch.where(bad > 0, torch.full_like(norm, float("inf")), norm)

    return clip


def flat_fp16_with_experts(fairseq_build):
    """FP16Optimizer.build_optimizer (--fp16 and --bf16, fp32 master copies) where an expert's parameter is among
    the parameters: ExpertFlatFP16Optimizer for the flat copy (--fp16), masters.ExpertFP16Optimizer without it
    (--bf16, --fp16-no-flatten-grads); else, and for --optimizer composite, fairseq's."""
    fairseq_build = fairseq_build.__func__  # (a classmethod in the class's __dict__)

    def build_optimizer(cls, cfg, params, **kwargs):
        params = list(params)
        flatten = not getattr(cfg.common, "fp16_no_flatten_grads", False) and not getattr(cfg.common, "bf16", False)
        composite = getattr(cfg.optimizer, "_name", None) == "composite"  # (its state is one dict per group)
        if composite or not any(is_expert(p) for p in params):
            return fairseq_build(cls, cfg, params, **kwargs)
        if flatten:
            return flat_fp16_class().build(cfg, params, **kwargs)
        from fairseq.optim.fp16_optimizer import FP16Optimizer

        from .fsdp import is_dtensor
        if cls is FP16Optimizer and not any(is_dtensor(p) for p in params):  # (masters.py: plain tensors' masters)
            cls = expert_fp16_class()
        return fairseq_build(cls, cfg, params, **kwargs)

    return classmethod(build_optimizer)


def flat_fp16_class():
    """fairseq's FP16Optimizer with experts (see ExpertFlatFP16Optimizer's docstring)."""
    if "flat_fp16" in _CLASSES:
        return _CLASSES["flat_fp16"]
    from fairseq import optim as fairseq_optim
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from ..errors import CheckpointError, FlagError

    class ExpertFlatFP16Optimizer(ExpertMasters, FP16Optimizer):
        """--fp16 with its flat fp32 master copy, with experts: the dense parameters' fp32 copy is one flat tensor
        (fairseq's, built on the parameters' device: fairseq's own is on torch.cuda.current_device()), and each
        expert tensor has an fp32 copy of its own, marked `.expert` (clipping and the set see experts as the
        non-flat optimizer's). The state dict is numbered by parameter like the non-flat optimizer's, the flat
        state cut into each parameter's slice: a set cuts the experts' state, and a set of a flat run resumes
        with --fp16-no-flatten-grads and the other way round (--memory-efficient-fp16 is another optimizer to
        fairseq's resume: --reset-optimizer)."""

        @classmethod
        def build(cls, cfg, params, **kwargs):
            dense = [p for p in params if not is_expert(p)]
            flat = torch.nn.Parameter(torch.cat([p.data.float().reshape(-1) for p in dense]) if dense else
                                      params[0].data.new_zeros(0, dtype=torch.float32))
            flat.grad = torch.zeros_like(flat.data)
            experts = []
            for p in params:
                if is_expert(p):
                    p32 = torch.nn.Parameter(p.data.float())
                    p32.expert, p32.grad = True, torch.zeros_like(p32.data)
                    experts.append(p32)
            fp32_optimizer = fairseq_optim.build_optimizer(cfg.optimizer, [flat, *experts])
            if not fp32_optimizer.supports_flat_params:
                raise FlagError(f"--optimizer {cfg.optimizer._name} does not support a flat fp32 copy (--fp16): add "
                                f"--fp16-no-flatten-grads")
            return cls(cfg, params, fp32_optimizer, [flat, *experts], **kwargs)

        def __init__(self, cfg, params, fp32_optimizer, fp32_params, **kwargs):
            super().__init__(cfg, params, fp32_optimizer, fp32_params, **kwargs)
            self.dense = [i for i, p in enumerate(params) if not is_expert(p)]
            self.experts = [i for i, p in enumerate(params) if is_expert(p)]
            self.flat, self.expert_fp32 = fp32_params[0], fp32_params[1:]

        def _slices(self):
            offset = 0
            for i in self.dense:
                n = self.fp16_params[i].numel()
                yield i, slice(offset, offset + n)
                offset += n

        def _expert_pairs(self):
            return [(self.fp16_params[i], p32) for i, p32 in zip(self.experts, self.expert_fp32)]

        def _zero_dense_grads(self):
            self.flat.grad.zero_()

        def _sync_dense_grads(self):
            for i, where in self._slices():
                p = self.fp16_params[i]
                if p.grad is None:
                    self.flat.grad.data[where].zero_()
                else:
                    self.flat.grad.data[where].copy_(p.grad.data.reshape(-1))

        def _sync_fp32_params_to_fp16(self):
            for i, where in self._slices():
                p = self.fp16_params[i]
                p.data.copy_(self.flat.data[where].view_as(p.data))
            for i, p32 in zip(self.experts, self.expert_fp32):
                if id(self.fp16_params[i]) not in self._written:  # (masters.py: the one pass wrote it)
                    self.fp16_params[i].data.copy_(p32.data)

        def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
            """fairseq's FP16Optimizer.clip_grad_norm, the norm taken over each dense parameter's slice of the flat
            gradient, as the non-flat copy takes it over each parameter (the same bits; fairseq leaves the experts
            out of the norm and scales them by it)."""
            from fairseq import utils

            self._sync_fp16_grads_to_fp32()
            slices = [types.SimpleNamespace(grad=self.flat.grad.data[where].view(self.fp16_params[i].shape))
                      for i, where in self._slices()]  # (+ the experts: left out of the norm, checked for overflow)
            grad_norm = self._multiply_factor * utils.clip_grad_norm_([*slices, *self.expert_fp32], 0,
                                                                      aggregate_norm_fn)
            if torch.is_tensor(self._multiply_factor):
                self._multiply_factor = self._multiply_factor.to(grad_norm.device)
            if self.scaler is not None:
                if grad_norm > max_norm > 0.0:
                    self._multiply_factor *= max_norm / grad_norm
                self.scaler.check_overflow(grad_norm)
            elif max_norm > 0.0:
                self._multiply_factor *= (max_norm / (grad_norm + 1e-6)).clamp_(max=1)
            return grad_norm

        def _is_flat(self, value):
            return torch.is_tensor(value) and value.dim() == 1 and value.numel() == self.flat.numel() > 0

        def state_dict(self):
            state_dict = super().state_dict()
            inner, out = state_dict["state"], {}
            if 0 in inner:
                for i, where in self._slices():
                    shape = self.fp16_params[i].shape
                    # (views of the live state, as fairseq's own state dict gives: a save copies them to the CPU)
                    out[i] = {k: v[where].view(shape) if self._is_flat(v) else
                              (v.clone() if torch.is_tensor(v) else v) for k, v in inner[0].items()}
            for j, i in enumerate(self.experts):
                if j + 1 in inner:
                    out[i] = inner[j + 1]
            group, = state_dict["param_groups"]  # (fairseq's flat copy is one group)
            groups = [{**group, "params": list(range(len(self.fp16_params)))}]
            return {**state_dict, "state": out, "param_groups": groups}

        def load_state_dict(self, state_dict, optimizer_overrides=None):
            state = state_dict["state"]
            have = [i for i in self.dense if i in state]
            inner = {}
            if have:
                if len(have) != len(self.dense):
                    raise CheckpointError(f"the optimizer state holds {len(have)} of the {len(self.dense)} dense "
                                          f"parameters' entries: a flat fp32 copy (--fp16) needs all or none; "
                                          f"resume with --reset-optimizer, or --fp16-no-flatten-grads")
                first = state[self.dense[0]]
                elementwise = {k for k in first if any(torch.is_tensor(state[i][k]) and state[i][k].dim() > 0
                                                       for i in self.dense)}  # (a scalar parameter's are 0-dim)
                inner[0] = {k: torch.cat([state[i][k].reshape(-1).float() for i in self.dense]) if k in elementwise
                            else v for k, v in first.items()}
            for j, i in enumerate(self.experts):
                if i in state:
                    inner[j + 1] = state[i]
            group = state_dict["param_groups"][0]
            super().load_state_dict({**state_dict, "state": inner,
                                     "param_groups": [{**group, "params": list(range(1 + len(self.experts)))}]},
                                    optimizer_overrides)

    # fairseq's resume compares the optimizer's class name with the saved one: this state dict is FP16Optimizer's
    # (numbered by parameter, as without the flat copy), so it goes by that name and each resumes from the other.
    ExpertFlatFP16Optimizer.__name__ = ExpertFlatFP16Optimizer.__qualname__ = FP16Optimizer.__name__
    _CLASSES["flat_fp16"] = ExpertFlatFP16Optimizer
    return ExpertFlatFP16Optimizer


# The optimizer classes fairseq's Trainer wraps around the optimizer for half precision, and their flags.
HALF_PRECISION = {"FP16Optimizer": "--fp16 or --bf16", "MemoryEfficientFP16Optimizer": "--memory-efficient-fp16 or "
                  "--memory-efficient-bf16", "AMPOptimizer": "--amp"}


def check_resumed_precision(state, common, path, reset_optimizer):
    """A checkpoint saved with --fp16 (--bf16, --amp) resumed without it, or the other way round: fairseq's Trainer
    refuses it for any model, dense or not (an AssertionError "Optimizer does not match" on every rank, after the
    model has loaded): its optimizer state is the half-precision wrapper's (the fp32 master copy, the loss scale)
    or the bare optimizer's, not both. Refused here by name before anything loads; --reset-optimizer (a new
    optimizer over the checkpoint's weights) is fairseq's way, and passes."""
    history = state.get("optimizer_history") or []
    if reset_optimizer or not history or state.get("last_optimizer_state") is None:
        return
    saved = history[-1].get("optimizer_name")
    if saved == "FairseqBMUF":  # (--use-bmuf wraps whichever optimizer: its name does not say; fairseq's check)
        return
    half_now = bool(common.fp16 or common.bf16 or common.amp)
    if (saved in HALF_PRECISION) == half_now:
        return
    if half_now:
        said = f"was saved without --fp16, --bf16 or --amp (its optimizer state is {saved}'s)"
        asked = "this run asks for half precision"
    else:
        said = f"was saved with {HALF_PRECISION[saved]} (its optimizer state is {saved}'s: the fp32 master copy)"
        asked = "this run has none of --fp16, --bf16, --amp"
    raise CheckpointError(f"{path} {said} and {asked}: resume it with the precision flags it was saved with, or "
                          "give --reset-optimizer to start a new optimizer from its weights")
