"""No string from a checkpoint reaches Python's eval().

fairseq 0.12 builds a loaded model from the checkpoint's own config and eval()s some of its strings
(adaptive_softmax_cutoff, adam_betas, fconv's layer specs, ...): a checkpoint that passes
torch.load(weights_only=True) could still run code. Two guards: check_config() at load, for every field
fairseq evaluates (EVALUATED_FIELDS; a test holds the list against fairseq's source), names a field that
is not a literal; and in the fairseq modules that eval() configuration (EVAL_MODULES) the name `eval` is
bound to literal() (patches.py), so a field missing from the list cannot run code either.

literal() reads what those fields legitimately hold: Python literals, plus the arithmetic of fconv's
layer specs ("[(512, 3)] * 20 + [(1024, 3)]"). Names other than True/False/None, calls, attributes,
subscripts, lambdas and comprehensions are refused.
"""
import argparse
import ast
import operator

from ..errors import CheckpointError


EVALUATED_FIELDS = frozenset({
    "adafactor_eps", "adam_betas", "adamax_betas", "lamb_betas",  # optimizers
    "adaptive_input_cutoff", "adaptive_softmax_cutoff", "character_filters", "xformers_att_config",
    "conv_aggregator_layers", "conv_feature_layers", "override_encoder_layers", "feature_encoder_spec",
    "decoder_attention", "decoder_layers", "downsample", "encoder_attention", "encoder_layers",
    "gated_attention", "pretrained", "project_input", "self_attention",  # fconv, lstm
    "left_pad_source", "left_pad_target",  # multilingual tasks (eval_bool)
    "pipeline_balance", "pipeline_devices", "pipeline_encoder_balance", "pipeline_encoder_devices",
    "pipeline_decoder_balance", "pipeline_decoder_devices", "wer_args",
})

# The fairseq modules whose code calls the builtin eval() on configuration strings.
EVAL_MODULES = (
    "fairseq.utils",  # eval_str_list, eval_str_dict, eval_bool (options.* are the same functions)
    "fairseq.criterions.ctc", "fairseq.data.audio.raw_audio_dataset",
    "fairseq.models.fconv", "fairseq.models.fconv_lm", "fairseq.models.fconv_self_att",
    "fairseq.models.hubert.hubert", "fairseq.models.lightconv_lm", "fairseq.models.multires_hubert.multires_hubert",
    "fairseq.models.speech_to_text.s2t_wav_transformer", "fairseq.models.transformer_lm",
    "fairseq.models.wav2vec.wav2vec", "fairseq.models.wav2vec.wav2vec2",
    "fairseq.optim.adafactor", "fairseq.optim.adam", "fairseq.optim.adamax", "fairseq.optim.cpu_adam",
    "fairseq.optim.fused_lamb",
)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_ITEMS = 100_000  # a layer spec has tens of entries, not a memory bomb
_MAX_TEXT = 100_000
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def literal(text, *_ignored):
    """eval() for configuration strings: the value of a literal expression, else ValueError.
    (Extra arguments, the globals/locals an eval() call may pass, are ignored.)"""
    if not isinstance(text, str):
        raise TypeError(f"eval() arg 1 must be a string, not {type(text).__name__}")
    if len(text) > _MAX_TEXT:
        raise ValueError(f"{text[:60]!r}... ({len(text)} characters) is longer than any configuration value")
    try:
        return _value(ast.parse(text.strip(), mode="eval").body, text)
    except SyntaxError as e:
        raise ValueError(f"{text!r} is not a Python literal ({e.msg})") from None
    except (RecursionError, MemoryError):  # nested deeper than any config needs
        raise ValueError(f"{text[:60]!r}... is not a Python literal (nested too deeply)") from None
    except (ArithmeticError, TypeError) as e:  # 1/0, an unhashable dict key, ...
        raise ValueError(f"{text!r} is not a valid literal ({type(e).__name__}: {e})") from None


def _value(node, text):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_value(n, text) for n in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_value(k, text): _value(v, text) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        operand = _value(node.operand, text)
        if isinstance(operand, (int, float, complex)):
            return _UNARY[type(node.op)](operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, text), _value(node.right, text)
        numbers = (int, float)
        seq, times = (left, right) if isinstance(left, (list, tuple)) else (right, left)
        sequence_repeat = (isinstance(node.op, ast.Mult) and isinstance(seq, (list, tuple))
                           and type(times) is int and 0 <= len(seq) * times <= _MAX_ITEMS)
        concat = (isinstance(node.op, ast.Add) and type(left) is type(right) and isinstance(left, (list, tuple))
                  and len(left) + len(right) <= _MAX_ITEMS)
        if (isinstance(left, numbers) and isinstance(right, numbers)) or sequence_repeat or concat:
            return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Name) and node.id in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.id]
    raise ValueError(f"{text!r} is not a Python literal: fairseq-moe does not evaluate "
                     f"{type(node).__name__} expressions from configuration strings")


def check_config(state, path):
    """Refuse a checkpoint whose config holds, in a field fairseq evaluates, anything but a literal.
    state: the checkpoint as read from disk ("args": Namespace, "cfg": dict of sections)."""
    for where, value in (*_fields(state.get("args"), "args"), *_fields(state.get("cfg"), "cfg")):
        if where.rsplit(".", 1)[-1] in EVALUATED_FIELDS and isinstance(value, str) and value.strip():
            try:
                literal(value)
            except ValueError:
                raise CheckpointError(f"{path}: {where} = {value!r} is not a Python literal; fairseq would "
                                      f"eval() it when building the model, so this checkpoint is refused") from None


def _fields(node, where, depth=0):
    """(dotted name, value) of every field in a config tree of dicts and Namespaces."""
    if depth > 8 or node is None:
        return
    items = vars(node).items() if isinstance(node, argparse.Namespace) else (
        node.items() if hasattr(node, "items") else ())
    for key, value in items:
        if isinstance(value, (argparse.Namespace, dict)) or hasattr(value, "items"):
            yield from _fields(value, f"{where}.{key}", depth + 1)
        else:
            yield f"{where}.{key}", value


SAFE_GLOBALS = [argparse.Namespace]


def _numpy_globals():
    """What a NumPy array or scalar pickles as (fairseq's --eval-bleu keeps its BLEU counts in the metrics as
    arrays): the array and scalar reconstructors, ndarray, dtype and its classes. They build data only; an object
    array's items go through the same restricted unpickler."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    dtypes = [getattr(np.dtypes, name) for name in getattr(np.dtypes, "__all__", ())] if hasattr(np, "dtypes") else []
    # (a pickle names them by NumPy's module of its day: numpy.core in 1.x, numpy._core from 2.0)
    names = [(fn, f"{module}.multiarray.{fn.__name__}") for fn in (core.multiarray._reconstruct, core.multiarray.scalar)
             for module in ("numpy.core", "numpy._core")]
    return [*names, np.ndarray, np.dtype, *dtypes]


def register_safe_globals():
    """What weights_only loading accepts beyond tensors: argparse.Namespace (fairseq 0.12 pickles its args), NumPy's
    data types."""
    import torch

    torch.serialization.add_safe_globals(SAFE_GLOBALS + _numpy_globals())
