"""Where the tokens go: per MoE layer, the experts (and weights) of every token of some sentences, a heat map
of them, and which (sub)words each expert receives most over a whole file.

    python -m fairseq_moe.inspect CHECKPOINT --data DATA-BIN --input FILE [--target FILE] [--layer L]
        [--spm MODEL] [--out DIR] [--show N]

CHECKPOINT: a checkpoint of moe_transformer or moe_transformer_lm (a single file, or an expert-parallel set
by its NAME.pt / NAME-shared.pt), evaluated on one process. FILE: one sentence per line, in the model's
vocabulary (as the data-bin's text was), or raw text with --spm (the sentencepiece model it was encoded
with). Translation: the encoder's layers see the source lines; with --target (the reference translations,
line by line) the decoder's layers see them too (teacher forcing: position t holds the previous target
token). Routing is the model's own at evaluation (its eval top-k and capacity), one sentence at a time.

Writes DIR/routing.txt (per sentence of the first --show N and per layer: each token and its experts with
their weights; per layer: each expert's share of the file's assignments and its most frequent tokens) and
DIR/heatmap-LAYER.png (tokens x experts, the weights, for the first sentence), as new files: one there
already, or a link, is refused before any work. --layer L keeps one layer (its name, e.g.
encoder.layers.1.fc1, or its position among the MoE layers, 0-based).

    python -m fairseq_moe.inspect CHECKPOINT --data DATA-BIN --by-lang-pair [--lang-pairs P,...] [--subset test]

A multilingual model (translation_multi_simple_epoch): each expert's share of the routed weight, per MoE layer
and language pair, over each pair's --subset (teacher-forced, as at evaluation): DIR/expert_use_by_pair.txt
and DIR/expert_use_by_pair.png (a heat map per layer: do the experts specialise?).
"""
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

from . import with_fairseq
from .checkpoints.command import PROG, config_file, parser, read_text, run
from .checkpoints.state import task_config
from .errors import FlagError
from .checkpoints.new_files import refuse_existing, write_new
from .models.expert_use import (check_split, check_task_json, load, moe_layers, padding_kept_out,  # noqa: F401
                                recording, routed_weight)  # (the measuring, shared with prune and grow)


def language_pairs(checkpoint):
    """The language pairs of a checkpoint's multilingual task (translation_multi_simple_epoch), else None."""
    from .checkpoints import sets as shards

    path = config_file(checkpoint)
    pairs = task_config(shards.read_file(path, mmap=True), path).get("lang_pairs")
    return pairs.split(",") if isinstance(pairs, str) else list(pairs) if pairs else None


def expert_use_by_pair(checkpoint, data, pairs=None, subset="test", max_tokens=4000):
    """{pair: {MoE layer: [E] share of the layer's routed weight}} of a multilingual model over each pair's subset
    of data (pairs: default, every pair of its task), one pair at a time."""
    known = language_pairs(checkpoint)
    if known is None:
        raise FlagError(f"{checkpoint}: its task has no language pairs (not translation_multi_simple_epoch)")
    for pair in pairs or []:
        if pair not in known:
            raise FlagError(f"--lang-pairs: {pair} is not one of the model's pairs ({','.join(known)})")
    use = {}
    for pair in pairs or known:
        model, task = load(checkpoint, data, {"lang_pairs": pair})
        mass, _ = routed_weight(model, task, subset, max_tokens)
        use[pair] = {name: (m / max(float(m.sum()), 1e-300)).tolist() for name, m in mass.items()}
    return use


def encode(line, dictionary, spm=None):
    text = " ".join(spm.encode(line.strip(), out_type=str)) if spm is not None else line.strip()
    return dictionary.encode_line(text, add_if_not_exist=False, append_eos=True).long()


