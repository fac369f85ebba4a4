"""CPU seconds of fairseq's convert_namespace_to_omegaconf (hydra's parse and compose) against the plugin's
(fairseq_moe/hooks/compose.py), on the suite's tiny MoE translation command line, in one process, interleaved.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compose.py            # 10 calls of each
    .venv/bin/python benchmarks/bench_compose.py --reps 1                    # that it runs

The first call of each is reported apart (hydra's first compose also reads its config sources); then the median of
--reps calls of each, and fairseq's over the plugin's. Each result is checked equal to the other.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)

    import fairseq_moe

    fairseq_moe.load_plugin()
    from fairseq import options

    from fairseq_moe import patches
    from fairseq_moe.hooks import compose

    argv = ["/nonexistent/bin", "--task", "moe_translation", "--arch", "moe_transformer_tiny",
            "--criterion", "moe_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "0.003",
            "--moe-expert-count", "4", "--max-tokens", "800", "--cpu"]
    ns = options.parse_args_and_arch(options.get_training_parser(), argv)
    fairseqs = patches.original("fairseq.dataclass.utils", "convert_namespace_to_omegaconf")
    times = {"fairseq": [], "plugin": []}
    for _ in range(args.reps + 1):
        for name, convert in (("fairseq", fairseqs), ("plugin", compose.fast_convert)):
            t = time.process_time()
            cfg = convert(ns)
            times[name].append(time.process_time() - t)
            if name == "fairseq":
                want = compose.plain(cfg)
            elif compose.plain(cfg) != want:
                sys.exit("bench_compose: the plugin's config differs from fairseq's")
    got = {name: {"first_s": t[0], "median_s": statistics.median(t[1:])} for name, t in times.items()}
    got["ratio"] = got["fairseq"]["median_s"] / got["plugin"]["median_s"]
    for name in ("fairseq", "plugin"):
        print(f"{name:8s} first {got[name]['first_s']:.3f} s, then median {got[name]['median_s']:.3f} s of CPU")
    print(f"fairseq / plugin: {got['ratio']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
