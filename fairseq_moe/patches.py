"""Every change fairseq-moe makes to fairseq's (and torch's, argparse's) own objects, in one table.

Models, criterions and tasks are added through fairseq's registries; what a plugin cannot do through a
registry is listed here: the target, the attribute, the replacement ("module:name" of this package; with
wraps=True a function of the original that returns the replacement, else the replacement itself, which
asks original() for the original if it needs it), why, since which fairseq release, and whether it is
permanent (apply(), when fairseq loads the plugin) or scoped (scoped(), for one call). Nothing else
assigns to a fairseq attribute (tests/fairseq_moe/test_patches.py); config values set for one call are not
patches (hooks/trainer.overridden).
"""
import contextlib
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from .checkpoints.safe_load import EVAL_MODULES  # the fairseq modules that eval() configuration strings


@dataclass(frozen=True)
class Patch:
    target: str  # a module ("fairseq.checkpoint_utils") or a class in one ("fairseq.trainer:Trainer")
    attribute: str
    replacement: str  # "fairseq_moe.module:name"
    why: str
    since: str = "0.12"  # the fairseq releases that need it
    scoped: bool = False  # swapped in for one call only (scoped()), never by apply()
    wraps: bool = False  # replacement(original) -> the new value
    when: Optional[Callable[[], bool]] = None  # apply only where this holds (e.g. NumPy 2)


_EVAL_WHY = ("fairseq eval()s configuration strings, some read from checkpoints: here eval reads literals "
             "only, so no checkpoint string can run code (checkpoints/safe_load.py)")
_CLI_WHY = ("a FlagError or CheckpointError is one line `PROG: error: ...` and exit code 2, once (a SaveError: exit "
            "code 1; cli.py)")
_BF16_WHY = ("fairseq 0.12 makes --bf16 imply --tpu (XLA): --bf16 without --tpu on the command line is bfloat16 on "
             "the CPU or CUDA, the device checked first")
_COMPOSE_WHY = ("fairseq composes the config of every command (and of a checkpoint saved with args) by having hydra "
                "parse some 270 override strings: the same config is built here from the same strings with OmegaConf "
                "alone, about 0.5 s of CPU less per call (bench_compose.py); any form it does not read exactly goes to fairseq's own")
_TRAINER = "fairseq.trainer:Trainer"
_CKPT = "fairseq.checkpoint_utils"