def route_sentence(model, task, layers, src, tgt=None):
    """{layer name: [(token id, [(expert, weight), ...] by weight)]} for one sentence (ids with eos)."""
    prev = None  # [1, T] the decoder's input (translation with a target)
    with recording(layers) as seen, torch.no_grad():
        if hasattr(model, "encoder"):  # translation
            encoder_out = model.encoder(src[None], src_lengths=torch.tensor([src.numel()]))
            if tgt is not None:
                prev = torch.cat([tgt.new_tensor([task.target_dictionary.eos()]), tgt[:-1]])[None]
                model.decoder(prev, encoder_out=encoder_out)
        else:  # a language model reads "</s> w1 .. wn" (fairseq's LM datasets shift the target right)
            src = torch.cat([src.new_tensor([task.target_dictionary.eos()]), src[:-1]])
            model(src[None])
    out = {}
    for name, _ in layers:
        if not seen[name]:
            continue
        x, token, weight, counts = seen[name][-1]
        T, token, weight = x.shape[0], token.cpu(), weight.float().cpu()
        expert = torch.repeat_interleave(torch.arange(counts.numel()), counts.cpu())
        side_tokens = (prev[0] if prev is not None and name.startswith("decoder") else src).tolist()
        per_token = [[] for _ in range(T)]
        for e, t, w in zip(expert.tolist(), token.tolist(), weight.tolist()):
            per_token[t].append((e, w))
        out[name] = [(side_tokens[t], sorted(choices, key=lambda c: -c[1])) for t, choices in enumerate(per_token)]
    return out


