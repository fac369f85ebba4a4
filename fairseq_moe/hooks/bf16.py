"""--bf16 (and --memory-efficient-bf16) means bfloat16 on the device at hand, the CPU or CUDA; XLA only with --tpu.

fairseq 0.12's parse_args_and_arch sets args.tpu whenever --bf16 is given, so `fairseq-train --cpu --bf16` asks
torch_xla for a device and dies. Once fairseq's parse has returned, `settle` takes that back unless --tpu is in the
command line itself; then fairseq's Trainer runs bf16 where it is: the model and the criterion cast to bfloat16,
FP16Optimizer (fp32 master weights and optimizer state) or MemoryEfficientFP16Optimizer (fp32 optimizer state),
no loss scaler. fairseq's tools import the plugin as they build their parser (options.get_parser reads
--user-dir first), so their parse_args_and_arch is settled as it returns (`settled_parse`); their next step,
convert_namespace_to_omegaconf, settles a parse the plugin did not see (`settled_config`: a program that called
parse_args_and_arch before the plugin was loaded). The device is checked at the same
moment, before any work, and again when the Trainer is built (fairseq-hydra-train's common.bf16): a CUDA device
without native bf16 is one line `PROG: error: --bf16 ...` (exit 2), and a CPU without the instructions PyTorch's
oneDNN runs bf16 matrix products with is one warning line (they then run in a slow fallback: on an AVX2-only CPU
50 to 130 times slower than fp32 for large products), and the run goes on.
fairseq's generate, interactive and eval-lm cast a model for --fp16 only (model.half()): `cast_for_inference` makes
--bf16 cast it to bfloat16 in prepare_for_inference_, which they (and the hub interface) call on every model;
fairseq-validate calls no such hook, and refuses --bf16 (one line). Through the hub, a checkpoint trained with
--bf16 loads in fp32 unless bf16=True is passed (`bf16_when_asked`), as an --fp16 one does. patches.py installs them.
"""
import argparse
import functools
import logging
import sys
import weakref

import torch

from . import compose
from .cli import _rank, one_line_errors
from ..errors import FlagError

logger = logging.getLogger(__name__)
_settled = weakref.WeakValueDictionary()  # id(args) -> args: Namespaces already settled (their argv was read then)
_warned = []  # the CPU warning, once per process


def typed_tpu(argv):
    """Whether --tpu is in the command line argv (as fairseq's parsers read it: whole, since they take no
    abbreviations; nothing after a bare --)."""
    for arg in argv or ():
        if arg == "--":
            return False
        if str(arg).split("=", 1)[0] == "--tpu":
            return True
    return False


def cpu_has_fast_bf16():
    """Whether PyTorch's oneDNN runs bf16 matrix products on this CPU (AVX-512 BW/VL/DQ, which oneDNN's bf16
    kernels need at least, or Arm's BF16), rather than its slow fallback."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cuda_has_bf16():
    """Whether the current CUDA device computes in bf16 natively (compute capability 8.0 and later), not emulated."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # (torch without the argument: native is all it reports)
        return torch.cuda.is_bf16_supported()


def check_device(args):
    """The device --bf16 will run on: CUDA without native bf16 is a FlagError; a CPU without fast bf16 a warning."""
    if getattr(args, "tpu", False):
        return
    if torch.cuda.is_available() and not getattr(args, "cpu", False):
        if not cuda_has_bf16():
            major, minor = torch.cuda.get_device_capability()
            raise FlagError(f"--bf16 needs a CUDA device with bfloat16 support (compute capability 8.0 or later); "
                            f"{torch.cuda.get_device_name()} has {major}.{minor}: use --fp16, or leave --bf16 out")
        return
    if not cpu_has_fast_bf16() and not _warned:
        _warned.append(True)
        if _rank() == 0:
            logger.warning("--bf16 on this CPU: it has no bfloat16 instructions that PyTorch's oneDNN uses (AVX-512 "
                           "or native bf16), so bf16 matrix products run in a slow fallback (on an AVX2-only CPU 50 to "
                           "130 times slower than fp32 for large ones); the run goes on")


