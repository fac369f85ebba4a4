"""What patches.py installs in fairseq's runtime: the trainer and checkpoint hooks (trainer), the optimizers with
experts (optim: ZeRO, Adafactor, flat fp16), FSDP (fsdp), inference with the experts spread (spread), fixes to
fairseq 0.12 and the launchers (compat), one-line errors of fairseq's tools (cli). They read the layer and the
checkpoints floor, never the models', criterions' or tasks' modules."""
