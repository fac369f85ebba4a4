"""The criterions add exactly the weighted router losses; metrics, pad mask and eval capacity."""
import math

import fairseq  # noqa: F401  (before the plugin's modules, as fairseq loads them: also in a spawned rank)
import pytest
import torch

from fairseq_moe.models.moe_ffn import moe_blocks

from tests.fairseq_moe.helpers import build, train_argv


def first_batch(task, args):
    task.load_dataset("valid")
    itr = task.get_batch_iterator(dataset=task.dataset("valid"), max_sentences=16,
                                  required_batch_size_multiple=1, seed=1)
    return next(iter(itr.next_epoch_itr(shuffle=False)))


def losses(data_bin, tmp_path, criterion_name, *extra):
    argv = train_argv(data_bin, tmp_path, *extra)
    argv[argv.index("--criterion") + 1] = criterion_name
    if criterion_name == "moe_cross_entropy":
        i = argv.index("--label-smoothing")
        del argv[i:i + 2]
    task, model, criterion, args = build(argv)
    model.eval()  # no dropout: two builds with the same seed give the same numbers
    sample = first_batch(task, args)
    loss, sample_size, log = criterion(model, sample)
    auxes = [b.last_aux for _, b in moe_blocks(model)]
    return loss, sample_size, log, auxes


@pytest.mark.parametrize("criterion", ["moe_label_smoothed_cross_entropy", "moe_cross_entropy"])
@pytest.mark.parametrize("combine, transform", [("average", "none"), ("sum", "none"), ("average", "neg_log")])
def test_loss_is_task_loss_plus_weighted_router_losses(data_bin, tmp_path, criterion, combine, transform):
    common = (criterion, "--moe-gate-loss-combine-method", combine, "--moe-gate-loss-transform", transform)
    base, sample_size, base_log, _ = losses(data_bin, tmp_path, *common, "--moe-gate-loss-wt", "0")
    loss, sample_size2, log, auxes = losses(data_bin, tmp_path, *common, "--moe-gate-loss-wt", "0.5",
                                            "--moe-z-loss-wt", "0.1")
    assert sample_size == sample_size2 and len(auxes) == 2
    balance = [a.balance_loss.item() for a in auxes]
    gate = sum(balance) if combine == "sum" else sum(balance) / 2
    if transform == "neg_log":
        gate = -math.log(gate)
    z = sum(a.z_loss.item() for a in auxes) / 2
    expected = base.item() + sample_size * (0.5 * gate + 0.1 * z)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # The logged loss is the task's own; the router terms are logged beside it.
    assert log["loss"].item() == pytest.approx(base_log["loss"].item(), rel=1e-6)
    assert log["moe_balance_loss"] == pytest.approx(sum(balance) / 2 * sample_size, rel=1e-5)
    assert log["moe_z_loss"] == pytest.approx(z * sample_size, rel=1e-5)
    for key in ("moe_dropped", "moe_imbalance", "moe_entropy"):
        assert key in log


def test_importance_and_load_losses(data_bin, tmp_path):
    """--moe-gate-loss-type importance_load: --moe-gate-loss-wt weights Shazeer's CV(importance)^2 +
    CV(load)^2 (averaged over the layers) instead of the balance loss."""
    noisy = ("--moe-gate-noise", "gaussian", "--moe-gate-noise-scale", "0.3")
    base, sample_size, _, _ = losses(data_bin, tmp_path, "moe_label_smoothed_cross_entropy", *noisy,
                                     "--moe-gate-loss-wt", "0")
    loss, _, log, auxes = losses(data_bin, tmp_path, "moe_label_smoothed_cross_entropy", *noisy,
                                 "--moe-gate-loss-type", "importance_load", "--moe-gate-loss-wt", "0.5")
    shazeer = sum(a.importance_loss.item() + a.load_loss.item() for a in auxes) / 2
    assert all(a.load_loss.item() > 0 for a in auxes)
    assert loss.item() == pytest.approx(base.item() + sample_size * 0.5 * shazeer, rel=1e-5)
    assert log["moe_load_loss"] == pytest.approx(sum(a.load_loss.item() for a in auxes) / 2 * sample_size)


