"""--tensorboard-logdir works out of the box (tensorboardX is installed with the plugin): the MoE metrics,
per layer where asked, are written beside the loss."""
import struct

from tests.fairseq_moe.helpers import run_train, train_argv


def scalar_tags(folder):
    """The tags of every scalar in the TensorBoard event files under folder (TFRecord: length, crc, event, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for path in folder.rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            tags.update(v.tag for v in event.summary.value)
    return tags


def test_moe_metrics_reach_tensorboard(data_bin, tmp_path):
    logdir = tmp_path / "tb"
    run_train(train_argv(data_bin, tmp_path / "ckpt", "--max-update", "2", "--moe-log-per-layer",
                         "--tensorboard-logdir", str(logdir)))
    from fairseq.logging import progress_bar

    for writer in progress_bar._tensorboard_writers.values():
        writer.flush()  # (fairseq closes them at exit; this process goes on)
    train, valid = scalar_tags(logdir / "train_inner"), scalar_tags(logdir / "valid")
    for tags in (train, valid):
        assert {"loss", "moe_balance_loss", "moe_imbalance", "moe_encoder1_balance", "moe_decoder1_entropy"} <= tags, tags


def test_a_dummy_batch_is_marked_on_the_layers(data_bin, tmp_path):
    """The MoE tasks' train_step tells the layers when fairseq runs its dummy batch (ignore_grad: a rank whose data ran
    out), for one step: the global balance loss and the balancing bias then count its tokens on no rank."""
    from types import SimpleNamespace

    from fairseq_moe.models.moe_ffn import moe_blocks

    from tests.fairseq_moe.criterions.test_moe_loss import first_batch
    from tests.fairseq_moe.helpers import build

    task, model, criterion, args = build(train_argv(data_bin, tmp_path))
    seen = []
    forward = criterion.forward

    def watched(model, sample, **kwargs):
        seen.append([block.moe.ignored for _, block in moe_blocks(model)])
        return forward(model, sample, **kwargs)

    criterion.forward = watched
    sample = first_batch(task, args)
    optimizer = SimpleNamespace(backward=lambda loss: loss.backward())
    for ignore_grad in (True, False):
        task.train_step(sample, model, criterion, optimizer, 0, ignore_grad=ignore_grad)
    assert seen == [[True, True], [False, False]]
    assert not any(block.moe.ignored for _, block in moe_blocks(model))


def test_the_global_balance_loss_pools_each_updates_micro_batches(data_bin, tmp_path, monkeypatch):
    """fairseq-train --moe-balance-loss-scope global --update-freq 3: every Trainer.train_step starts each MoE layer's
    running sum (the plugin's Trainer hook), and the MoE task adds each micro-batch's counts after its backward."""
    from fairseq_moe_layer import MoELayer

    from tests.fairseq_moe.helpers import run_train

    events = []
    for name in ("reset_global_counts", "add_global_counts"):
        original = getattr(MoELayer, name)

        def logged(self, original=original, name=name):
            events.append((id(self), name[:3], self.last_global_counts is not None))
            return original(self)

        monkeypatch.setattr(MoELayer, name, logged)
    run_train(train_argv(data_bin, tmp_path, "--moe-balance-loss-scope", "global", "--update-freq", "3",
                         "--max-update", "2"))
    first = events[0][0]
    mine = "".join(what[0] if seen or what == "res" else "?" for layer, what, seen in events if layer == first)
    # two updates: the first of 3 micro-batches, the second of what the epoch has left (fairseq's last group)
    assert mine.startswith("raaar") and mine.count("r") == 2 and set(mine[5:]) == {"a"}, mine
