"""--ddp-backend fully_sharded on torch's FSDP (`fully_shard`), the experts left expert-parallel.

fairseq 0.12's fully_sharded backend is fairscale's FSDP, which gathers parameters on CUDA streams (it does not run
on a CPU, nor, with gloo, anywhere here) and would shard the experts a second time, across ranks that hold different
ones. With the plugin loaded the flag runs torch's FSDP instead, for models with MoE layers (refusals.py keeps the
others out; fairseq's Trainer sees a data-parallel run that is not fairscale's: `trainer_is_fsdp`):
- each layer of `encoder.layers` / `decoder.layers` with at least --min-params-to-wrap dense parameters is its own
  unit (its parameters gathered for its forward and backward only; --no-reshard-after-forward keeps them from the
  forward to the backward), the rest of the model one unit around them, kept gathered from its forward to its
  backward; a beam search (--eval-bleu) runs with every unit gathered (`gathered`), and so do the empty MoE
  calls by which a rank that is done serves the others' (lockstep);
- every dense parameter (embeddings, attention, norms, routers, shared experts) is a DTensor holding 1/W of its rows,
  its gradient is reduce-scattered (averaged, as data parallelism's all-reduce does) and its optimizer state is
  created from the shard, so parameters, gradients and optimizer state take about 1/W each;
- expert parameters (marked `.expert`) are left out (`ignored_params`): each rank keeps its own experts whole, their
  gradients made by the all-to-all and comm.expert_grad_hook as without FSDP.

The checkpoint is the set a run without FSDP writes: the model's and the optimizer's state dicts gather each dense
tensor whole onto the CPU (one at a time; every rank saves its experts, so every rank takes part; every rank then
holds the whole dense state in CPU memory for the save) and a load cuts each back to this rank's rows. So a set of
an FSDP run resumes with or without the flag on any world size, and reshard, consolidate and generate read it as
any other. (fairseq's own FSDP also saves whole state unless --use-sharded-state.)
Clipping (`clip_sharded`, called by optim.clip_grad_norm) sums the squares of each rank's rows over the ranks: the
norm of the whole gradients.
"""
import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn

from fairseq_moe_layer import lockstep
from fairseq_moe_layer.experts import is_expert

from ..errors import FlagError

logger = logging.getLogger(__name__)
DEFAULT_MIN_PARAMS_TO_WRAP = int(1e8)  # fairseq's default of --min-params-to-wrap
_SHAPES_ONLY = []  # inside shapes_only(): state dicts keep their DTensors (no gathering)


def is_sharded(model):
    return getattr(model, "_moe_fsdp_mesh", None) is not None