def heatmap(png, name, rows, dictionary, num_experts, save):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = torch.zeros(len(rows), num_experts)
    for i, (_, choices) in enumerate(rows):
        for e, w in choices:
            grid[i, e] = w
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * num_experts, 1.2 + 0.28 * len(rows)))
    image = ax.imshow(grid.numpy(), cmap="viridis", aspect="auto", vmin=0, vmax=max(1e-9, grid.max().item()))
    ax.set_yticks(range(len(rows)), [dictionary[t] for t, _ in rows], fontsize=8)
    ax.set_xticks(range(num_experts), [str(e) for e in range(num_experts)], fontsize=8)
    ax.set(xlabel="expert", ylabel="token", title=name)
    fig.colorbar(image, ax=ax, label="routing weight")
    fig.tight_layout()
    save(fig, str(png), dump=lambda fig, f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def inspect(checkpoint, data, input_file, out_dir, target_file=None, layer=None, spm_model=None, show=5, top=8):
    """Write routing.txt and the heat maps; returns {layer name: {expert: Counter of token strings}}."""
    lines = read_text(input_file, "--input")
    targets = read_text(target_file, "--target") if target_file else None
    if targets is not None and len(targets) != len(lines):
        raise FlagError(f"--target {target_file} has {len(targets)} lines, --input {input_file} {len(lines)}")
    if not lines:
        raise FlagError(f"--input {input_file} is empty")
    if spm_model and not Path(spm_model).is_file():
        raise FlagError(f"--spm {spm_model}: " + ("a folder, not a file" if Path(spm_model).is_dir() else
                                                 "no such file"))
    model, task = load(checkpoint, data)
    layers = moe_layers(model, layer)
    spm = None
    if spm_model:
        import sentencepiece

        spm = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    src_dict = getattr(task, "source_dictionary", None) or task.target_dictionary
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FlagError(f"--out {out_dir} is a file, not a folder (nothing is overwritten)")
    try:
        refuse_existing([str(out_dir / n) for n in [f"heatmap-{name}.png" for name, _ in layers] + ["routing.txt"]],
                        "--out")
    except FileExistsError as e:
        raise FlagError(str(e)) from None
    return write_new(str(out_dir / "routing.txt"), lambda save: _inspect(
        model, task, layers, spm, src_dict, lines, targets, out_dir, show, top, save))


def _inspect(model, task, layers, spm, src_dict, lines, targets, out_dir, show, top, save):
    received = {name: defaultdict(Counter) for name, _ in layers}
    report = []
    for i, line in enumerate(lines):
        tgt = encode(targets[i], task.target_dictionary, spm) if targets is not None else None
        routed = route_sentence(model, task, layers, encode(line, src_dict, spm), tgt)
        for name, rows in routed.items():
            dictionary = task.target_dictionary if name.startswith("decoder") else src_dict
            for token, choices in rows:
                for e, _ in choices:
                    received[name][e][dictionary[token]] += 1
            if i < show:
                report.append(f"sentence {i + 1}, {name}:")
                report += [f"  {dictionary[token]:>16s}  " + "  ".join(f"e{e}:{w:.2f}" for e, w in choices)
                           + ("" if choices else "(dropped)") for token, choices in rows]
            if i == 0:
                E = dict(layers)[name].cfg.num_experts
                heatmap(out_dir / f"heatmap-{name}.png", f"{name}: sentence 1", rows, dictionary, E, save)
    report.append(f"\nover {len(lines)} sentences: each expert's share of the assignments and its {top} most "
                  f"frequent tokens")
    for name, experts in received.items():
        total = sum(sum(c.values()) for c in experts.values()) or 1
        report.append(f"{name}:")
        for e in range(dict(layers)[name].cfg.num_experts):
            counts = experts.get(e, Counter())
            common = ", ".join(f"{tok} ({n})" for tok, n in counts.most_common(top))
            report.append(f"  expert {e:2d}  {100 * sum(counts.values()) / total:5.1f}%  {common}")
    save("\n".join(report) + "\n", str(out_dir / "routing.txt"), dump=lambda text, f: f.write(text.encode("utf-8")))
    return received


def by_pair(checkpoint, data, out_dir, pairs=None, subset="test"):
    """expert_use_by_pair into OUT_DIR/expert_use_by_pair.txt (a table per layer) and .png (a heat map per layer)."""
    from .plot import plot_expert_use_by_pair

    out_dir = Path(out_dir)
    txt, png = out_dir / "expert_use_by_pair.txt", out_dir / "expert_use_by_pair.png"
    try:
        refuse_existing([str(txt), str(png)], "--out")
    except FileExistsError as e:
        raise FlagError(str(e)) from None
    use = expert_use_by_pair(checkpoint, data, pairs.split(",") if pairs else None, subset)
    lines = [f"each expert's share (%) of the routed weight on {subset}, per MoE layer and language pair"]
    for layer in next(iter(use.values())):
        lines.append(f"{layer}:")
        lines += [f"  {pair:>12s}  " + " ".join(f"{100 * v:5.1f}" for v in use[pair][layer]) for pair in use]

    def both(save):  # (one write: the table and the picture land together, or neither)
        save("\n".join(lines) + "\n", str(txt), dump=lambda text, f: f.write(text.encode("utf-8")))
        plot_expert_use_by_pair(use, png, save=save)

    write_new(str(txt), both)
    return use


def main(argv=None):
    p = parser(PROG.format("inspect"), __doc__)
    p.add_argument("checkpoint", help="NAME.pt of a checkpoint (a single file or a set)")
    p.add_argument("--data", required=True, help="the data-bin the model was trained on (its dictionaries)")
    p.add_argument("--input", help="sentences, one per line (source side for translation); not with "
                                   "--by-lang-pair")
    p.add_argument("--target", help="translation: the target sentences, line by line (the decoder's layers)")
    p.add_argument("--layer", help="one MoE layer only: its name or its 0-based position among the MoE layers")
    p.add_argument("--spm", help="a sentencepiece model to encode raw --input/--target lines with")
    p.add_argument("--out", default="inspect", help="folder for routing.txt and the heat maps (default: inspect)")
    p.add_argument("--show", type=int, default=5, help="sentences shown token by token (default 5)")
    p.add_argument("--by-lang-pair", action="store_true", help="a multilingual model: each expert's share of the "
                   "routed weight per language pair and MoE layer over --subset (DIR/expert_use_by_pair.txt and "
                   ".png)")
    p.add_argument("--lang-pairs", help="with --by-lang-pair: these pairs (default: the model's)")
    p.add_argument("--subset", default="test", help="with --by-lang-pair: the split of --data (default: test)")
    a = p.parse_args(argv)

    def check():  # the flags together, before fairseq is imported (a few seconds)
        if a.by_lang_pair == bool(a.input):
            raise FlagError("give --input FILE (sentences to show), or --by-lang-pair (expert use per language pair)")
        given = [f for f, v in (("--target", a.target), ("--layer", a.layer), ("--spm", a.spm)) if v is not None] + (
            ["--show"] if a.show != 5 else [])
        if a.by_lang_pair and given:
            raise FlagError(f"{given[0]} goes with --input, not with --by-lang-pair")
        if not a.by_lang_pair and (a.lang_pairs or a.subset != "test"):
            raise FlagError("--lang-pairs and --subset go with --by-lang-pair")
        with_fairseq()

    def work():  # -> the files written
        if a.by_lang_pair:
            by_pair(a.checkpoint, a.data, a.out, a.lang_pairs, a.subset)
            return [Path(a.out) / "expert_use_by_pair.txt", Path(a.out) / "expert_use_by_pair.png"]
        inspect(a.checkpoint, a.data, a.input, a.out, a.target, a.layer, a.spm, a.show)
        return sorted(Path(a.out).iterdir())

    return run(p.prog, work, lambda paths: "\n".join(map(str, paths)), setup=check)


if __name__ == "__main__":
    sys.exit(main())
