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
"""
import argparse
import contextlib
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

from .errors import FlagError
from .new_files import refuse_existing, write_new


def load(checkpoint, data):
    """(model, task) from a checkpoint (file or set), on CPU, in eval mode."""
    from fairseq import checkpoint_utils

    from . import expert_checkpoint as shards

    found = shards.locate(str(checkpoint))
    if found is None:
        raise FlagError(f"{checkpoint}: no such checkpoint (nor the set {shards.set_base(str(checkpoint))}-shared.pt)")
    path = shards.shared_path(found[1]) if found[0] == "set" else found[1]  # (fairseq checks that the file exists)
    check_data(path, data)
    try:
        (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data})
    except RuntimeError as e:
        if "size mismatch" not in str(e):
            raise
        raise FlagError(f"--data {data}: its dictionaries do not fit {checkpoint} (other sizes than the model's "
                        f"embeddings): the data-bin of another corpus?") from None
    return model.eval(), task


def check_data(path, data):
    """--data holds the dictionaries the checkpoint's task reads (dict.SRC.txt and dict.TGT.txt for
    translation, dict.txt for a language model), or one line says what is missing."""
    from . import expert_checkpoint as shards

    if not Path(data).is_dir():
        raise FlagError(f"--data {data}: no such folder (the data-bin the checkpoint was trained on)")
    state = shards.read_file(path, mmap=True)
    task = (state.get("cfg") or {}).get("task") or state.get("args")  # (args: a checkpoint of fairseq < 0.10)
    cfg = vars(task) if isinstance(task, argparse.Namespace) else dict(task or {})
    if not cfg:
        return  # (nothing to tell the task by: fairseq's own error, if any)
    if "source_lang" in cfg:  # translation; without the pair, fairseq infers it from the folder's dictionaries
        langs = [cfg.get(k) for k in ("source_lang", "target_lang")]
        pair = "-".join(lang or "?" for lang in langs)
        missing = ([f"dict.{lang}.txt" for lang in langs if not (Path(data) / f"dict.{lang}.txt").is_file()]
                   if None not in langs else [] if len(list(Path(data).glob("dict.*.txt"))) >= 2 else
                   ["dict.SRC.txt and dict.TGT.txt"])
        kind = f"a translation task ({pair})"
    else:
        missing, kind = [] if (Path(data) / "dict.txt").is_file() else ["dict.txt"], "a language model"
    if missing:
        raise FlagError(f"--data {data} has no {missing[0]}: the checkpoint is of {kind}; give the data-bin "
                        f"it was trained on")


def moe_layers(model, which=None):
    """[(name, MoELayer)] of the model, or of the one named or numbered by which (--layer)."""
    from .models.moe_ffn import moe_blocks

    layers = [(name, block.moe) for name, block in moe_blocks(model)]
    if not layers:
        raise FlagError("the checkpoint's model has no MoE layer")
    if which is None:
        return layers
    chosen = [lay for i, lay in enumerate(layers) if which in (lay[0], str(i))]
    if not chosen:
        raise FlagError(f"--layer {which}: the MoE layers are {', '.join(f'{i} ({n})' for i, (n, _) in enumerate(layers))}")
    return chosen


@contextlib.contextmanager
def recording(layers):
    """While inside: what each MoE layer of layers [(name, MoELayer)] hands its fused expert computation, per
    call: {name: [(x [T, d], token_index [N], weights [N], counts [E])]} (detached). One process, per-token
    routing only (benchmarks/bench_routing.py uses it too)."""
    seen = defaultdict(list)
    for name, layer in layers:
        if layer.policy.slots:
            raise FlagError(f"{name} uses --moe-routing {layer.cfg.routing}: its tokens are mixed into slots, none "
                            f"goes to an expert (nothing to show per token)")
        if layer.ep is not None:
            raise FlagError("inspect runs on one process (load the checkpoint there: sets load at any world size)")

        def combine(x, token_index, weights, counts, *rest, _name=name, _original=layer.experts.combine):
            seen[_name].append((x.detach(), token_index, weights.detach(), counts))
            return _original(x, token_index, weights, counts, *rest)

        layer.experts.combine = combine
    try:
        yield seen
    finally:
        for _, layer in layers:
            del layer.experts.combine  # back to the method


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
    model, task = load(checkpoint, data)
    layers = moe_layers(model, layer)
    spm = None
    if spm_model:
        import sentencepiece

        spm = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    src_dict = getattr(task, "source_dictionary", None) or task.target_dictionary
    lines = Path(input_file).read_text(encoding="utf-8").splitlines()
    targets = Path(target_file).read_text(encoding="utf-8").splitlines() if target_file else None
    if targets is not None and len(targets) != len(lines):
        raise FlagError(f"--target {target_file} has {len(targets)} lines, --input {input_file} {len(lines)}")
    if not lines:
        raise FlagError(f"--input {input_file} is empty")
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fairseq_moe.inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="NAME.pt of a checkpoint (a single file or a set)")
    p.add_argument("--data", required=True, help="the data-bin the model was trained on (its dictionaries)")
    p.add_argument("--input", required=True, help="sentences, one per line (source side for translation)")
    p.add_argument("--target", help="translation: the target sentences, line by line (the decoder's layers)")
    p.add_argument("--layer", help="one MoE layer only: its name or its 0-based position among the MoE layers")
    p.add_argument("--spm", help="a sentencepiece model to encode raw --input/--target lines with")
    p.add_argument("--out", default="inspect", help="folder for routing.txt and the heat maps (default: inspect)")
    p.add_argument("--show", type=int, default=5, help="sentences shown token by token (default 5)")
    a = p.parse_args(argv)
    import fairseq  # noqa: F401  (imported first: then importing the plugin registers it with fairseq)

    from . import load_plugin
    from .cli import one_line_errors

    load_plugin()
    for flag, path in (("--input", a.input), ("--target", a.target), ("--spm", a.spm)):
        if path is not None and not Path(path).is_file():
            p.error(f"{flag} {path}: no such file")
    one_line_errors(inspect)(a.checkpoint, a.data, a.input, a.out, a.target, a.layer, a.spm, a.show)
    for path in sorted(Path(a.out).iterdir()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
