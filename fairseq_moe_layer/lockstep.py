"""Lockstep: the MoE layers of ranks whose forwards differ still meet in every all-to-all.

Every call of an MoE layer with spread experts is a collective of its expert-parallel group. In training
every rank makes the same calls; in inference it does not: beam searches stop after different numbers of
steps, and the ranks' shards hold different numbers of batches. While a Lockstep is on, before each call the
ranks of the group agree (one all-reduce, MIN) on the lowest layer any of them wants next, layers being
numbered in the order they were built (the same on every rank). All run that layer: those that want it with
their tokens, the others with none (an empty call, which still serves the rows sent to their experts). Then
they agree again, until this rank's own layer is the lowest. A rank whose work is done calls drain(): it
serves empty calls until every rank of the group is done. Within one forward the layers come in increasing
order, so every rank's wanted layer is reached: no rank waits forever.
"""
import contextlib
import weakref

import torch
import torch.distributed as dist

DONE = 2 ** 62  # what a rank that has finished wants
_MADE = []  # inside inference(): the Locksteps made there (on from the start)
_LIVE = weakref.WeakSet()  # every Lockstep of this process (live_ones)


class Lockstep:
    _made = 0  # Locksteps made in this process (their order: live_ones)

    def __init__(self, group):
        self.group = group
        self.layers = []  # the MoE layers of this group, in the order they were built
        self.on = False
        self.broken = False  # a call of this group failed on this rank: its peers may be inside a collective
        self._serving = False
        Lockstep._made += 1
        self.number = Lockstep._made
        _LIVE.add(self)
        if _MADE:
            _MADE[-1].append(self)
            self.on = True

    def add(self, layer):
        """Register a layer; its number."""
        self.layers.append(layer)
        return len(self.layers) - 1

    def before(self, index):
        """Called by layer `index` before its all-to-alls: returns once every rank of the group runs it."""
        if not self.on or self._serving:
            return
        while (lowest := self._lowest(index)) != index:
            self._serve(lowest)

    def drain(self):
        """This rank is done: serve the others' layers until every rank of the group is done too. Not after a
        call of this group failed here (broken): the peers may be inside that call's all-to-all, where another
        collective would hang; this rank leaves and its launcher stops the others."""
        if not self.on or self.broken or not self.layers:
            return
        while (lowest := self._lowest(DONE)) != DONE:
            self._serve(lowest)

    def _lowest(self, want):
        layer = self.layers[0]
        t = torch.tensor([want], dtype=torch.long, device=next(layer.experts.parameters()).device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _serve(self, index):
        layer = self.layers[index]
        p = next(layer.experts.parameters())
        self._serving = True
        try:
            with torch.no_grad():
                x = p.new_zeros(0, layer.cfg.model_dim)  # [0, d]: no token of this rank
                ids = torch.zeros(0, dtype=torch.long, device=p.device) if layer.policy.needs_token_ids else None
                layer(x, token_ids=ids)
        finally:
            self._serving = False


def of(model):
    """The Locksteps of model's MoE layers with spread experts (one per expert-parallel group), in the order of
    their first layer: the same on every rank."""
    # (a layer with spread experts is one whose `ep` has a lockstep: MoELayer's; this module sits below layer.py)
    eps = [ep for ep in (getattr(m, "ep", None) for m in model.modules()) if getattr(ep, "lockstep", None) is not None]
    steps = {id(ep.lockstep): ep.lockstep for ep in eps}
    return list(steps.values())


@contextlib.contextmanager
def lockstep(model):
    """While inside: the MoE layers of model with spread experts keep the ranks in lockstep (see above); on
    leaving (also on an error, so that the other ranks are not left waiting) this rank drains. Whoever changes
    the layers' parameters inside (FSDP's gathering, fsdp.gathered) drains first (drain_all(of(model))): a
    rank that is done serves the others' calls with the parameters their calls see."""
    steps = of(model)
    for step in steps:
        step.on = True
    try:
        yield
    finally:
        for step in steps:
            step.drain()
            step.on = False


@contextlib.contextmanager
def inference():
    """While inside, every Lockstep made there (with the model that a tool loads) is on; yields their list; on
    leaving each drains (drain_all) and is off."""
    made = []
    _MADE.append(made)
    try:
        yield made
    finally:
        _MADE.pop()
        try:
            drain_all(made)
        finally:
            for step in made:
                step.on = False


def drain_all(steps):
    for step in steps:
        step.drain()


def live_ones():
    """Every Lockstep of this process (a tool that has loaded one model: its layers'), in the order made."""
    return sorted(_LIVE, key=lambda step: step.number)
