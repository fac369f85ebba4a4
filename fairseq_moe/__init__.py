"""fairseq-moe: Mixture-of-Experts transformers as a fairseq plugin (`--user-dir fairseq_moe`).

Importing the package registers its models, criterions and tasks with fairseq, registers the classes
that fairseq checkpoints need for torch.load(weights_only=True), keeps checkpoint strings away from
eval() (safe_eval.py), makes fairseq's tools print bad input as one line (cli.py), and applies compat.py's
fixes to fairseq. The MoE layer itself, usable without fairseq, is fairseq_moe.moe.
"""
try:
    import fairseq
except ImportError:  # the layer alone (fairseq_moe.moe) needs only torch
    fairseq = None

if fairseq is not None:
    from . import cli, compat, safe_eval
    from .checkpoint import install_expert_parallel_checkpointing, register_safe_globals

    register_safe_globals()
    safe_eval.install()
    install_expert_parallel_checkpointing()
    cli.install()
    compat.apply()
    # Importing these modules registers them with fairseq.
    from .criterions import moe_cross_entropy  # noqa: F401
    from .models import moe_transformer, moe_transformer_lm  # noqa: F401
    from .tasks import moe_language_modeling, moe_translation  # noqa: F401
