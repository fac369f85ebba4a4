"""Task `moe_translation_multi_simple_epoch`: fairseq's multilingual translation_multi_simple_epoch (its language
tokens, --lang-pairs, sampling over the pairs: the task NLLB-MoE trained with) plus what the MoE tasks add (MoE
losses and metrics through the criterion, expert statistics, lockstep validation with spread experts:
expert_stats.py), and its statistics file grouped by language pair too (each sentence's pair read off its language
tokens). fairseq 0.12's task is an argparse task, so its flags are added here with the statistics' flags.

Its languages, dictionaries and data are checked before fairseq reads them (check_languages,
check_dictionaries, check_data): fairseq's task stops with a ValueError, FileNotFoundError or KeyError
traceback on every rank; here each is one line naming the flag and the file (errors.FlagError)."""
import os

import torch
from fairseq import utils
from fairseq.data.multilingual.multilingual_data_manager import MultilingualDatasetManager
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.tasks import register_task
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask

from ..errors import FlagError
from .expert_stats import ExpertStatsConfig, MoETaskMixin


def _pairs(value):
    return value.split(",") if isinstance(value, str) else list(value or ())


def _inference(args):
    """fairseq's rule: with --source-lang or --target-lang the task translates one direction (generate)."""
    return args.source_lang is not None or args.target_lang is not None


def _language_list(args, langs):
    """Where the language list came from, with the list."""
    if args.langs:
        return "--langs " + ",".join(args.langs)
    where = f"--lang-dict {args.lang_dict}" if getattr(args, "lang_dict", None) else "the languages of --lang-pairs"
    return f"{where} ({', '.join(langs)})"


def check_languages(args):
    """Every language asked for is in the language list (--langs, --lang-dict, else those of --lang-pairs), as
    fairseq's prepare() demands, and --source-lang and --target-lang come together."""
    if args.lang_pairs is None:
        raise FlagError("--lang-pairs is required by --task moe_translation_multi_simple_epoch (e.g. en-de,en-fr)")
    lang_dict = getattr(args, "lang_dict", None)
    if lang_dict and args.langs:
        raise FlagError("--langs and --lang-dict cannot both be given: one language list")
    if lang_dict and not os.path.isfile(lang_dict):
        raise FlagError(f"--lang-dict {lang_dict}: no such file")
    for pair in _pairs(args.lang_pairs):
        if len(pair.split("-")) != 2 or "" in pair.split("-"):
            raise FlagError(f"--lang-pairs {pair}: a pair is SRC-TGT (e.g. en-de), pairs separated by commas")
    if _inference(args) and (args.source_lang is None or args.target_lang is None):
        given = "--source-lang" if args.target_lang is None else "--target-lang"
        raise FlagError(f"{given} without {'--target-lang' if given == '--source-lang' else '--source-lang'}: "
                        "the multilingual task translates one direction, give both")
    if lang_dict or args.langs:
        langs = MultilingualDatasetManager.load_langs(args)
    else:  # (fairseq's inference from --lang-pairs, which prepare() splits only later: here it is still a string)
        langs = sorted({lang for pair in _pairs(args.lang_pairs) for lang in pair.split("-")})
    if _inference(args):
        asked = [(f"--source-lang {args.source_lang}", args.source_lang),
                 (f"--target-lang {args.target_lang}", args.target_lang)]
    else:
        asked = [(f"--lang-pairs {pair}", lang) for pair in _pairs(args.lang_pairs) for lang in pair.split("-")]
    for flag, lang in asked:
        if lang not in langs:
            raise FlagError(f"{flag}: language {lang} is not in {_language_list(args, langs)}")


