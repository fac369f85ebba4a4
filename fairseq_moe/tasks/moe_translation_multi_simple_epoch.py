"""Task `moe_translation_multi_simple_epoch`: fairseq's multilingual translation_multi_simple_epoch (its language
tokens, --lang-pairs, sampling over the pairs: the task NLLB-MoE trained with) plus what the MoE tasks add (MoE
losses and metrics through the criterion, expert statistics, lockstep validation with spread experts:
expert_stats.py), and its statistics file grouped by language pair too (each sentence's pair read off its language
tokens). fairseq 0.12's task is an argparse task, so its flags are added here with the statistics' flags."""
import torch
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.tasks import register_task
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask

from .expert_stats import ExpertStatsConfig, MoETaskMixin


@register_task("moe_translation_multi_simple_epoch")
class MoETranslationMultiSimpleEpochTask(MoETaskMixin, TranslationMultiSimpleEpochTask):
    moe_task_name = "moe_translation_multi_simple_epoch"

    @staticmethod
    def add_args(parser):
        TranslationMultiSimpleEpochTask.add_args(parser)
        gen_parser_from_dataclass(parser, ExpertStatsConfig())

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