def test_per_layer_metrics(data_bin, tmp_path):
    """--moe-log-per-layer logs each layer's balance, dropped, imbalance and entropy; their mean over the
    layers is the logged aggregate."""
    _, sample_size, log, auxes = losses(data_bin, tmp_path, "moe_label_smoothed_cross_entropy",
                                        "--moe-log-per-layer", "--moe-capacity-factor", "0.5",
                                        "--moe-eval-capacity-token-fraction", "-1")  # (losses() runs eval)
    layers = ("moe_encoder1", "moe_decoder1")
    for key, aggregate in (("balance", "moe_balance_loss"), ("dropped", "moe_dropped"),
                           ("imbalance", "moe_imbalance"), ("entropy", "moe_entropy")):
        values = [float(log[f"{layer}_{key}"]) for layer in layers]
        assert sum(values) / 2 == pytest.approx(float(log[aggregate]), rel=1e-6)
    assert float(log["moe_encoder1_dropped"]) == pytest.approx(auxes[0].dropped_fraction * sample_size)
    assert log["moe_decoder1_dropped"] > 0
    _, _, plain, _ = losses(data_bin, tmp_path, "moe_label_smoothed_cross_entropy")
    assert not [key for key in plain if key.startswith(layers)]


def test_metrics_read_nothing_from_the_device(data_bin, tmp_path):
    """The MoE metrics are logged as 0-d tensors, as fairseq's own criterions log theirs, and made without reading
    the device (tests/host_reads.py counts; on a GPU each read waits for the queue): fairseq reads them with its own
    loss, once per logged step. Their values: the layers' means, times sample_size."""
    from fairseq_moe.criterions.moe_loss import add_moe_loss
    from tests.host_reads import counted

    task, model, criterion, args = build(train_argv(data_bin, tmp_path, "--moe-log-per-layer", "--moe-gate-loss-type",
                                                    "importance_load", "--moe-capacity-factor", "0.5"))
    model.train()
    criterion(model, first_batch(task, args))
    log = {}
    with counted() as found:
        add_moe_loss(criterion.moe_cfg, model, torch.zeros(()), 3, log)
    assert not found, found
    keys = [key for key in log if key.startswith("moe_")]
    assert {"moe_balance_loss", "moe_dropped", "moe_imbalance", "moe_entropy", "moe_load_loss",
            "moe_encoder1_imbalance"} <= set(keys)
    assert all(torch.is_tensor(log[key]) and log[key].dim() == 0 for key in keys), log
    auxes = [b.last_aux for _, b in moe_blocks(model)]
    for key, value in (("moe_dropped", sum(a.dropped_fraction for a in auxes) / 2),
                       ("moe_imbalance", sum(a.imbalance for a in auxes) / 2),
                       ("moe_entropy", sum(a.entropy.item() for a in auxes) / 2)):
        assert float(log[key]) == pytest.approx(3 * value, rel=1e-6), key
    assert float(log["moe_dropped"]) > 0


def test_pad_mask_keeps_padding_out_of_routing(data_bin, tmp_path):
    for flag, expect_all in (((), True), (("--use-moe-pad-mask",), False)):
        task, model, criterion, args = build(train_argv(data_bin, tmp_path, *flag))
        sample = first_batch(task, args)
        src = sample["net_input"]["src_tokens"]
        assert src.eq(task.source_dictionary.pad()).any(), "the batch must hold padding"
        criterion(model, sample)
        enc = dict(moe_blocks(model))["encoder.layers.1.fc1"].last_aux
        non_pad = int(src.ne(task.source_dictionary.pad()).sum())
        assert enc.num_tokens == (src.numel() if expect_all else non_pad)