PATCHES = (
    # Checkpoints of MoE models (hooks/trainer.py)
    Patch(_TRAINER, "__init__", "fairseq_moe.hooks.trainer:trainer_init",
          "refuse set-ups whose state cannot be cut per expert, from the whole config (hydra runs too)"),
    Patch(_TRAINER, "train_step", "fairseq_moe.hooks.trainer:trainer_train_step",
          "--moe-balance-loss-scope global pools the counts of an update's micro-batches: from its first on",
          wraps=True),
    Patch(_TRAINER, "checkpoint_suffix", "fairseq_moe.hooks.trainer:trainer_checkpoint_suffix",
          "with the experts spread, every rank saves NAME-rank-R.pt (fairseq 0.12 saves on rank 0 only)"),
    Patch(_TRAINER, "should_save_checkpoint_on_current_rank", "fairseq_moe.hooks.trainer:trainer_should_save",
          "with the experts spread, every rank saves its experts"),
    Patch(_TRAINER, "state_dict", "fairseq_moe.hooks.trainer:trainer_state_dict",
          "the expert manifest: where each expert's optimizer state sits, the world size of the data position"),
    Patch(_TRAINER, "save_checkpoint", "fairseq_moe.hooks.trainer:trainer_save_checkpoint",
          "a set: NAME-rank-R.pt per rank and NAME-shared.pt (checkpoints/sets.py)"),
    Patch(_TRAINER, "load_checkpoint", "fairseq_moe.hooks.trainer:trainer_load_checkpoint",
          "the name resolved (set or file), a damaged set an error; each rank reads its own experts"),
    Patch(_CKPT, "save_checkpoint", "fairseq_moe.hooks.trainer:save_checkpoint",
          "with the experts spread, a save's sets are committed as a whole (commit.py), old ones retired "
          "after; what a stopped save left is recovered first"),
    Patch(_CKPT, "load_checkpoint_to_cpu", "fairseq_moe.hooks.trainer:load_checkpoint_to_cpu",
          "weights_only=True passed explicitly, checked config strings, named errors; sets"),
    Patch(_CKPT, "load_model_ensemble_and_task", "fairseq_moe.hooks.trainer:models_by_set_name",
          "--path NAME.pt of a set loads it (fairseq checks that the file NAME.pt exists first); a missing "
          "path is one line", wraps=True),
    Patch(_CKPT, "load_checkpoint", "fairseq_moe.hooks.trainer:load_checkpoint",
          "a run whose checkpoint_last exists only as a set (or another world size's) resumes"),
    Patch(_CKPT, "PathManager", "fairseq_moe.hooks.trainer:SaveInProgress",
          "copies during a save of an MoE model: atomic; with spread experts staged copies of whole sets, and "
          "--keep-* counting the staged names", scoped=True),
    Patch(_CKPT, "os", "fairseq_moe.hooks.trainer:OsDuringSave",
          "fairseq's --keep-* os.remove of one rank's file of an old set retires the whole set, deleted by "
          "rank 0 only once the new sets are committed", scoped=True),
    Patch(_CKPT, "torch_persistent_save", "fairseq_moe.hooks.trainer:persistent_save",
          "a save of an MoE model on one process: a failed write (a full disk) is one line, not three tries and "
          "a logged traceback; the file flushed before its rename", scoped=True),
    Patch(_CKPT, "load_checkpoint_to_cpu", "fairseq_moe.hooks.trainer:LoadForRank",
          "Trainer.load_checkpoint reads this rank's experts of the resolved checkpoint", scoped=True),
    # --ddp-backend fully_sharded on torch's FSDP, the experts left expert-parallel (fsdp.py)
    Patch(_TRAINER, "is_fsdp", "fairseq_moe.hooks.fsdp:trainer_is_fsdp",
          "fairseq's fully_sharded is fairscale's FSDP (CUDA streams; it would shard the experts again): here it is "
          "torch's, which the rest of the Trainer treats as a data-parallel run"),
    Patch(_TRAINER, "_build_optimizer", "fairseq_moe.hooks.fsdp:trainer_build_optimizer",
          "on a sharded model: pointwise optimizers only, and the optimizer state saved whole, loaded as this rank's "
          "rows", wraps=True),
    Patch("fairseq.models", "DistributedFairseqModel", "fairseq_moe.hooks.fsdp:distributed_model",
          "--ddp-backend fully_sharded shards the model in place with torch's fully_shard, experts left out",
          wraps=True),
    Patch("fairseq.utils", "clip_grad_norm_", "fairseq_moe.hooks.optim:clip_grad_norm",
          "fairseq's norm leaves the experts' gradients out: an overflow there went unseen (inf experts under fp16); "
          "a sharded model's gradients are DTensors (the norm from each rank's rows, summed over the ranks)",
          wraps=True),
    Patch("fairseq.optim.fairseq_optimizer:FairseqOptimizer", "multiply_grads", "fairseq_moe.hooks.fsdp:multiply_grads",
          "its foreach cannot mix a sharded model's DTensor gradients with the experts' tensors", wraps=True),
    Patch("fairseq_cli.train", "fsdp_enable_wrap", "fairseq_moe.hooks.fsdp:train_wrap_enabled",
          "fairscale's auto-wrapping context (an ImportError without fairscale): fsdp.shard makes the units"),
    Patch("fairseq_cli.train", "fsdp_wrap", "fairseq_moe.hooks.fsdp:train_wrap",
          "fairscale's wrap: the model is sharded when the Trainer wraps it (fsdp.shard)"),
    Patch("fairseq.optim", "shard_", "fairseq_moe.hooks.optim:shard_with_experts",
          "--zero-sharding os with the experts spread: fairscale's OSS would broadcast one rank's experts over the "
          "others'; here the dense parameters' state is cut over the ranks and each keeps its experts' (optim.py)",
          wraps=True),
    Patch("fairseq.optim.fp16_optimizer:FP16Optimizer", "build_optimizer", "fairseq_moe.hooks.optim:flat_fp16_with_experts",
          "--fp16's flat fp32 copy holds every parameter in one tensor (its state cannot be cut per expert, its norm "
          "mixes the experts') and is built on torch.cuda.current_device(): with experts, the dense parameters flat "
          "on their device and each expert tensor its own copy, the state numbered by parameter; with or without the flat "
          "copy, the experts' masters are zeroed, copied and unscaled in fewer passes (masters.py)", wraps=True),
    Patch("fairseq.optim.adafactor:FairseqAdafactor", "__init__", "fairseq_moe.hooks.optim:expert_adafactor_init",
          "--optimizer adafactor treats a stacked expert tensor as one parameter (a bias's column statistics, the "
          "update's RMS mix the experts): here each expert is stepped as its own, so its state cuts per expert",
          wraps=True),
    Patch("fairseq.optim.adam:Adam", "step", "fairseq_moe.hooks.adam:adam_step",
          "its seven whole-tensor operations per parameter stream a stacked expert tensor through memory seven "
          "times and allocate its size anew: in an optimizer with experts, on the CPU, fp32, torch's fused AdamW "
          "kernel with fairseq's arithmetic (adam.py); a dense run's steps are fairseq's own",
          wraps=True),
    Patch("torch.serialization", "_safe_globals", "fairseq_moe.checkpoints.safe_load:register_safe_globals",
          "argparse.Namespace, which fairseq 0.12 pickles, loads with weights_only=True (torch >= 2.6)",
          since="0.12 with torch >= 2.6"),
    # The LM (models/moe_transformer_lm.py)
    Patch("fairseq.models.transformer_lm", "TransformerDecoder", "fairseq_moe.models.moe_transformer_lm:"
          "MoETransformerLMDecoder", "transformer_lm's build_model builds its decoder class by name: ours, "
          "for the duration of our build", scoped=True),
    # fairseq 0.12 fixes (compat.py)
    Patch("fairseq.data.data_utils", "batch_by_size", "fairseq_moe.hooks.compat:keep_last_batch",
          "fairseq 0.12 drops the last batch when it is not a multiple of --required-batch-size-multiple "
          "(generate skipped the longest sentences)", wraps=True),
    Patch("fairseq.distributed.utils", "_broadcast_object_slow", "fairseq_moe.hooks.compat:broadcast_with_omegaconf",
          "a multi-rank resume broadcasts an OmegaConf config, which torch >= 2.6's weights_only load refuses",
          since="0.12 with torch >= 2.6", wraps=True),
    Patch("fairseq.distributed.utils", "infer_init_method", "fairseq_moe.hooks.compat:torchrun_on_cpu",
          "under torchrun on CPU fairseq 0.12 trains N independent models into one folder, or divides by "
          "the CUDA device count (0)", wraps=True),
    Patch("fairseq.distributed.utils", "distributed_main", "fairseq_moe.hooks.compat:leave_together",
          "the ranks' process groups are destroyed after fairseq's final barrier: left to the interpreter's exit, "
          "a gloo rank can abort with std::terminate as its peer closes the connections", wraps=True),
    *(Patch(f"fairseq.{m}", "np", "fairseq_moe.hooks.compat:NUMPY_1",
            "NumPy 2 removed np.compat.long and percentile(interpolation=), which these data modules use",
            since="0.12 with NumPy >= 2", when=lambda: not hasattr(importlib.import_module("numpy"), "compat"))
      for m in ("data.token_block_dataset", "data.language_pair_dataset", "data.data_utils")),
    # No checkpoint string reaches eval() (checkpoints/safe_load.py)
    *(Patch(m, "eval", "fairseq_moe.checkpoints.safe_load:literal", _EVAL_WHY) for m in EVAL_MODULES),
    # Inference with the experts spread over the ranks of a launched job (spread.py)
    Patch("fairseq_cli.generate", "_main", "fairseq_moe.hooks.spread:spread_generate",
          "under torchrun or fairseq_moe.launch, fairseq-generate runs W independent processes, each with every "
          "expert: here one job, the experts spread, the test set cut in W shards, the output and BLEU of all",
          wraps=True),
    Patch("fairseq.scoring", "build_scorer", "fairseq_moe.hooks.spread:GatheringScorer",
          "on W ranks the score is computed over the sentences of every rank", scoped=True),
    Patch("fairseq_cli.eval_lm", "eval_lm", "fairseq_moe.hooks.spread:spread_eval_lm",
          "on several ranks each evaluates its shard and reports its own perplexity: here the layers in "
          "lockstep and the perplexity of the whole set", wraps=True),
    Patch("fairseq_cli.eval_lm", "SequenceScorer", "fairseq_moe.hooks.spread:spread_eval_lm",
          "on several ranks the tokens each rank scores are counted, to weight its loss", scoped=True),
    *(Patch(f"fairseq.tasks.{module}:{task}", "eval_lm_dataloader", "fairseq_moe.hooks.spread:context_in_order",
            "with --context-window on several ranks each rank's batches would take their context from its own "
            "shard (a filler batch is a KeyError): here every rank collates the set in order and keeps its share",
            wraps=True)
      for module, task in (("language_modeling", "LanguageModelingTask"),
                           ("multilingual_language_modeling", "MultilingualLanguageModelingTask"))),
    Patch("fairseq_cli.interactive", "buffered_read", "fairseq_moe.hooks.spread:shared_input",
          "on several ranks every rank would read stdin: here rank 0 reads and shares each buffer", wraps=True),
    Patch("fairseq_cli.interactive", "print", "fairseq_moe.hooks.spread:rank0_print",
          "on several ranks every rank translates the same input: rank 0 alone prints it"),
    Patch("fairseq_cli.generate", "StopwatchMeter", "fairseq_moe.hooks.spread:stopwatch",
          "generate divides by the time it spent translating: 0 on a rank whose shard is empty", scoped=True),
    # fairseq's config from a Namespace without hydra's parse and compose (compose.py); fairseq_cli's tools: bf16's
    *(Patch(module, "convert_namespace_to_omegaconf", "fairseq_moe.hooks.compose:convert_namespace_to_omegaconf",
            _COMPOSE_WHY) for module in ("fairseq.dataclass.utils", _CKPT, "fairseq.trainer",
                                         "fairseq.models.fairseq_model")),
    # --bf16 on the device at hand (bf16.py)
    *(Patch(f"fairseq_cli.{tool}", "convert_namespace_to_omegaconf", f"fairseq_moe.hooks.bf16:{hook}",
            _BF16_WHY + " (the tools' own parse, during which fairseq imports the plugin; then converted as in "
            "compose.py)" + why, wraps=True)
      for tool, hook, why in (*((t, "settled_config", "") for t in ("train", "generate", "interactive", "eval_lm")),
                              ("validate", "settled_validate_config", "; fairseq-validate refuses it: it casts its "
                               "models for --fp16 only"))),
    Patch("fairseq.options", "parse_args_and_arch", "fairseq_moe.hooks.bf16:settled_parse",
          _BF16_WHY + " (every parse after the plugin's import)", wraps=True),
    Patch("fairseq.models.fairseq_model:BaseFairseqModel", "prepare_for_inference_",
          "fairseq_moe.hooks.bf16:cast_for_inference",
          "fairseq's generate, interactive and eval-lm cast their models for --fp16 only: --bf16 casts them to "
          "bfloat16 (the hub interface's too, with bf16 in its config)", wraps=True),
    Patch("fairseq.hub_utils", "from_pretrained", "fairseq_moe.hooks.bf16:bf16_when_asked",
          "a checkpoint trained with --bf16 loads in fp32 through the hub unless bf16=True is passed, as an --fp16 "
          "one does unless fp16=True is", wraps=True),
    # Bad input is one line (cli.py)
    *(Patch(f"fairseq_cli.{tool}", "main", "fairseq_moe.hooks.cli:one_line_errors", _CLI_WHY, wraps=True)
      for tool in ("train", "generate", "interactive", "eval_lm", "validate")),
    Patch("fairseq.distributed.utils", "call_main", "fairseq_moe.hooks.cli:one_line_errors",
          _CLI_WHY + " (errors in setting up the ranks)", wraps=True),
    Patch("fairseq_cli.hydra_train", "pre_main", "fairseq_moe.hooks.cli:one_line_errors", _CLI_WHY, wraps=True,
          when=lambda: "fairseq_cli.hydra_train" in sys.modules),
    Patch("argparse:ArgumentParser", "error", "fairseq_moe.hooks.cli:exit_quietly",
          "under fairseq_moe.launch, torchrun or srun every rank parses the same command line: rank 0 alone prints "
          "a usage error", when=lambda: _launched_rank() != 0),
)

