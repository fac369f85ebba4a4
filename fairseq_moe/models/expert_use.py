"""What a checkpoint's experts are used for, measured on data: the model loaded on one process (load), each MoE
layer's inputs to its expert computation recorded (recording), and each expert's routed weight over a split
(routed_weight). The commands that measure expert use share it: inspect (per token, per language pair), prune
(the experts to keep), grow (the experts to copy)."""
import contextlib
import json
import os
from collections import defaultdict
from pathlib import Path

import torch

from ..checkpoints.command import check_data, config_file
from ..checkpoints.state import task_config
from ..errors import CheckpointError, FlagError


def read_moe(checkpoint):
    """(state, its model's config) of a moe_transformer checkpoint (a file, or a set put together), or FlagError."""
    from argparse import Namespace

    from ..checkpoints.command import read_any

    state = read_any(checkpoint)
    model_cfg = (state.get("cfg") or {}).get("model")
    if not isinstance(model_cfg, Namespace) or not str(getattr(model_cfg, "arch", "")).startswith("moe_transformer"):
        raise FlagError(f"{checkpoint} is not a moe_transformer checkpoint")
    return state, model_cfg


def load(checkpoint, data, overrides=None):
    """(model, task) from a checkpoint (file or set), on CPU, in eval mode (overrides: of the task's settings,
    such as a multilingual task's lang_pairs)."""
    from fairseq import checkpoint_utils

    from ..checkpoints import sets as shards

    path = config_file(checkpoint)  # (fairseq checks that the file exists)
    state = shards.read_file(path, mmap=True)
    check_task_json(state, path)
    check_data(state, path, data)
    try:
        (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
            [path], arg_overrides=dict(overrides or {}, data=data))
    except RuntimeError as e:
        if "size mismatch" not in str(e):
            raise
        raise FlagError(f"--data {data}: its dictionaries do not fit {checkpoint} (other sizes than the model's "
                        f"embeddings): the data-bin of another corpus?") from None
    return model.eval(), task


def check_task_json(state, path):
    """The JSON settings fairseq's translation task parses when it builds the model (with --eval-bleu) are JSON
    objects, or one line names the file and the field (fairseq would stop on a JSONDecodeError)."""
    cfg = task_config(state, path)
    if not cfg.get("eval_bleu"):
        return
    for key in ("eval_bleu_args", "eval_bleu_detok_args"):
        value = cfg.get(key, "{}")
        try:
            ok = isinstance(json.loads(value or "{}"), dict)
        except (TypeError, ValueError, RecursionError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: cfg.task.{key} = {str(value)[:60]!r} is not a JSON object (--"
                                  f"{key.replace('_', '-')}), which fairseq's task parses to build the model")


def check_split(task, subset):
    """--subset is a split of the task's data (of each language pair, for a multilingual task), or one line
    says which splits there are (fairseq's multilingual task would stop on a KeyError 'main:PAIR')."""
    args = getattr(task, "args", None) or getattr(task, "cfg", None)
    folder = Path(str(getattr(args, "data", "")).split(os.pathsep)[0])
    pairs = getattr(task, "lang_pairs", None) or [None]
    pairs = pairs.split(",") if isinstance(pairs, str) else pairs

    def held(pair):
        if pair is None:  # bilingual translation or a language model: any file of the split
            return any(folder.glob(f"{subset}.*"))
        src, tgt = pair.split("-")
        return any((folder / f"{subset}.{a}-{b}.{src}.idx").is_file() for a, b in ((src, tgt), (tgt, src)))

    missing = [pair for pair in pairs if not held(pair)]
    if missing:
        splits = sorted({f.name.split(".")[0] for f in folder.glob("*.idx")})
        of = f" of {missing[0]}" if missing[0] else ""
        raise FlagError(f"--subset {subset}: {folder} has no {subset} split{of} (its splits: "
                        f"{', '.join(splits) or 'none'})")


def moe_layers(model, which=None):
    """[(name, MoELayer)] of the model, or of the one named or numbered by which (--layer)."""
    from .moe_ffn import moe_blocks

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
def padding_kept_out(model):
    """While inside: every MoE layer of model routes its real tokens only, as with --use-moe-pad-mask (padding would
    otherwise count as expert use: the sources are left-padded, the targets right-padded)."""
    from fairseq_moe.models.moe_ffn import MoEDecoderLayer, MoEEncoderLayer

    owners = [m for m in model.modules() if isinstance(m, (MoEEncoderLayer, MoEDecoderLayer))]
    before = [m.use_pad_mask for m in owners]
    for m in owners:
        m.use_pad_mask = True
    try:
        yield
    finally:
        for m, b in zip(owners, before):
            m.use_pad_mask = b


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


def routed_weight(model, task, subset, max_tokens):
    """{MoE layer name: [E] fp64 routed weight} over subset (teacher-forced, at evaluation, padding left out), and
    the number of sentences read."""
    from fairseq import utils

    layers = moe_layers(model)
    check_split(task, subset)
    task.load_dataset(subset, combine=False, epoch=1)
    dataset = task.dataset(subset)
    itr = task.get_batch_iterator(
        dataset=dataset, max_tokens=max_tokens, max_positions=utils.resolve_max_positions(
            task.max_positions(), model.max_positions()), ignore_invalid_inputs=True, seed=1,
        num_workers=0).next_epoch_itr(shuffle=False)
    mass = {name: torch.zeros(layer.cfg.num_experts, dtype=torch.float64) for name, layer in layers}
    sentences = 0
    with recording(layers) as seen, padding_kept_out(model), torch.no_grad():
        for sample in itr:
            if not sample:
                continue
            model(**sample["net_input"])
            sentences += sample["nsentences"]
            for name, calls in seen.items():
                for _, _, weights, counts in calls:
                    expert = torch.repeat_interleave(torch.arange(counts.numel()), counts.cpu())
                    mass[name].index_add_(0, expert, weights.double().cpu())
                calls.clear()
    if not sentences:
        raise FlagError(f"--subset {subset} of the data has no sentence to measure expert use on")
    return mass, sentences