def is_dtensor(t):
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def shard(model, group, device, cfg):
    """Shard `model` in place over `group`'s ranks (see the module's docstring); returns it. cfg: the distributed
    training config (--no-reshard-after-forward, --fp32-reduce-scatter); --min-params-to-wrap is the model's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(device)
    mesh = DeviceMesh.from_group(group, device.type)
    experts = {p for p in model.parameters() if is_expert(p)}
    reshard = not cfg.no_reshard_after_forward
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard, ignored_params=experts)
    if cfg.fp32_reduce_scatter:
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    model_cfg = getattr(model, "cfg", None) or getattr(model, "args", None)
    min_params = getattr(model_cfg, "min_params_to_wrap", DEFAULT_MIN_PARAMS_TO_WRAP)
    units = 1
    for name, layers in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(layers, nn.ModuleList):
            for layer in layers:
                if sum(p.numel() for p in layer.parameters() if p not in experts) >= min_params:
                    fully_shard(layer, **kwargs)
                    units += 1
    # The outer unit stays gathered from its forward to its backward (torch's advice for the root, whose parameters
    # the backward gathers at once): the criterion reads its output projection after the forward (adaptive softmax).
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    dense = [p for p in model.parameters() if is_dtensor(p)]
    logger.info(f"fully_sharded (torch's FSDP): {len(dense)} dense tensors ({sum(p.numel() for p in dense)} "
                f"parameters) in {units} units cut over {mesh.size()} ranks; {len(experts)} expert tensors left whole; "
                f"layers resharded after forward: {reshard}; gradients reduced in "
                f"{'float32' if cfg.fp32_reduce_scatter else 'their dtype'}")
    model._moe_fsdp_mesh, model._moe_fsdp_reshard = mesh, reshard
    model._register_state_dict_hook(_gather_model_state)
    model.register_load_state_dict_pre_hook(_cut_model_state)
    return model


def distributed_model(original):
    """fairseq's DistributedFairseqModel: for --ddp-backend fully_sharded the model sharded in place (no wrapper:
    its gradients are reduced in the backward, and fairseq's Trainer reads the model's own methods)."""

    def wrap(args, model, process_group, device):
        if args.ddp_backend != "fully_sharded":
            return original(args, model, process_group, device)
        if not any(is_expert(p) for p in model.parameters()):  # a criterion with parameters: replicated
            args.ddp_backend = "legacy_ddp"  # (for this call: refusals.py keeps dense models out of fully_sharded)
            try:
                return original(args, model, process_group, device)
            finally:
                args.ddp_backend = "fully_sharded"
        return model if is_sharded(model) else shard(model, process_group, device, args)

    return wrap


@property
def trainer_is_fsdp(self):
    """fairseq's fairscale FSDP never runs with the plugin: --ddp-backend fully_sharded is torch's FSDP here, to
    which the rest of fairseq's Trainer is a data-parallel run like legacy_ddp's."""
    return False


def _whole(value):
    """A DTensor gathered whole, onto the CPU (a save moves everything there: the device never holds the whole
    state at once); anything else unchanged."""
    return value.full_tensor().cpu() if is_dtensor(value) else value


def _gather_model_state(module, state_dict, prefix, local_metadata):
    if not _SHAPES_ONLY:
        for key, value in state_dict.items():
            state_dict[key] = _whole(value)


def _cut(value, like):
    """value (a whole tensor) cut to this rank's rows of `like` (a DTensor); anything else unchanged."""
    from torch.distributed.tensor import distribute_tensor

    whole = torch.is_tensor(value) and not is_dtensor(value)
    if whole and is_dtensor(like) and tuple(value.shape) == tuple(like.shape):
        # (its own dtype: an fp32 optimizer state of an fp16 parameter stays fp32; a parameter copies what it loads)
        return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return value


def _cut_model_state(module, state_dict, prefix, *args):
    for name, p in module.named_parameters(remove_duplicate=False):
        if prefix + name in state_dict:
            state_dict[prefix + name] = _cut(state_dict[prefix + name], p)


