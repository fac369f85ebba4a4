"""transformers' MoE causal LMs in: a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE checkpoint as a moe_mixtral_lm one.

    python -m fairseq_moe.import_hf HF_DIR OUT.pt [--data-dir DIR]
    fairseq-train DATA --user-dir fairseq_moe --task moe_language_modeling --arch moe_mixtral_lm ... \\
        --finetune-from-model OUT.pt      # the flags as saved (fairseq_moe.inspect shows them)
    fairseq-eval-lm DATA --user-dir fairseq_moe --path OUT.pt

HF_DIR holds config.json and the weights (safetensors or a PyTorch bin), read by transformers' from_pretrained on
the CPU in fp32. OUT.pt is a checkpoint of --arch moe_mixtral_lm with the flags that compute what the HF model
computes at evaluation (dropless, also in training: --moe-capacity-factor 0), of the moe_language_modeling task,
without optimizer state. Beside it (or in DIR) go fairseq's dict.txt and hf_token_ids.json, the HF id of each
fairseq index: fairseq's <s> <pad> </s> <unk> (0-3) are HF's bos, pad, eos, unk where config.json has them, -1
where it does not (their rows added: zero embeddings and output rows), then every other HF id in order; dict.txt
names them hfID. Text tokenised by HF's tokenizer and mapped through hf_token_ids.json feeds both models the same
tokens; export_hf of a checkpoint with that file beside it gives the HF model back, bit for bit. Nothing is
overwritten; the files are written whole or not at all.
"""
import json
import os
import sys

from . import with_fairseq
from .checkpoints import hf_lm
from .checkpoints import sets as shards
from .checkpoints.command import PROG, new_checkpoint, parser, run
from .checkpoints.new_files import one_line, refuse_existing, write_new
from .errors import CheckpointError, FlagError


def read_hf(hf_dir):
    """(config.json's dict, the fp32 state dict) of HF_DIR, through transformers."""
    try:
        import transformers
    except ImportError:
        raise FlagError("import_hf needs transformers: pip install 'fairseq-moe[hf]'") from None
    import torch

    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"HF_DIR {hf_dir}: no such folder (config.json and the weights)")
    where = os.path.join(hf_dir, "config.json")
    try:
        with open(where, encoding="utf-8") as f:
            kind = json.load(f).get("model_type")
        # the family's config class fills in what config.json leaves to its defaults (Mixtral's rope_theta 1e6)
        config = transformers.AutoConfig.from_pretrained(hf_dir).to_dict() if kind in hf_lm.FAMILIES else {
            "model_type": kind}
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{where}: not a transformers config ({type(e).__name__}: {e})") from None
    flags = hf_lm.fairseq_flags(config, where)  # (refusals before the weights are read)
    cls = getattr(transformers, hf_lm.FAMILIES[config["model_type"]] + "ForCausalLM")
    try:
        model, info = cls.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    except RuntimeError as e:  # (transformers' "size mismatch for ...": a weight of another shape than config.json's)
        raise CheckpointError(f"HF_DIR {hf_dir}: weights do not fit config.json ({one_line(e)})") from None
    lacking = info.get("missing_keys", []) or [k for k, *_ in info.get("mismatched_keys", [])]
    if lacking:  # (from_pretrained would have drawn them at random)
        raise CheckpointError(f"HF_DIR {hf_dir}: weights missing or of another shape than config.json says: "
                              f"{sorted(lacking)[:3]}")
    return config, flags, model.state_dict()


def checkpoint(folder, flags, weights, symbols, made_by):
    """A fairseq checkpoint of moe_mixtral_lm: the config fairseq-train builds from these flags (data: folder), the
    weights checked against the model they build (strict), no optimizer state."""
    from omegaconf import OmegaConf
    from types import SimpleNamespace

    from fairseq import options
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [folder, "--user-dir", os.path.dirname(os.path.abspath(__file__)), "--task", "moe_language_modeling",
            "--arch", "moe_mixtral_lm", "--criterion", "moe_cross_entropy", *flags]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    dictionary = Dictionary()
    for s in symbols:
        dictionary.add_symbol(s)
    from .models.moe_mixtral_lm import MoEMixtralLanguageModel

    model = MoEMixtralLanguageModel.build_model(cfg.model, SimpleNamespace(target_dictionary=dictionary))
    missing = model.load_state_dict(weights, strict=False)
    if missing.missing_keys or missing.unexpected_keys:
        raise CheckpointError(f"the HF weights do not fit the model of their config: missing "
                              f"{missing.missing_keys[:3]}, unexpected {missing.unexpected_keys[:3]}")
    return {"args": None, "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "model": model.state_dict(), "criterion": None,
            "optimizer_history": [{"criterion_name": "MoECrossEntropyCriterion", "optimizer_name": "none",
                                   "lr_scheduler_state": {"best": None}, "num_updates": 0}],
            "task_state": {}, "extra_state": {shards.MADE_BY: made_by}}


def import_hf(hf_dir, out, data_dir=None):
    """Write OUT.pt, dict.txt and hf_token_ids.json (see the module's doc); returns (the family, the files)."""
    new_checkpoint(out)
    folder = os.path.abspath(data_dir or os.path.dirname(os.path.abspath(out)))
    extra = [os.path.join(folder, name) for name in ("dict.txt", hf_lm.TOKEN_IDS)]
    refuse_existing(extra, out="--data-dir")
    config, flags, theirs = read_hf(hf_dir)
    ids = hf_lm.token_ids(config)
    symbols = [f"hf{i}" for i in ids[4:]]  # (the Dictionary adds the four specials itself)
    weights = hf_lm.from_hf(theirs, config["model_type"], ids)
    state = checkpoint(folder, flags, weights, symbols, {
        "what": f"imported from transformers' {config['model_type']} {os.path.abspath(hf_dir)}"})

    def text(lines):
        return lambda obj, f: f.write("".join(lines).encode("utf-8"))

    def write(save):
        save(state, out)
        save(None, extra[0], text(f"{s} 1\n" for s in symbols))
        save(None, extra[1], text([json.dumps(ids)]))

    made = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    try:
        write_new(out, write)
    except BaseException:
        if made and not os.listdir(folder):
            os.rmdir(folder)
        raise
    return config["model_type"], [out, *extra], flags


def main(argv=None):
    p = parser(PROG.format("import_hf"), __doc__,
               epilog="See the module's documentation (python -m pydoc fairseq_moe.import_hf).")
    p.add_argument("hf_dir", metavar="HF_DIR", help="a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE folder (config.json "
                                                     "and the weights)")
    p.add_argument("output", metavar="OUT.pt", help="the checkpoint to write (new)")
    p.add_argument("--data-dir", metavar="DIR", help="where dict.txt and hf_token_ids.json go (default: beside OUT.pt)")
    a = p.parse_args(argv)
    return run(p.prog, lambda: import_hf(a.hf_dir, a.output, a.data_dir),
               lambda done: f"{a.output}: transformers' {done[0]} as --arch moe_mixtral_lm; written "
                            f"{', '.join(done[1])}; continue with fairseq-train DATA --task moe_language_modeling "
                            f"--arch moe_mixtral_lm {' '.join(done[2])} --finetune-from-model {a.output}",
               setup=with_fairseq)


if __name__ == "__main__":
    sys.exit(main())