_ABSENT = object()


def _launched_rank():
    """The rank a launcher gave this process (0 outside a launched job)."""
    from .hooks.compat import launcher_rank, one_rank_of_a_job

    if "FAIRSEQ_MOE_LAUNCH_RANK" in os.environ:
        return int(os.environ["FAIRSEQ_MOE_LAUNCH_RANK"] or 0)
    return launcher_rank() if one_rank_of_a_job() else 0
_originals = {}  # (target, attribute) -> the value apply() replaced (_ABSENT: there was none)


def resolve(dotted):
    """The object a "module" or "module:Class" names (imports the module)."""
    module, _, name = dotted.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, name) if name else obj


def apply():
    """Install every permanent patch whose `when` holds (idempotent). fairseq_moe/__init__ calls it when
    fairseq loads the plugin."""
    for patch in PATCHES:
        if patch.scoped or (patch.when is not None and not patch.when()) or (patch.target, patch.attribute) in _originals:
            continue
        if patch.attribute == "_safe_globals":  # torch's allowlist: added to, through its API
            _originals[(patch.target, patch.attribute)] = _ABSENT
            resolve(patch.replacement)()
            continue
        target = resolve(patch.target)
        old = target.__dict__.get(patch.attribute, _ABSENT) if isinstance(target, type) else getattr(
            target, patch.attribute, _ABSENT)
        new = resolve(patch.replacement)
        setattr(target, patch.attribute, new(old) if patch.wraps else new)
        _originals[(patch.target, patch.attribute)] = old


def original(target, attribute):
    """What apply() replaced at target.attribute (for a replacement that calls through to it)."""
    return _originals[(target, attribute)]


@contextlib.contextmanager
def scoped(obj, attribute, value):
    """obj.attribute = value for the duration of the block, then as it was (an attribute obj did not have
    is removed after). Only for the table's scoped entries: obj's module, class or type is the target."""
    names = {getattr(obj, "__name__", None),
             f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}",
             f"{type(obj).__module__}:{type(obj).__qualname__}"}
    if not any(p.scoped and p.attribute == attribute and p.target in names for p in PATCHES):
        raise AssertionError(f"{attribute} of {names} is not a scoped patch of fairseq_moe/patches.py")
    had, old = hasattr(obj, attribute), getattr(obj, attribute, None)
    setattr(obj, attribute, value)
    try:
        yield
    finally:
        setattr(obj, attribute, old) if had else delattr(obj, attribute)
