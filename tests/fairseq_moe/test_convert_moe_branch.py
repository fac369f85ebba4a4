"""python -m fairseq_moe.convert_moe_branch: sets in the layout of fairseq's moe branch (written here by a helper
from that code's description, docs/moe_branch.md) convert into checkpoints whose outputs equal a plain-loop
re-implementation of the moe branch's forward on the same weights, for a translation model and an LM, top-1
and top-2, 1, 2 and 4 rank files and 8 replicated ones, tokens dropped at capacity, NLLB's output masking; what cannot be mapped is refused, naming the key."""
import argparse
import math
import os

import pytest
import torch
from fairseq import checkpoint_utils, tasks
from torch import nn

from fairseq_moe import convert_moe_branch
from fairseq_moe.errors import CheckpointError

from tests.fairseq_moe.helpers import lm_train_argv, run_train, train_argv

E = 4
# What the moe branch's config holds of the MoE (its flag names); ours beyond these are not in its checkpoints.
MOE_BRANCH_FIELDS = {"moe_expert_count", "moe_freq", "encoder_moe_freq", "decoder_moe_freq", "moe_top1_expert",
                     "moe_gating_use_fp32", "moe_second_expert_policy", "moe_normalize_gate_prob_before_dropping",
                     "moe_eval_capacity_token_fraction", "moe_normalize_expert_grad", "use_moe_pad_mask",
                     "moe_expert_ffn_dim", "moe_batch_prioritized_routing"}


@pytest.fixture(scope="module")
def saved(data_bin, lm_data_bin, tmp_path_factory):
    """A checkpoint of ours per kind (its config is a complete fairseq config), 1 update, 4 experts."""
    out = {}
    for kind, argv in (("mt", train_argv), ("lm", lm_train_argv)):
        folder = tmp_path_factory.mktemp(kind)
        data = data_bin if kind == "mt" else lm_data_bin
        run_train(argv(data, folder, "--max-update", "1", "--moe-expert-count", str(E), "--dropout", "0"))
        out[kind] = torch.load(folder / "checkpoint_last.pt", weights_only=True)
    return out


