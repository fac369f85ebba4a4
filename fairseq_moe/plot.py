"""Pictures of a training run: expert load per MoE layer, dropped fraction, balance loss and loss.

    python -m fairseq_moe.plot RUN_DIR OUT_DIR [--stats FILE] [--log FILE]

Reads the run's statistics file (fairseq-train --moe-stats-file: one JSON line per --moe-stats-interval
updates with each MoE layer's share of the assignments per expert and its dropped fraction) and its
training log (fairseq-train's output with --log-format simple or json, as --log-file writes it or as it was
teed), and writes into OUT_DIR:

    expert_load.png   per MoE layer, the share of assignments each expert got (stacked) over updates
    dropped.png       per MoE layer, the fraction of assignments dropped at capacity over updates
    balance_loss.png  the balance loss over updates (mean, and per layer with --moe-log-per-layer)
    loss.png          training loss and validation loss over updates

By default the statistics file is the one *.jsonl in RUN_DIR and the log RUN_DIR/train.log (or the one
*.log). A picture whose data the run did not log is skipped, with a line saying so.
"""
import json
import math
import re
import sys
from pathlib import Path

from .checkpoints.command import PROG, InputError, parser, run
from .errors import FlagError
from .checkpoints.new_files import refuse_existing, write_new

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def read_stats(path):
    """The records of a --moe-stats-file, in update order; a line that is not one, or a layer whose expert
    count changes from line to line, is an error naming the file and the line."""
    records, experts = [], {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not a statistics line ({e})") from None
            except RecursionError:
                raise InputError(f"{where}: not a statistics line (JSON nested too deeply)") from None
            if not isinstance(r, dict) or "update" not in r or "layers" not in r:
                raise InputError(f"{where}: not a --moe-stats-file line (no 'update' and 'layers')")
            if not _is_number(r["update"]) or not isinstance(r["layers"], dict) or not isinstance(
                    r.get("dropped", {}), dict):
                raise InputError(f"{where}: 'update' is no number, or 'layers'/'dropped' is no mapping")
            for name, shares in r["layers"].items():
                if not isinstance(shares, list) or not shares or not all(_is_number(x) for x in shares):
                    raise InputError(f"{where}: layer {name}: the shares are not a list of numbers")
                if experts.setdefault(name, len(shares)) != len(shares):
                    raise InputError(f"{where}: layer {name} has {len(shares)} experts here, {experts[name]} "
                                     f"on earlier lines (two runs' statistics in one file?)")
            if not all(_is_number(v) for v in r.get("dropped", {}).values()):
                raise InputError(f"{where}: a 'dropped' value is no number")
            records.append(r)
    return sorted(records, key=lambda r: float(r["update"]))


# A tee'd log tags each line (`| INFO | train_inner | ...`); --log-file writes the bare messages.
_TAGGED = re.compile(r"\| (train_inner|valid|train) \| (.*)$")
_BARE_TRAIN = re.compile(r"^epoch \d+:\s+\d+ / \d+ ")  # simple: "epoch 001:  50 / 603 loss=12.7, ..."
_BARE_VALID = re.compile(r"^epoch \d+ \| valid on ")   # simple: "epoch 001 | valid on 'valid' subset | ..."


def _classify(line):
    """(train_inner | valid | json | None, the logged part) of one log line."""
    tag = _TAGGED.search(line)
    if tag is not None:
        return (None if tag.group(1) == "train" else tag.group(1)), tag.group(2).strip()
    body = line.strip()
    if body.startswith("{"):
        return "json", body
    return ("train_inner" if _BARE_TRAIN.match(body) else "valid" if _BARE_VALID.match(body) else None), body


def read_log(path):
    """(train_inner rows, valid rows) of a fairseq-train log, in either --log-format (simple, json), tee'd
    or as --log-file writes it: dicts of the logged numbers, with num_updates."""
    train, valid = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            kind, body = _classify(line)
            if kind is None:
                continue
            if body.startswith("{"):  # --log-format json
                try:
                    data = json.loads(body)
                except (json.JSONDecodeError, RecursionError):  # (not a line fairseq logged)
                    continue
                if not isinstance(data, dict):
                    continue
                if kind == "json":  # untagged: valid lines name their numbers valid_*, epoch summaries train_*
                    if any(k.startswith("train_") for k in data):
                        continue
                    kind = "valid" if any(k.startswith("valid_") for k in data) else "train_inner"
                row = {re.sub(r"^valid_", "", k): float(v) for k, v in data.items() if _is_number(v)}
            elif kind == "train_inner":  # simple: "epoch 001:  50 / 603 loss=12.7, ..., num_updates=50"
                row = {k: float(v) for k, v in re.findall(rf"(\w+)=({_NUMBER})\b", body)}
            else:  # simple: "epoch 001 | valid on 'valid' subset | loss 9.1 | ... | num_updates 603"
                row = {k: float(v) for k, v in re.findall(rf"\| (\w+) ({_NUMBER})(?= \||$)", " | " + body)}
            if "num_updates" in row and not math.isnan(row["num_updates"]):
                (train if kind == "train_inner" else valid).append(row)
    return train, valid


def _is_number(v):
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def _layer_order(name):
    """encoder before decoder, then by layer index, so that the grid reads top-down."""
    return (0 if name.startswith("encoder") else 1), [int(t) for t in name.split(".") if t.isdigit()], name


def _grid(plt, n, title):
    cols = min(2, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.2 * rows), squeeze=False, sharex=True)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.flat[:n])


