"""The MoE layer, usable from plain PyTorch (no fairseq import anywhere below this folder)."""
from .config import MoEConfig
from .gates import GATES, register_gate
from .layer import MoEAux, MoELayer
from .routing import ROUTINGS, Routing, register_routing, route

__all__ = ["GATES", "ROUTINGS", "MoEAux", "MoEConfig", "MoELayer", "Routing", "register_gate", "register_routing",
           "route"]
