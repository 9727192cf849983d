"""LoRA RL (``learner.lora``): the learner trains only its adapters and hands only them to
the brokers (named and scaled as asyncrl/engine/adapter.py puts them on the wire); the
engine's merge of those tensors into its base weights gives the learner's own
log-probs; a checkpoint holds the adapter as a PEFT directory; bad settings are refused
naming the key. The real vLLM engine and broker: tests/test_lora_vllm.py."""

from __future__ import annotations

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs
from safetensors.torch import load_file

from asyncrl.config import ConfigError
from asyncrl.engine.adapter import LORA_A, LORA_B, BaseWeights, adapter_pairs, merged_weights
from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.learner import Learner
from asyncrl.learner.model import load_lm
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss

pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen(tmp_path_factory.mktemp("m"))


def lora_learner(model_dir, **lora) -> Learner:
    torch.set_num_threads(1)
    lora = {"rank": RANK, "alpha": ALPHA, "targets": TARGETS, **lora}
    settings = LearnerSettings.defaults(optim=plain_optim(lr=1e-2), lora=lora)
    return Learner(str(model_dir), ClippedISLoss(), GroupNormalized(), settings)


def adapted_layers(lm) -> dict[str, torch.nn.Linear]:
    return {
        n: m
        for n, m in lm.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS
    }


def test_only_adapters_train_and_go_to_the_brokers(model_dir):
    L = lora_learner(model_dir)
    base = {n: p.detach().clone() for n, p in L.model.named_parameters() if "lora_" not in n}
    trainable = [n for n, p in L.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in L.opt.param_groups for p in g["params"]} == {
        id(p) for p in L.policy.parameters() if p.requires_grad
    }

    L.step_on_batch(collate(trajs(8, seed=1)), 0)
    for n, p in L.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n  # the base weights never move

    sent = dict(L.named_parameters_stream())
    plain = load_lm(str(model_dir))
    layers = adapted_layers(plain)
    assert len(layers) == 2 * len(TARGETS)  # 2 decoder layers
    assert set(sent) == {f"{m}{s}" for m in layers for s in (LORA_A, LORA_B)}
    for m, lin in layers.items():
        a, b = sent[m + LORA_A], sent[m + LORA_B]
        assert a.shape == (RANK, lin.in_features) and b.shape == (lin.out_features, RANK)
        peft_b = L.model.get_submodule(m).lora_B["default"].weight
        torch.testing.assert_close(b, peft_b * (ALPHA / RANK), rtol=0, atol=0)
        assert b.abs().max() > 0  # one step at lr 1e-2 moved B off its zero start
    nbytes = sum(t.numel() * t.element_size() for t in sent.values())
    full = sum(p.numel() * p.element_size() for p in plain.parameters())
    assert nbytes == sum(RANK * (x.in_features + x.out_features) * 4 for x in layers.values())
    assert nbytes < 0.25 * full


def test_engine_merge_gives_the_learners_logprobs(model_dir):
    """What a vLLM worker does with a LoRA payload (worker_ext: merged_weights over the
    model directory's base weights), applied to a plain HF model: its logits are the
    learner's (base + adapter) ones."""
    L = lora_learner(model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in L.model.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    merged = merged_weights(list(L.named_parameters_stream()), BaseWeights(str(model_dir)))
    plain = load_lm(str(model_dir))
    plain.load_state_dict(dict(merged), strict=False)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2, 4, 11]])
    with torch.no_grad():
        want = L.model(ids).logits
        got = plain(ids).logits
        base = load_lm(str(model_dir))(ids).logits
    assert (want - base).abs().max() > 1e-2  # the adapter really changes the model
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_payload_checks():
    a, b = torch.zeros(2, 4), torch.zeros(3, 2)
    assert list(adapter_pairs([("m" + LORA_A, a), ("m" + LORA_B, b)])) == ["m"]
    with pytest.raises(ValueError, match="only one of"):
        adapter_pairs([("m" + LORA_A, a)])
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        adapter_pairs([("m.weight", a)])
    with pytest.raises(ValueError, match="does not fit"):
        merged_weights([("m" + LORA_A, a), ("m" + LORA_B, b)], Base({"m.weight": (5, 5)}))


