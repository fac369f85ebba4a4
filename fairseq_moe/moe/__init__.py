"""The MoE layer, usable from plain PyTorch (no fairseq import anywhere below this folder)."""
from .config import MoEConfig
from .gates import GATES, register_gate
from .layer import MoEAux, MoELayer
from .routing import Routing, route

__all__ = ["GATES", "MoEAux", "MoEConfig", "MoELayer", "Routing", "register_gate", "route"]