def write_moe_branch_set(ours, prefix, ranks, top1=False, cmr=False, **cfg_changes):
    """Our checkpoint rewritten as the moe branch saves it: PREFIX-shared.pt (all but the experts; gates as
    LAYER.moe_layer.gate.wg.weight) and PREFIX-rank-R.pt (rank R's experts LAYER.moe_layer.experts.j.fc1/fc2,
    global expert R * El + j, or R mod E with more ranks than experts). cmr: NLLB's CMR layers, as its
    state_dict holds them: each MoE layer also has a dense fc1/fc2 and LAYER.cmr_layer.gate.wg (random here), and
    its MoE module a second time under LAYER.cmr_layer.moe_layer. Returns the moe-branch state dict."""
    model, moe = {}, {}
    for key, t in ours["model"].items():
        if ".fc1.moe." not in key:
            model[key] = t
            continue
        layer, rest = key.split(".fc1.moe.")
        if rest == "gate.weight":
            model[f"{layer}.moe_layer.gate.wg.weight"] = t
        else:
            fc, kind = {"experts.w1": ("fc1", "weight"), "experts.b1": ("fc1", "bias"),
                        "experts.w2": ("fc2", "weight"), "experts.b2": ("fc2", "bias")}[rest]
            for e in range(E):
                moe[f"{layer}.moe_layer.experts.{e}.{fc}.{kind}"] = t[e].t().contiguous() if kind == "weight" else t[e]
    if cmr:
        g = torch.Generator().manual_seed(5)
        for layer in sorted({k.split(".moe_layer.")[0] for k in model if ".moe_layer." in k}):
            D, F = ours["model"][f"{layer}.fc1.moe.experts.w1"].shape[1:]
            for key, shape in (("fc1.weight", (F, D)), ("fc1.bias", (F,)), ("fc2.weight", (D, F)), ("fc2.bias", (D,)),
                               ("cmr_layer.gate.wg.weight", (1, D)), ("cmr_layer.gate.wg.bias", (1,))):
                model[f"{layer}.{key}"] = torch.randn(shape, generator=g) * 0.3
            model[f"{layer}.cmr_layer.moe_layer.gate.wg.weight"] = model[f"{layer}.moe_layer.gate.wg.weight"]
        moe.update({k.replace(".moe_layer.", ".cmr_layer.moe_layer."): t for k, t in list(moe.items())})
        cfg_changes = dict(cfg_changes, moe_cmr=True, cmr_gate_drop=0.1)
    args = {k: v for k, v in vars(ours["cfg"]["model"]).items() if not k.startswith("moe_") or k in MOE_BRANCH_FIELDS}
    lm = not any(k.startswith("encoder.") for k in model)
    args.update(_name="transformer_lm_gpt" if lm else "transformer", arch="transformer_lm_gpt" if lm else "transformer",
                **{**dict(moe_top1_expert=top1, moe_second_expert_policy="all", moe_eval_capacity_token_fraction=1.0,
                      moe_expert_ffn_dim=None), **cfg_changes})
    cfg = dict(ours["cfg"], model=argparse.Namespace(**args))
    cfg["task"] = {k: v for k, v in cfg["task"].items() if not k.startswith("moe_")}  # (our task's own flags)
    cfg["task"]["_name"] = "language_modeling" if lm else "translation"
    common = {k: v for k, v in ours.items() if k not in ("model", "cfg", "last_optimizer_state")}
    torch.save(dict(common, model=model, cfg=cfg), f"{prefix}-shared.pt")
    El = max(1, E // ranks)
    for r in range(ranks):
        local = {}
        for key, t in moe.items():
            layer, j = key.split(".moe_layer.experts.")
            e, part = int(j.split(".", 1)[0]), j.split(".", 1)[1]
            if (ranks <= E and e // El == r) or (ranks > E and e == r % E):
                local[f"{layer}.moe_layer.experts.{e % El if ranks <= E else 0}.{part}"] = t
        torch.save(dict(common, model=local, cfg=cfg), f"{prefix}-rank-{r}.pt")
    return {**model, **moe}, cfg


class PlainMoE(nn.Module):
    """The moe branch's MOELayer at eval (docs/moe_branch.md, section 3), one token at a time: tokens in
    batch-major order, capacity ceil(fraction * S) for a fraction > 0, else the training capacity 2 * ceil(S / E)
    (top-2) or ceil(S / E) (top-1), first choices queued before second ones, top-2 weights renormalised over the
    kept choices, top-1 the raw probability, FFN_e = fc2(relu(fc1(x))). With use_moe_pad_mask, self.pad [B, T]
    (set before each call): the padding is routed nowhere, but S counts it."""

    def __init__(self, weights, layer, top1, fraction, eom=0.0, fom=0.0):
        super().__init__()
        self.w, self.layer, self.top1, self.fraction, self.eom, self.fom = weights, layer, top1, fraction, eom, fom
        self.pad = None

    def forward(self, x):  # [T, B, C] -> [T, B, C]
        T, B, C = x.shape
        tokens = x.transpose(0, 1).reshape(-1, C)  # s = b * T + t
        S = tokens.shape[0]
        w = self.w
        probs = torch.softmax(tokens.float() @ w[f"{self.layer}.moe_layer.gate.wg.weight"].float().t(), dim=-1)
        capacity = math.ceil(self.fraction * S) if self.fraction > 0 else (1 if self.top1 else 2) * math.ceil(S / E)
        first = probs.argmax(-1).tolist()
        second = probs.scatter(1, probs.argmax(-1, keepdim=True), -1.0).argmax(-1).tolist()
        routed = [True] * S if self.pad is None else (~self.pad.reshape(-1)).tolist()
        count = [0] * E
        keep1, keep2 = [False] * S, [False] * S
        for s in filter(routed.__getitem__, range(S)):
            keep1[s] = count[first[s]] < capacity
            count[first[s]] += 1
        for s in filter(routed.__getitem__, range(S)):
            keep2[s] = not self.top1 and count[second[s]] < capacity
            count[second[s]] += 1
        out = torch.zeros_like(tokens)
        for s in range(S):
            g1 = probs[s, first[s]].item() * keep1[s]
            g2 = probs[s, second[s]].item() * keep2[s]
            if not self.top1:
                d = max(g1 + g2, torch.finfo(torch.float32).eps)
                g1, g2 = g1 / d, g2 / d
            for e, g in ((first[s], g1), (second[s], g2)):
                if g:
                    p = f"{self.layer}.moe_layer.experts.{e}."
                    h = torch.relu(tokens[s] @ w[p + "fc1.weight"].t() + w[p + "fc1.bias"])
                    out[s] += g * ((h @ w[p + "fc2.weight"].t() + w[p + "fc2.bias"]) * (1 - self.eom))
            cmr = f"{self.layer}.cmr_layer.gate.wg."
            if cmr + "weight" in w:  # NLLB's CMR: (1 - g) FFN(x) + g MoE(x), the layer's own dense FFN
                gate = torch.sigmoid(tokens[s] @ w[cmr + "weight"][0] + w[cmr + "bias"][0])
                p = f"{self.layer}."
                h = torch.relu(tokens[s] @ w[p + "fc1.weight"].t() + w[p + "fc1.bias"])
                out[s] = (1 - gate) * (h @ w[p + "fc2.weight"].t() + w[p + "fc2.bias"]) + gate * out[s]
            out[s] = out[s] * (1 - self.fom)  # (NLLB: each expert output, then the layer's, at eval)
        return out.view(B, T, C).transpose(0, 1)


def reference_model(weights, cfg, top1):
    """fairseq's dense model of the same config, each MoE layer's FFN replaced by PlainMoE."""
    from omegaconf import OmegaConf

    task = tasks.setup_task(OmegaConf.create(cfg["task"]))
    model = task.build_model(cfg["model"]).eval()
    moe_layers = sorted({k.split(".moe_layer.")[0] for k in weights if ".moe_layer." in k and ".cmr_layer." not in k})
    model.load_state_dict({k: v for k, v in weights.items() if ".moe_layer." not in k and ".cmr_layer." not in k},
                          strict=False)
    for name in moe_layers:
        layer = model.get_submodule(name)
        layer.fc1 = PlainMoE(weights, name, top1, cfg["model"].moe_eval_capacity_token_fraction,
                             getattr(cfg["model"], "moe_eom", 0.0), getattr(cfg["model"], "moe_fom", 0.0))
        layer.fc1.use_pad_mask = getattr(cfg["model"], "use_moe_pad_mask", False)
        layer.fc2, layer.activation_dropout_module = nn.Identity(), nn.Identity()
        layer.activation_fn = lambda t: t
    return model, task


def forward(model, task):
    """The model's logits on 3 random sentences, padded (routed like any token: the moe branch's default without
    --use-moe-pad-mask; with it, routed nowhere): the targets on the right, the sources on the left."""
    g = torch.Generator().manual_seed(0)
    d = task.target_dictionary
    x = torch.randint(d.nspecial, len(d), (3, 9), generator=g)
    x[2, 6:] = d.pad()
    src = torch.randint(d.nspecial, len(d), (3, 7), generator=g)
    src[1, :2] = d.pad()
    for m in model.modules():  # (the plain loop's padding mask: what the moe branch's layers are given)
        if isinstance(m, PlainMoE) and getattr(m, "use_pad_mask", False):
            m.pad = src.eq(d.pad()) if m.layer.startswith("encoder.") else x.eq(d.pad())
    with torch.no_grad():
        if hasattr(model, "encoder"):
            return model(src, torch.tensor([7, 5, 7]), x)[0]
        return model(x)[0]


# fraction 1.0: nothing dropped; 0.25 and -1.0 (the training capacity) drop tokens of the 3 sentences of forward():
# which ones depends on the order they queue in (sentence by sentence) and on the capacity's rounding.
@pytest.mark.parametrize("fraction", [1.0, 0.25, -1.0])
@pytest.mark.parametrize("kind, ranks, top1, masking", [
    ("mt", 1, False, {}), ("mt", 2, True, {}), ("mt", 8, False, {}), ("lm", 4, False, {}), ("lm", 2, True, {}),
    ("mt", 2, False, dict(moe_eom=0.2, moe_fom=0.1)),  # NLLB-MoE's expert and final output masking (1 - p at eval)
    ("mt", 4, False, dict(cmr=True, moe_eom=0.2)),  # NLLB's conditional MoE routing (CMR)
    # NLLB-MoE's training flag: padding routed nowhere, but the capacity counts it
    ("mt", 2, False, dict(use_moe_pad_mask=True)), ("lm", 1, True, dict(use_moe_pad_mask=True))])
def test_converted_model_computes_what_the_moe_branch_computed(saved, tmp_path, kind, ranks, top1, masking, fraction):
    weights, cfg = write_moe_branch_set(saved[kind], str(tmp_path / "model"), ranks, top1,
                                        moe_eval_capacity_token_fraction=fraction, **masking)
    out = tmp_path / "converted.pt"
    assert convert_moe_branch.main([str(tmp_path / "model"), str(out)]) == 0
    (ours,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(out)])
    reference, _ = reference_model(weights, cfg, top1)
    assert any(".fc1.moe.experts." in k for k in ours.state_dict())
    torch.testing.assert_close(forward(ours.eval(), task), forward(reference, task), rtol=1e-5, atol=1e-5)
    if fraction < 1:  # tokens were dropped: without the capacity, the outputs differ
        dropless, _ = reference_model(weights, dict(cfg, model=argparse.Namespace(
            **dict(vars(cfg["model"]), moe_eval_capacity_token_fraction=1.0))), top1)
        assert not torch.allclose(forward(dropless, task), forward(reference, task), rtol=1e-3, atol=1e-3)
    state = torch.load(out, weights_only=True)
    assert "last_optimizer_state" not in state and state["cfg"]["model"].moe_top_k == (1 if top1 else 2)
    if masking.get("cmr"):
        assert state["cfg"]["model"].cmr_gate_drop == 0.1 and any(".moe.cmr_gate." in k for k in state["model"])


def test_refusals(saved, tmp_path, capsys):
    def fails(prefix, match, out="x.pt"):
        assert convert_moe_branch.main([str(prefix), str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m fairseq_moe.convert_moe_branch: error:") and match in err, err

    cases = {"cmr": dict(moe_cmr=True), "base": dict(base_layers=1)}
    for name, change in cases.items():
        write_moe_branch_set(saved["mt"], str(tmp_path / name), 2, **change)
        fails(tmp_path / name, f"cfg.model.{next(iter(change))}")
    write_moe_branch_set(saved["mt"], str(tmp_path / "gap"), 4)
    os.remove(tmp_path / "gap-rank-2.pt")
    fails(tmp_path / "gap", "gap-rank-2.pt is missing")
    write_moe_branch_set(saved["mt"], str(tmp_path / "odd"), 2)
    shared = torch.load(tmp_path / "odd-shared.pt", weights_only=True)
    shared["model"]["encoder.layers.1.moe_layer.gate.wg.bias"] = torch.zeros(E)
    torch.save(shared, tmp_path / "odd-shared.pt")
    fails(tmp_path / "odd", "encoder.layers.1.moe_layer.gate.wg.bias")
    loose = {"top1": dict(moe_top1_expert="False"), "fraction": dict(moe_eval_capacity_token_fraction="0.5"),
             "policy": dict(moe_second_expert_policy=None), "junk": dict(moe_second_expert_policy="samplng"),
             "normalize": dict(moe_normalize_gate_prob_before_dropping="yes"), "eom": dict(moe_eom="0.2"),
             "fom": dict(moe_fom=1.5)}
    for name, change in loose.items():  # typed as the moe branch types them, or refused by name
        write_moe_branch_set(saved["mt"], str(tmp_path / name), 2, **change)
        key, value = next(iter(change.items()))
        fails(tmp_path / name, f"cfg.model.{key} = {value!r} is not ")  # (a number, a probability in [0, 1))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("x")]  # nothing written
    write_moe_branch_set(saved["mt"], str(tmp_path / "three"), 2, moe_expert_count=3)
    fails(tmp_path / "three", "moe_expert_count 3")
    write_moe_branch_set(saved["mt"], str(tmp_path / "ok"), 2)
    fails(tmp_path / "ok", "ok-shared.pt exists", out="ok.pt")  # (OUT beside a set of its name: ambiguous)
    assert convert_moe_branch.main([str(tmp_path / "ok-rank-1.pt"), str(tmp_path / "ok1.pt")]) == 0  # any file name
    fails(tmp_path / "ok", "ok1.pt exists", out="ok1.pt")
    with pytest.raises(CheckpointError, match="converted from fairseq's moe branch .* --finetune-from-model"):
        from tests.fairseq_moe.helpers import run_train as train
        train(train_argv(str(saved["mt"]["cfg"]["task"]["data"]), tmp_path / "resume", "--moe-expert-count", str(E),
                         "--restore-file", str(tmp_path / "ok1.pt")))


@pytest.mark.slow
def test_a_converted_model_generates_on_two_ranks_as_on_one_process(saved, data_bin, tmp_path):
    """A model of the moe branch's 2-rank layout, converted to one file, generates on 2 ranks with its experts
    spread as on one process (tests/fairseq_moe/hooks/test_spread.py's comparison)."""
    from tests.fairseq_moe.hooks.test_spread import assert_same, generate, tail

    write_moe_branch_set(saved["mt"], str(tmp_path / "model"), 2)
    out = tmp_path / "converted.pt"
    assert convert_moe_branch.main([str(tmp_path / "model"), str(out)]) == 0
    one, many = generate(data_bin, out, 1), generate(data_bin, out, 2)
    assert one.returncode == 0 and many.returncode == 0, tail(one.stderr + many.stderr)
    assert_same(one.stdout, many.stdout)