@contextlib.contextmanager
def shapes_only():
    """State dicts of sharded models inside the block keep their DTensors (global shapes, nothing gathered)."""
    _SHAPES_ONLY.append(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.pop()


@contextlib.contextmanager
def gathered(model):
    """Every unit of a sharded model gathered for the block, none resharded inside it: a beam search (--eval-bleu)
    calls model.encoder and model.decoder directly (not the outer unit's hooks), takes a different number of steps
    on each rank (a layer's gathering would wait for ranks that are done), and the lockstep of the MoE layers calls
    them alone. Every rank gathers in the same order before it starts; afterwards each unit is cut again. A rank
    whose beam search ends first serves the others' MoE calls (lockstep: empty calls of the layers themselves, which
    are no unit and gather nothing) until every rank is done: it drains before its units are cut, so that its gates
    and shared experts are the whole tensors of the others' calls, not this rank's rows. Nothing for a model not
    sharded."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    model.set_reshard_after_forward(False, recurse=True)
    try:
        yield
    finally:
        try:
            lockstep.drain_all(lockstep.of(model))
        finally:
            for unit in units:
                unit.set_reshard_after_forward(model._moe_fsdp_reshard if unit is not model else False,
                                               recurse=False)
                unit.reshard()


def shard_optimizer_state(optimizer):
    """Hooks on torch optimizer `optimizer` over sharded parameters: its state dict holds whole tensors (gathered,
    numbered as ever), and a whole state loads as this rank's rows of each."""

    def gather(opt, state_dict):  # (each entry of "state" is the optimizer's own dict: replaced, not changed)
        if _SHAPES_ONLY:
            return state_dict
        state = {index: {key: _whole(value) for key, value in entry.items()}
                 for index, entry in state_dict["state"].items()}
        return {**state_dict, "state": state}

    loaded = {}

    def cut(opt, state_dict):
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        current = [p for g in opt.param_groups for p in g["params"]]
        state = dict(state_dict["state"])
        for index, p in zip(saved, current):
            if index in state:
                if is_dtensor(p):
                    state[index] = {key: _cut(value, p) if key != "step" else value
                                    for key, value in state[index].items()}
                loaded[p] = state[index]
        return {**state_dict, "state": state}

    def keep_dtype(opt):
        # torch casts the loaded state to each parameter's dtype: with --memory-efficient-fp16 fp16 parameters keep
        # an fp32 state, as fairseq's own hack would keep it (switched off below: it would put back whole tensors)
        for p, entry in loaded.items():  # (copied onto the parameter's device: never a memory-mapped checkpoint's)
            opt.state[p] = {k: v.to(p.device, copy=True) if torch.is_tensor(v) and not is_dtensor(v) and k != "step"
                            else v for k, v in entry.items()}
        loaded.clear()

    optimizer.register_state_dict_post_hook(gather)
    optimizer.register_load_state_dict_pre_hook(cut)
    optimizer.register_load_state_dict_post_hook(keep_dtype)
    optimizer.disable_mem_eff_fp16_loading_hack = True


def torch_optimizer(optimizer):
    """The torch.optim.Optimizer inside fairseq's optimizer wrappers."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def trainer_build_optimizer(original):
    """fairseq's Trainer._build_optimizer; on a sharded model, only pointwise optimizers (fairseq's own FSDP rule:
    the others' statistics span rows that other ranks hold), and the state-dict hooks of shard_optimizer_state."""

    def build(self):
        original(self)
        if is_sharded(self.get_model()):
            if not self._optimizer.supports_flat_params:
                raise FlagError(f"--optimizer {self.cfg.optimizer._name} cannot be used with --ddp-backend "
                                f"fully_sharded: only pointwise optimizers (adam, sgd, adadelta, adamax, ...), whose "
                                f"step on a parameter's rows needs no other rows")
            inner = torch_optimizer(self._optimizer)
            if "Fused" in type(inner).__name__:  # apex's multi-tensor kernels take plain tensors only
                raise FlagError(f"--ddp-backend fully_sharded cannot step with {type(inner).__name__} (apex): add "
                                f"--use-old-adam")
            shard_optimizer_state(inner)

    return build


def clip_sharded(params, max_norm, aggregate_norm_fn=None):
    """fairseq.utils.clip_grad_norm_ for gradients of which some are DTensors (a sharded model): the norm of the dense
    gradients (fairseq leaves the experts' out of it, and clips them by it) from each rank's rows, summed over the
    ranks. optim.clip_grad_norm calls it."""
    with_grad = [p for p in params if p is not None and getattr(p, "grad", None) is not None]
    sharded = [p.grad for p in with_grad if is_dtensor(p.grad)]
    dense = [p.grad for p in with_grad if not is_expert(p)]
    squares = torch.zeros((), dtype=torch.float32, device=sharded[0].to_local().device)
    for g in dense:
        if is_dtensor(g):
            squares += torch.linalg.vector_norm(g.to_local(), dtype=torch.float32) ** 2
    dist.all_reduce(squares, group=sharded[0].device_mesh.get_group())
    for g in dense:
        if not is_dtensor(g):  # a parameter outside the sharded model (the criterion's): the same on every rank
            squares += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
    total_norm = squares.sqrt()
    if aggregate_norm_fn is not None:
        total_norm = aggregate_norm_fn(total_norm)
    if max_norm > 0:
        clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp_(max=1)
        for p in with_grad:
            (p.grad.to_local() if is_dtensor(p.grad) else p.grad).mul_(clip_coef)
    return total_norm


def multiply_grads(original):
    """fairseq's FairseqOptimizer.multiply_grads, whose one foreach over a device's gradients cannot mix a sharded
    model's DTensors with the experts' tensors: each rank's rows multiplied in place."""

    def multiply(self, c):
        if not any(is_dtensor(p.grad) for p in self.params if p.grad is not None):
            return original(self, c)
        for p in self.params:
            if p.grad is not None:
                g = p.grad.to_local() if is_dtensor(p.grad) else p.grad
                g.mul_(c.to(g.device) if torch.is_tensor(c) else c)

    return multiply


def train_wrap_enabled(cfg):
    """fairseq_cli.train's fsdp_enable_wrap: fairscale's auto-wrapping, not used (shard() makes the units)."""
    return contextlib.nullcontext()


def train_wrap(module, **kwargs):
    """fairseq_cli.train's fsdp_wrap: the module unchanged (shard() shards it when the Trainer wraps it)."""
    return module
