"""fairseq-moe: Mixture-of-Experts transformers as a fairseq plugin (`--user-dir fairseq_moe`).

Importing the package registers its models, criterions and tasks with fairseq, and the classes that
fairseq checkpoints need for torch.load(weights_only=True), and applies compat.py's fixes to fairseq. The MoE layer itself, usable without
fairseq, is fairseq_moe.moe.
"""
from . import compat
from .checkpoint import register_safe_globals

register_safe_globals()
compat.apply()

from . import criterions, models, tasks  # noqa: E402,F401  (imports register with fairseq)
from .criterions import moe_cross_entropy  # noqa: E402,F401
from .models import moe_transformer  # noqa: E402,F401
from .tasks import moe_translation  # noqa: E402,F401
