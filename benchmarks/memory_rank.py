"""fairseq-train, reporting what this rank holds in memory: run by bench_memory.py as each rank's command.

    python benchmarks/memory_rank.py OUT-RANK.json fairseq-train-arguments ...   # RANK: this rank's

After every update it adds up, on this rank: the parameter bytes (of a sharded parameter, this rank's rows), the
gradient bytes (the same), and the optimizer-state bytes (each tensor of the torch optimizer's state, its local
rows); the largest of each over the updates goes to OUT.json. The Trainer's train_step is wrapped here, in this
measuring script only.
"""
import atexit
import json
import os
import sys


def local_bytes(t):
    if t is None or not hasattr(t, "numel"):
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def main():
    out, argv = sys.argv[1].replace("RANK", os.environ.get("RANK", "0")), sys.argv[2:]
    import torch
    from fairseq import trainer as trainer_module
    from fairseq_cli import train

    seen = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0}
    step = trainer_module.Trainer.train_step

    def measured(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        params = list(self.model.parameters())
        inner = self.optimizer  # fairseq's wrappers, then torch's optimizer (ZeRO's: the one it steps, `inner`)
        while not isinstance(inner, torch.optim.Optimizer) or hasattr(inner, "inner"):
            inner = getattr(inner, "inner", None) or inner.optimizer
        state = sum(local_bytes(v) for entry in inner.state.values() for v in entry.values())
        for key, value in (("param_bytes", sum(local_bytes(p) for p in params)),
                           ("grad_bytes", sum(local_bytes(p.grad) for p in params)), ("optimizer_bytes", state)):
            seen[key] = max(seen[key], value)
        return result

    def write():
        with open(out, "w") as f:
            json.dump(seen, f)

    trainer_module.Trainer.train_step = measured
    atexit.register(write)  # (a launched rank leaves through its atexit handlers: compat.leave_together)
    sys.argv = ["fairseq-train", *argv]
    train.cli_main()


if __name__ == "__main__":
    main()