def check_trainer(cfg):
    """At Trainer construction (trainer.trainer_init), for set-ups no parse of the plugin's saw (fairseq-hydra-train's
    common.bf16): the device checked as at the parse."""
    common = cfg if isinstance(cfg, argparse.Namespace) else cfg.get("common")  # (flat flags, or fairseq's config)
    if getattr(common, "bf16", False):
        check_device(common)


def settle(args, argv):
    """args of fairseq's parse_args_and_arch: --bf16 without --tpu in argv (the command line) runs on the device at
    hand, not on XLA; that device checked. Each Namespace once (what its argv said holds after)."""
    if not hasattr(args, "bf16") or id(args) in _settled:
        return args
    _settled[id(args)] = args
    if args.bf16 and getattr(args, "tpu", False) and not typed_tpu(argv):
        args.tpu = False
    if args.bf16:
        one_line_errors(check_device)(args)
    return args


def settled_config(convert):
    """A tool's convert_namespace_to_omegaconf (fairseq_cli.train, generate, ...): its args settled first (read
    against sys.argv: the tools parse the command line), then converted as fairseq's (compose.py, which falls back
    to fairseq's own function, the `convert` this replaces)."""
    @functools.wraps(convert)
    def wrapped(args):
        return compose.convert_namespace_to_omegaconf(settle(args, sys.argv[1:]))

    return wrapped


def settled_validate_config(convert):
    """fairseq-validate's convert_namespace_to_omegaconf: settled, and --bf16 refused there (fairseq's validate casts
    its models for --fp16 only, and the plugin has no hook between its loading and its first batch)."""
    def refuse(args):
        if getattr(args, "bf16", False) and not getattr(args, "tpu", False):
            raise FlagError("--bf16 is not supported by fairseq-validate with fairseq-moe loaded (fairseq's validate "
                            "casts its models for --fp16 only): validate in fp32, or with --fp16")

    settled = settled_config(convert)

    @functools.wraps(convert)
    def wrapped(args):
        cfg = settled(args)
        one_line_errors(refuse)(args)
        return cfg

    return wrapped


def settled_parse(parse):
    """fairseq.options.parse_args_and_arch, its result settled (against input_args, else sys.argv)."""
    @functools.wraps(parse)
    def wrapped(parser, input_args=None, *rest, **kwargs):
        result = parse(parser, input_args, *rest, **kwargs)
        args = result[0] if isinstance(result, tuple) else result
        settle(args, sys.argv[1:] if input_args is None else input_args)
        return result

    return wrapped


def cast_for_inference(prepare):
    """BaseFairseqModel.prepare_for_inference_(cfg): with cfg.common.bf16 (not on XLA) the model is cast to
    bfloat16 first, as the tools cast it to fp16 for --fp16; the device checked as at a parse (the hub has none)."""
    @functools.wraps(prepare)
    def wrapped(self, cfg, *rest, **kwargs):
        common = getattr(cfg, "common", None)
        if getattr(common, "bf16", False) and not getattr(common, "tpu", False) and not getattr(common, "fp16", False):
            check_device(common)
            self.to(dtype=torch.bfloat16)
        return prepare(self, cfg, *rest, **kwargs)

    return wrapped


def bf16_when_asked(from_pretrained):
    """fairseq.hub_utils.from_pretrained: a checkpoint trained with --bf16 loads in fp32 unless bf16=True (or
    memory_efficient_bf16=True) is passed, as one trained with --fp16 loads in fp32 unless fp16=True is."""
    @functools.wraps(from_pretrained)
    def wrapped(*args, **kwargs):
        loaded = from_pretrained(*args, **kwargs)
        common = getattr(loaded.get("args"), "common", None)
        if getattr(common, "bf16", False) and not (kwargs.get("bf16") or kwargs.get("memory_efficient_bf16")):
            common.bf16 = common.memory_efficient_bf16 = False
        return loaded

    return wrapped