class Base:
    """Base weights of the given shapes (zeros), as the engine's BaseWeights answers."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes

    def __call__(self, name: str) -> torch.Tensor:
        return torch.zeros(self.shapes[name])

    def has(self, name: str) -> bool:
        return name in self.shapes


def test_merge_gives_each_packed_engine_layer_all_its_tensors():
    """An engine layer reloads from what it is given: an adapter on q_proj alone also
    brings k_proj's and v_proj's base weights (packed into one qkv_proj) and the biases."""
    layer = "model.layers.0.self_attn."
    shapes = {layer + f"{x}_proj.{k}": (3, 4) if k == "weight" else (3,)
              for x in "qkvo" for k in ("weight", "bias") if not (x == "o" and k == "bias")}  # fmt: skip
    a, b = torch.ones(2, 4), torch.ones(3, 2)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    out = dict(merged_weights([(layer + "q_proj" + LORA_A, a), (layer + "q_proj" + LORA_B, b)],
                              Base(shapes), packed))  # fmt: skip
    assert set(out) == {layer + f"{x}_proj.{k}" for x in "qkv" for k in ("weight", "bias")}
    assert torch.equal(out[layer + "q_proj.weight"], torch.full((3, 4), 2.0))  # 0 + B @ A
    assert not out[layer + "k_proj.weight"].any()  # the base weight, unchanged
    out = dict(merged_weights([(layer + "o_proj" + LORA_A, a), (layer + "o_proj" + LORA_B, b)],
                              Base(shapes), packed))  # fmt: skip
    assert set(out) == {layer + "o_proj.weight"}


def test_checkpoint_holds_the_adapter(model_dir, tmp_path):
    from peft import PeftModel

    L = lora_learner(model_dir)
    L.step_on_batch(collate(trajs(8, seed=2)), 0)
    path = L.save(str(tmp_path / "ck"))
    adir = tmp_path / "ck" / "adapter"
    assert not (tmp_path / "ck" / "hf").exists()
    state = sum(f.stat().st_size for f in (tmp_path / "ck" / "state").iterdir())
    base = sum(p.numel() * 4 for n, p in L.model.named_parameters() if "lora_" not in n)
    assert state < base  # adapters and their AdamW moments; the frozen base is model.path's
    saved = load_file(str(adir / "adapter_model.safetensors"))
    assert len(saved) == 2 * 2 * len(TARGETS)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2]])
    peft = PeftModel.from_pretrained(load_lm(str(model_dir)), str(adir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, L.model(ids).logits, atol=1e-5, rtol=0)

    back = lora_learner(model_dir)

    def lora_b(learner):
        return [p for n, p in learner.model.named_parameters() if ".lora_B." in n]

    assert not any(torch.equal(p, q) for p, q in zip(lora_b(back), lora_b(L)))  # zeros vs trained
    assert back.load(path)["version"] == 1
    for (n, p), (_, q) in zip(back.model.named_parameters(), L.model.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(Exception, match="lora.rank=4"):
        Learner(str(model_dir), ClippedISLoss(), GroupNormalized(),
                LearnerSettings.defaults(optim=plain_optim())).load(path)  # fmt: skip


@pytest.mark.parametrize(
    "values, key",
    [
        ({"lora": {"rank": -1}}, "learner.lora.rank"),
        ({"lora": {"rank": 8, "alpha": 0}}, "learner.lora.alpha"),
        ({"lora": {"rank": 8, "dropout": 1.0}}, "learner.lora.dropout"),
        ({"lora": {"rank": 8, "targets": []}}, "learner.lora.targets"),
        ({"lora": {"rank": 8, "targets": ["lm_head"]}}, "learner.lora.targets"),
        ({"lora": {"rank": 8}, "world_size": 2}, "learner.lora.rank"),
    ],
)
def test_bad_lora_settings_name_the_key(values, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LearnerSettings.defaults(**values)


def test_off_by_default_and_with_null_rank():
    assert not LearnerSettings.defaults().lora.on
    assert not LearnerSettings.defaults(lora={"rank": None}).lora.on


def test_unknown_target_is_named(model_dir):
    with pytest.raises(ValueError, match="learner.lora.targets"):
        lora_learner(model_dir, targets=["no_such_proj"])


def test_targets_the_model_lacks_are_refused_before_ray(model_dir):
    from asyncrl.learner.lora import check_targets

    lora = LearnerSettings.defaults(lora={"rank": 8, "targets": ["q_proj", "input_layernorm"]}).lora
    with pytest.raises(ConfigError, match=r"\['input_layernorm'\] name no layer .*'q_proj'"):
        check_targets(str(model_dir), lora)
    check_targets(str(model_dir), LearnerSettings.defaults(lora={"rank": 8}).lora)  # conf/'s