def test_the_transposed_mask_is_shared_and_frees_the_mask():
    """The MoE blocks of an encoder share one transposed copy of its mask (and the positions it keeps), made again
    after the mask changes in place, and holding no reference to the mask (a view kept on it would leak it)."""
    import gc
    import weakref

    from fairseq_moe.models.moe_ffn import _transposed

    mask = torch.zeros(2, 3, dtype=torch.bool)
    first = _transposed(mask)
    assert _transposed(mask) is first and torch.equal(first, mask.t())
    mask[0, 2] = True
    assert torch.equal(_transposed(mask), mask.t()) and _transposed(mask) is not first
    gone = weakref.ref(mask)
    del mask
    gc.collect()
    assert gone() is None


def test_validation_uses_eval_capacity(data_bin, tmp_path):
    task, model, criterion, args = build(train_argv(
        data_bin, tmp_path, "--moe-capacity-factor", "0", "--moe-eval-capacity-token-fraction", "0.05"))
    sample = first_batch(task, args)
    model.train()
    with torch.no_grad():
        _, _, train_log = criterion(model, sample)
    _, _, valid_log = task.valid_step(sample, model, criterion)
    assert train_log["moe_dropped"] == 0
    assert valid_log["moe_dropped"] > 0


@pytest.mark.parametrize("extra", [(), ("--dropout", "0.3", "--activation-dropout", "0.2")])
def test_checkpoint_activations_keep_the_router_losses_in_the_graph(data_bin, tmp_path, extra):
    """--checkpoint-activations recomputes the MoE layers in backward: the loss and every gradient,
    the gates' (which only the router losses and the routing weights reach) included, are those of the
    run without it. fairseq's own checkpoint_wrapper ran the layer under no_grad and cut the balance
    and z-losses off the gates."""
    grads = []
    for flag in ((), ("--checkpoint-activations",)):
        task, model, criterion, args = build(train_argv(data_bin, tmp_path, "--moe-z-loss-wt", "0.1",
                                                        "--moe-gate-loss-wt", "1", *extra, *flag))
        model.train()
        sample = first_batch(task, args)
        torch.manual_seed(5)  # the same dropout masks (the recomputation replays them)
        loss, _, _ = criterion(model, sample)
        assert all(b.last_aux.balance_loss.requires_grad for _, b in moe_blocks(model))
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, a), (loss_b, b) = grads
    torch.testing.assert_close(loss_b, loss_a)
    assert set(a) == set(b) and "encoder.layers.1.fc1.moe.gate.weight" in a
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_adaptive_softmax_refused_by_the_moe_criterions(lm_data_bin, tmp_path):
    """Refused when fairseq builds its Trainer (before any update), not in every forward."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    from tests.fairseq_moe.helpers import lm_train_argv

    task, model, criterion, args = build(lm_train_argv(lm_data_bin, tmp_path, "--adaptive-softmax-cutoff", "10,20"))
    with pytest.raises(ValueError, match="--adaptive-softmax-cutoff"):
        Trainer(convert_namespace_to_omegaconf(args), task, model, criterion)


def test_the_cmr_loss_pulls_the_mean_gate_to_p(data_bin, tmp_path):
    """--moe-cmr with --cmr-gate-loss-wt W and --cmr-gate-loss-p P (NLLB's moe_label_smoothed_cross_entropy): loss +=
    sample_size * W * |sum of the gates over every CMR layer's tokens / their count - P|; the mean gate is logged."""
    cmr = ("moe_label_smoothed_cross_entropy", "--moe-cmr", "--moe-gate-loss-wt", "0")
    base, sample_size, _, _ = losses(data_bin, tmp_path, *cmr)
    loss, _, log, auxes = losses(data_bin, tmp_path, *cmr, "--cmr-gate-loss-wt", "0.5", "--cmr-gate-loss-p", "0.8")
    used = sum(a.cmr_gate_sum.item() for a in auxes) / sum(a.num_tokens for a in auxes)
    assert 0 < used < 1 and all(a.cmr_gate_sum.requires_grad for a in auxes)
    assert loss.item() == pytest.approx(base.item() + sample_size * 0.5 * abs(used - 0.8), rel=1e-5)
    assert log["moe_cmr_gate"] == pytest.approx(used * sample_size, rel=1e-5)
    from fairseq_moe.errors import FlagError

    with pytest.raises(FlagError, match="--cmr-gate-loss-wt 0.5 weights the gates of --moe-cmr, which the model"):
        losses(data_bin, tmp_path, "moe_label_smoothed_cross_entropy", "--cmr-gate-loss-wt", "0.5")


def _global_balance_ranks(rank, W, sizes, port, ignored=None):
    """One rank of test_global_balance_loss_on_ranks_equals_one_process (see there)."""
    import datetime

    import torch.distributed as dist
    from torch import nn

    from fairseq_moe.criterions.moe_loss import MoELossConfig, add_moe_loss
    from fairseq_moe.models.moe_ffn import MoEFeedForward
    from fairseq_moe_layer import MoEConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=120))
    try:
        cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, top_k=2, capacity_factor=0.0,
                        eval_capacity_token_fraction=0.0, balance_loss_scope="global")
        loss_cfg = MoELossConfig(moe_gate_loss_wt=0.5, moe_z_loss_wt=0.1)

        def model():
            torch.manual_seed(0)
            return nn.Sequential(MoEFeedForward(cfg), MoEFeedForward(cfg)).double()

        # time-major batches [T, B, d]; rank r holds sizes[r] sentences, sample size = its real tokens
        xs = [torch.randn(4, n, 6, generator=torch.Generator().manual_seed(90 + r), dtype=torch.float64)
              for r, n in enumerate(sizes)]
        weights = [torch.randn(4, n, 6, generator=torch.Generator().manual_seed(95 + r), dtype=torch.float64)
                   for r, n in enumerate(sizes)]

        def step(net, x, w, sample_size):
            log = {}
            loss = add_moe_loss(loss_cfg, net, (net(x) * w).sum(), sample_size, log)
            loss.backward()
            return loss, log

        mine = model().train()
        dummy = rank == ignored  # fairseq's dummy batch (the MoE tasks mark it): the loss times 0, sample size 0
        for block in mine:
            block.moe.ignored = dummy
        log = {}
        loss = add_moe_loss(loss_cfg, mine, (mine(xs[rank]) * weights[rank]).sum(), 4 * sizes[rank], log)
        (loss * (0.0 if dummy else 1.0)).backward()
        if ignored is not None:
            xs, weights, sizes = ([v for r, v in enumerate(t) if r != ignored] for t in (xs, weights, sizes))
        S = 4 * sum(sizes)
        grads = [p.grad.clone() for p in mine.parameters()]
        for g in grads:  # fairseq's trainer: the gradients summed over the ranks, divided by the global sample size
            dist.all_reduce(g)
        logged = torch.stack([log["moe_balance_loss"], log["moe_z_loss"]]).detach() * (0.0 if dummy else 1.0)
        dist.all_reduce(logged)
        whole = model().eval()  # one process holding every sentence in one batch (eval: the same dropless routing)
        _, ref_log = step(whole, torch.cat(xs, 1), torch.cat(weights, 1), S)
        for (name, p), g in zip(whole.named_parameters(), grads):
            torch.testing.assert_close(g / S, p.grad / S, msg=name)
        torch.testing.assert_close(logged[0], ref_log["moe_balance_loss"].detach())  # the global loss, logged
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_global_balance_loss_on_ranks_equals_one_process():
    """--moe-balance-loss-scope global through the criterion: 2 gloo ranks, each with its own sentences and sample
    size (7 and 3 sentences), their gradients summed and divided by the global sample size as fairseq's trainer does,
    equal one process holding every sentence in one batch (the router's, the experts' and every other gradient); the
    logged balance loss summed over the ranks is that process's."""
    from tests import warm
    from tests.conftest import free_port

    warm.spawn(_global_balance_ranks, 2, (2, (7, 3), free_port()))
    # Rank 1 on fairseq's dummy batch: rank 0 alone, as one process holding its sentences
    warm.spawn(_global_balance_ranks, 2, (2, (7, 3), free_port(), 1))