def _save(plt, fig, path, drawn, save):
    fig.tight_layout()
    save(fig, str(path), dump=lambda fig, f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    drawn[path.name] = [(ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes if ax.get_visible()]


PICTURES = ("expert_load.png", "dropped.png", "balance_loss.png", "loss.png")


def plot_run(stats_file, log_file, out_dir, title=""):
    """Write the PNGs (those whose data exists) into out_dir, as new files (one there already, or a link,
    is refused before any work: new_files); returns {file name: [(title, x label, y label) of each panel]}
    and prints a line per picture skipped."""
    out_dir = Path(out_dir)
    refuse_existing([str(out_dir / name) for name in PICTURES], "OUT_DIR")
    return write_new(str(out_dir / PICTURES[0]), lambda save: _plot(stats_file, log_file, out_dir, title, save))


def plot_expert_use_by_pair(use, png, title="", save=None):
    """use: {language pair: {MoE layer: [E] share of its routed weight}} (inspect.expert_use_by_pair) -> one
    heat map per MoE layer (pairs x experts) in png, a new file (through save, a new_files writer's, when given:
    part of the caller's write); returns its panels as plot_run does."""
    import logging

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # (its font search logs at DEBUG under fairseq's root)
    png = Path(png)
    refuse_existing([str(png)], "the picture")
    pairs = list(use)
    layers = sorted(next(iter(use.values())), key=_layer_order)
    drawn = {}

    def draw(save):
        fig, axes = _grid(plt, len(layers), f"share of each expert's routed weight, per language pair {title}")
        for ax, layer in zip(axes, layers):
            grid = [use[pair][layer] for pair in pairs]
            image = ax.imshow(grid, cmap="viridis", aspect="auto", vmin=0)
            ax.set_yticks(range(len(pairs)), pairs)
            ax.set_xticks(range(len(grid[0])), [str(e) for e in range(len(grid[0]))], fontsize=7)
            ax.set(title=layer, xlabel="expert", ylabel="pair")
            fig.colorbar(image, ax=ax)
        _save(plt, fig, png, drawn, save)

    if save is None:
        write_new(str(png), draw)
    else:
        draw(save)
    return drawn


def _plot(stats_file, log_file, out_dir, title, save):
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    drawn = {}
    records = read_stats(stats_file) if stats_file else []
    names = sorted({n for r in records for n in r["layers"]}, key=_layer_order)
    if names:
        fig, axes = _grid(plt, len(names), f"Expert load per MoE layer {title}".strip())
        for ax, name in zip(axes, names):
            rows = [(float(r["update"]), r["layers"][name]) for r in records if name in r["layers"]]
            updates = [u for u, _ in rows]
            shares = list(zip(*[s for _, s in rows]))  # one series per expert
            cmap = plt.get_cmap("tab10" if len(shares) <= 10 else "tab20")
            ax.stackplot(updates, shares, colors=[cmap(e % cmap.N) for e in range(len(shares))],
                         labels=[f"expert {e}" for e in range(len(shares))])
            for k in range(1, len(shares)):  # where the boundaries of a perfect balance lie
                ax.axhline(k / len(shares), color="white", lw=0.5, ls=":")
            ax.set(title=name, xlabel="update", ylabel="share of assignments", ylim=(0, 1))
        axes[0].legend(fontsize=7, ncol=4, loc="upper left")
        _save(plt, fig, out_dir / "expert_load.png", drawn, save)

        fig, axes = _grid(plt, 1, f"Dropped at capacity {title}".strip())
        for name in names:
            rows = [(r["update"], r["dropped"][name]) for r in records if name in r.get("dropped", {})]
            axes[0].plot([u for u, _ in rows], [d for _, d in rows], label=name)
        axes[0].set(title="per MoE layer", xlabel="update", ylabel="fraction of assignments dropped")
        axes[0].legend(fontsize=7)
        _save(plt, fig, out_dir / "dropped.png", drawn, save)
    else:
        print(f"| no expert statistics{f' in {stats_file}' if stats_file else ''}: expert_load.png and "
              f"dropped.png skipped")

    train, valid = read_log(log_file) if log_file else ([], [])
    balance_keys = sorted({k for r in train for k in r if re.fullmatch(r"moe_(balance_loss|\w+\d+_balance)", k)},
                          key=lambda k: (k != "moe_balance_loss", k))
    if balance_keys:
        fig, axes = _grid(plt, 1, f"Balance loss {title}".strip())
        for key in balance_keys:
            rows = [(r["num_updates"], r[key]) for r in train if key in r]
            axes[0].plot([u for u, _ in rows], [v for _, v in rows], label=key, lw=2 if key == "moe_balance_loss" else 1)
        axes[0].set(title="training (each logged interval)", xlabel="update", ylabel="balance loss (1 = balanced)")
        axes[0].legend(fontsize=7)
        _save(plt, fig, out_dir / "balance_loss.png", drawn, save)
    if any("loss" in r for r in train + valid):
        fig, axes = _grid(plt, 1, f"Loss {title}".strip())
        for rows, label in ((train, "training"), (valid, "validation")):
            points = [(r["num_updates"], r["loss"]) for r in rows if "loss" in r]
            if points:
                axes[0].plot(*zip(*points), label=label, marker="o" if label == "validation" else None)
        axes[0].set(title="as fairseq logs it", xlabel="update", ylabel="loss (base 2)")
        axes[0].legend()
        _save(plt, fig, out_dir / "loss.png", drawn, save)
    if not (balance_keys or train or valid):
        print(f"| no training log lines{f' in {log_file}' if log_file else ''}: balance_loss.png and loss.png skipped")
    return drawn


def _one(run_dir, pattern, what, flag):
    found = sorted(run_dir.glob(pattern))
    if len(found) > 1:
        raise FlagError(f"{run_dir} holds several {what} ({', '.join(p.name for p in found)}): name one with {flag}")
    return found[0] if found else None


def find_inputs(run_dir, stats, log):
    """(statistics file, training log) of the run: the flags' or those found in RUN_DIR; None where absent."""
    if not run_dir.is_dir():
        raise FlagError(f"RUN_DIR {run_dir}: no such folder")
    stats = stats or _one(run_dir, "*.jsonl", "statistics files", "--stats")
    log = log or (run_dir / "train.log" if (run_dir / "train.log").exists() else
                  _one(run_dir, "*.log", "logs", "--log"))
    for path, flag in ((stats, "--stats"), (log, "--log")):
        if path is not None and not path.is_file():
            raise FlagError(f"{flag} {path}: " + ("a folder, not a file" if path.is_dir() else "no such file"))
    if stats is None and log is None:
        raise FlagError(f"{run_dir} holds no statistics file (*.jsonl) and no training log (*.log)")
    return stats, log


def main(argv=None):
    p = parser(PROG.format("plot"), __doc__)
    p.add_argument("run_dir", type=Path, help="the run's folder (its statistics file and training log)")
    p.add_argument("out_dir", type=Path, help="where the PNGs go")
    p.add_argument("--stats", type=Path, help="the --moe-stats-file (default: the one *.jsonl in RUN_DIR)")
    p.add_argument("--log", type=Path, help="the training log (default: RUN_DIR/train.log or the one *.log)")
    p.add_argument("--title", default="", help="added to each picture's title")
    a = p.parse_args(argv)
    return run(p.prog, lambda: plot_run(*find_inputs(a.run_dir, a.stats, a.log), a.out_dir, a.title),
               lambda drawn: "\n".join(str(a.out_dir / name) for name in drawn))


if __name__ == "__main__":
    sys.exit(main())
