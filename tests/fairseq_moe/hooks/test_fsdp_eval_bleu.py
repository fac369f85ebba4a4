"""--ddp-backend fully_sharded with --eval-bleu (issue 30, item 3: the rank whose beam search ended first served the
other's MoE calls with its rows of the gates, and died at the 3rd validation). Each row is a way for the ranks' beam
searches to differ. The promise: every validation runs, and gives what one process gives (the layers' outputs, or
the validation's loss, MoE metrics and BLEU); afterwards every unit is cut again."""
import pytest

from tests.fairseq_moe.hooks.test_fsdp import DIFFERENT_LENGTHS, assert_validates_as_one_process, served_while_gathered
from tests.fairseq_moe_layer.test_comm import spawn

# Each rank's MoE calls while the units are gathered: (block, tokens), ...; then whether the blocks are kept gathered
# from forward to backward (--no-reshard-after-forward).
LOCKSTEP_ROWS = {
    "rank 0 done first": ({0: [(1, 4)], 1: [(0, 5), (1, 3), (0, 2), (1, 7)]}, False),
    "a rank with no call (nothing to search)": ({0: [], 1: [(0, 3), (1, 2)]}, False),
    "served the lower block before its own call, then done first": ({0: [(1, 6)], 1: [(0, 2), (1, 5), (0, 0)]},
                                                                     False),
    "the same calls on both (nothing served)": ({0: [(0, 3), (1, 3)], 1: [(0, 2), (1, 4)]}, False),
    "--no-reshard-after-forward, rank 1 done first": ({0: [(0, 5), (1, 3), (0, 1)], 1: [(1, 2)]}, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("calls, keep_gathered", LOCKSTEP_ROWS.values(), ids=LOCKSTEP_ROWS.keys())
def test_calls_under_gathered_units_are_one_process_s(calls, keep_gathered):
    spawn(served_while_gathered, 2, calls, keep_gathered)


TRAINING_ROWS = {
    # the issue's own --eval-bleu-args: the searches end where the model ends its sentences
    "beam 2, max_len_b 20 (the issue's)": ("--eval-bleu-args", '{"beam": 2, "max_len_b": 20}'),
    # 3 batches of the valid set: rank 1 validates on one and on its dummy batch (a training batch, zero weight)
    "a rank with fewer valid batches": (*DIFFERENT_LENGTHS, "--batch-size-valid", "10"),
}


@pytest.mark.slow
@pytest.mark.parametrize("extra", TRAINING_ROWS.values(), ids=TRAINING_ROWS.keys())
def test_fully_sharded_eval_bleu_validates_four_times_as_one_process(data_bin, tmp_path, extra):  # noqa: F811
    assert_validates_as_one_process(data_bin, tmp_path, 4, *extra)