def check_dictionaries(args):
    """The dictionary files that fairseq's load_all_dictionaries will open exist."""
    for flag in ("fixed_dictionary", "source_dict", "target_dict"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.isfile(path):
            raise FlagError(f"--{flag.replace('_', '-')} {path}: no such file")
    if getattr(args, "fixed_dictionary", None) is not None:
        return
    data = utils.split_paths(args.data)[0]
    if _inference(args):
        needed = [("--source-lang", args.source_lang, args.source_dict), ("--target-lang", args.target_lang,
                                                                          args.target_dict)]
    else:
        pairs = _pairs(args.lang_pairs) + [p for v in (getattr(args, "extra_lang_pairs", None) or {}).values()
                                           for p in _pairs(v)]
        needed = [(f"--lang-pairs {pair}", lang, given) for pair in pairs
                  for lang, given in zip(pair.split("-"), (args.source_dict, args.target_dict))]
    for flag, lang, given in needed:
        path = os.path.join(data, f"dict.{lang}.txt")
        if given is None and not os.path.isfile(path):
            raise FlagError(f"{flag}: no dictionary {path} for language {lang} (fairseq-preprocess writes it; "
                            "or give --fixed-dictionary)")


@register_task("moe_translation_multi_simple_epoch")
class MoETranslationMultiSimpleEpochTask(MoETaskMixin, TranslationMultiSimpleEpochTask):
    moe_task_name = "moe_translation_multi_simple_epoch"

    @staticmethod
    def add_args(parser):
        TranslationMultiSimpleEpochTask.add_args(parser)
        gen_parser_from_dataclass(parser, ExpertStatsConfig())

    @classmethod
    def setup_task(cls, args, **kwargs):
        check_languages(args)
        check_dictionaries(args)
        return super().setup_task(args, **kwargs)

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        if split not in self.datasets:
            self.check_data(split)
        try:
            return super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        except FileNotFoundError as e:  # (fairseq's "Dataset not found": a direction's file of one side missing)
            raise FlagError(f"--lang-pairs with {self.args.data}: {e}") from None

    def check_data(self, split):
        """Every direction has data of this split in its folder (itself or reversed, as fairseq reads it)."""
        shards = self.data_manager.get_split_num_data_shards(split)
        paths, pairs = self.data_manager.get_data_paths_and_lang_pairs(split)
        for category, folder in paths.items():
            if category not in pairs or category.startswith("mono_"):
                continue
            for pair in pairs[category]:
                if self.data_manager.get_dataset_key(category, *pair.split("-")) not in shards:
                    flag = f"--extra-lang-pairs {category}" if category != "main" else (
                        "--lang-pairs" if self.training else "--source-lang/--target-lang")
                    src, tgt = pair.split("-")
                    raise FlagError(f"{flag} {pair}: no {split} data in {folder} (no {split}.{src}-{tgt}.*.idx, nor "
                                    f"{split}.{tgt}-{src}.*.idx)")

    def stats_pairs(self):
        """The pairs, when their language tokens tell every pair apart (--encoder-langtok, --decoder-langtok) where
        sentence_labels reads them (not with --lang-tok-replacing-bos-eos or --left-pad-target)."""
        moved = [flag for flag in ("lang_tok_replacing_bos_eos", "left_pad_target")
                 if str(getattr(self.args, flag, False)).lower() in ("true", "1")]
        if moved or len(set(self._pair_tokens().values())) != len(self.lang_pairs):
            return None
        return self.lang_pairs

    def _pair_tokens(self):
        """{pair: (its encoder language token id or None, its decoder language token id or None)}."""
        enc_spec, dec_spec = self.args.langtoks["main"]
        tokens = {}
        for pair in self.lang_pairs:
            src, tgt = pair.split("-")
            tokens[pair] = (self.data_manager.get_encoder_langtok(src, tgt, enc_spec),
                            self.data_manager.get_decoder_langtok(tgt, dec_spec))
        return tokens

    def sentence_labels(self, sample):
        """Each sentence's pair, from its language tokens: the first token of the source that is not padding (the
        encoder's) and the decoder input's second (after eos); the first pair that matches both, -1 where none does.
        One [B, P] comparison (NLLB-200 trains thousands of directions)."""
        src, prev = sample["net_input"]["src_tokens"], sample["net_input"].get("prev_output_tokens")
        first = src.gather(1, src.ne(self.source_dictionary.pad()).long().argmax(1, keepdim=True)).squeeze(1)
        second = prev[:, 1] if prev is not None and prev.shape[1] > 1 else None
        if getattr(self, "_pair_ids", None) is None:  # [2, P] (-1: that side has no language token), built once
            pairs = list(self._pair_tokens().values())
            self._pair_ids = torch.tensor([[-1 if t is None else t for t in side] for side in zip(*pairs)] if pairs
                                          else [[], []], dtype=torch.long)
        enc, dec = self._pair_ids.to(first.device)
        match = (enc < 0) | (first.unsqueeze(1) == enc)  # [B, P]
        if second is not None:
            match &= (dec < 0) | (second.unsqueeze(1) == dec)
        if not match.shape[1]:
            return torch.full_like(first, -1)
        return torch.where(match.any(1), match.long().argmax(1), torch.full_like(first, -1))
