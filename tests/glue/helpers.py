"""Helpers of the fairseq glue tests: a toy corpus, and fairseq-train/-generate in this process."""
import os
import random

import torch

import fairseq_moe

USER_DIR = os.path.dirname(os.path.abspath(fairseq_moe.__file__))


def write_corpus(folder, seed=0):
    """A toy translation task (reverse and upper-case the words), big enough for a few updates."""
    rng = random.Random(seed)
    words = "a b c d e f g h i j k l m n o p q r s t".split()
    for split, n in (("train", 300), ("valid", 30), ("test", 20)):
        with open(f"{folder}/{split}.src", "w") as fs, open(f"{folder}/{split}.tgt", "w") as ft:
            for _ in range(n):
                s = [rng.choice(words) for _ in range(rng.randint(2, 11))]
                fs.write(" ".join(s) + "\n")
                ft.write(" ".join(w.upper() for w in reversed(s)) + "\n")


def binarise_toy_corpus(folder):
    """write_corpus + fairseq-preprocess into folder/bin; returns that path."""
    from fairseq import options
    from fairseq_cli import preprocess

    write_corpus(folder)
    parser = options.get_preprocessing_parser()
    args = parser.parse_args([
        "--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary", "--workers", "1",
        "--trainpref", f"{folder}/train", "--validpref", f"{folder}/valid", "--testpref", f"{folder}/test",
        "--destdir", f"{folder}/bin",
    ])
    preprocess.main(args)
    return str(folder / "bin")


def train_argv(data, save_dir, *extra):
    return [
        data, "--user-dir", USER_DIR, "--task", "moe_translation", "--arch", "moe_transformer_tiny",
        "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--max-tokens", "800", "--cpu", "--seed", "3",
        "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--log-format", "simple",
        "--log-interval", "1", "--num-workers", "0", "--no-progress-bar",
        *(() if "--optimizer" in extra else ("--optimizer", "adam", "--lr", "0.003")), *extra,
    ]


def parse_train(argv):
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, argv)


def build(argv):
    """(task, model, criterion) as fairseq-train would build them from argv."""
    from fairseq import tasks

    args = parse_train(argv)
    torch.manual_seed(args.seed)  # as fairseq-train does: the same argv builds the same weights
    task = tasks.setup_task(args)
    model = task.build_model(args)
    criterion = task.build_criterion(args)
    return task, model, criterion, args


def run_train(argv):
    """fairseq-train in this process (a CLI start-up costs seconds)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq_cli import train

    cfg = convert_namespace_to_omegaconf(parse_train(argv))
    distributed_utils.call_main(cfg, train.main)


def run_generate(argv):
    """fairseq-generate in this process; returns the scorer's result string."""
    from fairseq import options
    from fairseq_cli import generate

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, argv)
    return generate.main(args)
