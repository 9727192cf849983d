"""The resharding weight sync (asyncrl/transport/reshard.py), without an engine.

The plan against vLLM's own weight loaders: vLLM's parallel layers (QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) built on the CPU
as engine rank r of tp would build them (the TP rank and size they read patched), each
loading the learner's full tensors as the model's ``load_weights`` hands them over; the
plan's shard of every tensor equals what the layer kept, bit for bit. Then the transport:
learner rank 0's endpoint and two TP-2 engines' workers (threads, gloo on loopback), a
full sync and two partial ones (sparse delta, changed buckets): each worker receives
only its shard, equal to the plan's slice of that version bit for bit, and bytes per
engine rank are about half the model's.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from asyncrl.transport.endpoint import ReceiverEndpoint, SenderEndpoint
from asyncrl.transport.reshard import UnsupportedLayout, check_family, plan_for
from asyncrl.transport.spec import NO_VERSION, JoinSpec

HOST = "127.0.0.1"
TINY = Path(__file__).parents[1] / "asyncrl/models/tiny_default/config.json"
LLAMA = {  # key/value heads split 3 ways, replicated 6 ways; an untied head
    "model_type": "llama", "hidden_size": 96, "num_attention_heads": 6,
    "num_key_value_heads": 3, "intermediate_size": 192, "vocab_size": 150,
    "tie_word_embeddings": False,
}  # fmt: skip


def hf_tensors(config: dict, layers: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """A decoder's learner tensors (HF names, full shapes), random."""
    g = torch.Generator().manual_seed(seed)
    h, heads = config["hidden_size"], config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv, inter, vocab = (
        config["num_key_value_heads"],
        config["intermediate_size"],
        config["vocab_size"],
    )
    bias = config["model_type"] == "qwen2"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            f"{p}input_layernorm.weight": (h,),
            f"{p}self_attn.q_proj.weight": (heads * hd, h),
        }
        shapes |= {f"{p}self_attn.{x}_proj.weight": (kv * hd, h) for x in "kv"}
        if bias:
            shapes |= {f"{p}self_attn.q_proj.bias": (heads * hd,)}
            shapes |= {f"{p}self_attn.{x}_proj.bias": (kv * hd,) for x in "kv"}
        shapes |= {f"{p}self_attn.o_proj.weight": (h, heads * hd)}
        shapes |= {f"{p}post_attention_layernorm.weight": (h,)}
        shapes |= {f"{p}mlp.{x}_proj.weight": (inter, h) for x in ("gate", "up")}
        shapes |= {f"{p}mlp.down_proj.weight": (h, inter)}
    shapes |= {"model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        shapes |= {"lm_head.weight": (vocab, h)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


# ----------------------------------------------------------------- the plan vs vLLM
def vllm_rank(monkeypatch, tp: int, rank: int) -> None:
    """vLLM's layers built from now on are engine rank ``rank`` of ``tp``."""
    import vllm.model_executor.layers.linear  # noqa: F401 - patched below, once imported
    import vllm.model_executor.layers.vocab_parallel_embedding  # noqa: F401
    import vllm.model_executor.parameter  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and module is not None:
            if hasattr(module, "get_tensor_model_parallel_world_size"):
                monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)
            if hasattr(module, "get_tensor_model_parallel_rank"):
                monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)


def vllm_shard(config: dict, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM's parallel layers keep of ``hf`` (layer 0, the embedding, the head),
    loaded through their own weight loaders as Qwen2/Llama ``load_weights`` calls them."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    h, heads = config["hidden_size"], config["num_attention_heads"]
    hd, kv, inter = h // heads, config["num_key_value_heads"], config["intermediate_size"]
    bias = config["model_type"] == "qwen2"
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    out = {}
    with set_current_vllm_config(VllmConfig()):
        qkv = QKVParallelLinear(h, hd, heads, kv, bias=bias)
        gate_up = MergedColumnParallelLinear(h, [inter, inter], bias=False)
        o, down = (
            RowParallelLinear(heads * hd, h, bias=False),
            RowParallelLinear(inter, h, bias=False),
        )
        embed = VocabParallelEmbedding(config["vocab_size"], h)
        for leaf in ("weight", "bias") if bias else ("weight",):
            p = getattr(qkv, leaf)
            for sid in "qkv":
                p.weight_loader(p, hf[f"{a}{sid}_proj.{leaf}"], sid)
            out[f"{a}qkv_proj.{leaf}"] = p.data
        dense = f"{m}gate_proj.weight" in hf  # a MoE layer has experts instead
        for sid, proj in enumerate(("gate", "up") if dense else ()):
            gate_up.weight.weight_loader(gate_up.weight, hf[f"{m}{proj}_proj.weight"], sid)
            out[f"{m}gate_up_proj.weight"] = gate_up.weight.data
        for layer, name in ((o, f"{a}o_proj.weight"), (down, f"{m}down_proj.weight")):
            if name not in hf:
                continue
            layer.weight.weight_loader(layer.weight, hf[name])
            out[name] = layer.weight.data
        embed.weight.weight_loader(embed.weight, hf["model.embed_tokens.weight"])
        out["model.embed_tokens.weight"] = embed.weight.data
        if "lm_head.weight" in hf:
            head = ParallelLMHead(config["vocab_size"], h)
            head.weight.weight_loader(head.weight, hf["lm_head.weight"])
            out["lm_head.weight"] = head.weight.data
    return out


@pytest.mark.parametrize(
    "config, tp",
    [(json.loads(TINY.read_text()), 2), (json.loads(TINY.read_text()), 4), (LLAMA, 3), (LLAMA, 6)],
    ids=["qwen2-tp2", "qwen2-tp4-kv-replicated", "llama-tp3", "llama-tp6-kv-replicated"],
)
def test_the_plan_slices_as_vllms_own_loaders(monkeypatch, config, tp):
    pytest.importorskip("vllm")
    hf = hf_tensors(config)
    plan = plan_for(config, [(n, tuple(t.shape)) for n, t in hf.items()], tp)
    assert plan_for(config, [(n, tuple(t.shape)) for n, t in hf.items()], tp) is plan  # cached
    assert ("lm_head.weight" in {t.name for t in plan.ranks[0]}) == ("lm_head.weight" in hf)
    compared = 0
    for rank in range(tp):
        vllm_rank(monkeypatch, tp, rank)
        want = vllm_shard(config, hf)
        mine = dict(plan.shard(rank, hf))
        targets = {t.name: t for t in plan.ranks[rank]}
        for name, kept in want.items():
            got, t = mine[name], targets[name]
            assert t.shape == tuple(kept.shape), (rank, name)
            assert torch.equal(got, kept[: t.rows]), (rank, name)  # bits: fp32 copies
            assert not kept[t.rows :].any(), (rank, name)  # vocabulary padding stays zero
            compared += 1
        replicated = [n for n in mine if "norm" in n]
        assert replicated and all(torch.equal(mine[n], hf[n]) for n in replicated)
    assert compared >= tp * 5


def test_what_the_plan_refuses():
    assert check_family({"model_type": "qwen2_moe"}) is not None
    assert "qwen2" in check_family({"model_type": "mixtral"})
    assert check_family(json.loads(TINY.read_text())) is None
    expert = [("model.layers.0.mlp.experts.0.gate_proj.weight", (8, 4))]
    with pytest.raises(UnsupportedLayout, match="expert tensor .*experts.0.gate_proj"):
        plan_for({**LLAMA, "model_type": "qwen2"}, expert + [("x.weight", (2,))], 2)
    with pytest.raises(UnsupportedLayout, match="no resharding rule"):
        plan_for(LLAMA, [("model.vision.patch.weight", (4, 4))], 3)
    with pytest.raises(UnsupportedLayout, match="does not split"):
        plan_for(LLAMA, [("model.layers.0.mlp.gate_proj.weight", (10, 4)),
                         ("model.layers.0.mlp.up_proj.weight", (10, 4))], 3)  # fmt: skip


# ----------------------------------------------------------------- a Qwen3-MoE engine
MOE = {  # tiny_moe's layout (head_dim 32, 8 experts of width 64), an untied head
    "model_type": "qwen3_moe", "hidden_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 64,
    "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 150, "num_hidden_layers": 2, "tie_word_embeddings": False,
}  # fmt: skip
W13, W2 = "mlp.experts.routed_experts.w13_weight", "mlp.experts.routed_experts.w2_weight"


def moe_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE learner's tensors as transformers names and shapes them (HF's fused
    experts: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), random."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**config))
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def vllm_experts(hf: dict[str, torch.Tensor], layer: int, tp: int, rank: int):
    """What vLLM's fused-MoE loader keeps of layer ``layer``'s experts on rank ``rank``:
    its own slicing (``RoutedExperts._load_model_weight_or_group_weight_scale`` and the
    ``_load_w13``/``_load_w2`` it calls) on a stand-in for the layer, fed as its
    ``load_weights`` feeds a fused checkpoint tensor (gate/up chunked in two along dim 1,
    then one expert at a time)."""
    from types import MethodType, SimpleNamespace

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    gate_up = hf[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    down = hf[f"model.layers.{layer}.mlp.experts.down_proj"]
    e, h, per = gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2 // tp
    parallel = SimpleNamespace(tp_size=tp)
    layer_ = SimpleNamespace(moe_config=SimpleNamespace(
        tp_shard_with_padding=False, is_act_and_mul=True, moe_parallel_config=parallel))  # fmt: skip
    for f in ("_load_model_weight_or_group_weight_scale", "_load_w13", "_load_w2"):
        setattr(layer_, f, MethodType(getattr(RoutedExperts, f), layer_))
    for f in ("_get_hidden_dim", "_narrow_expert_data_for_padding"):
        setattr(layer_, f, getattr(RoutedExperts, f))
    w13, w2 = torch.zeros(e, 2 * per, h), torch.zeros(e, h, per)
    load = layer_._load_model_weight_or_group_weight_scale
    for chunk, shard_id in enumerate(("w1", "w3")):
        for x, w in enumerate(gate_up.chunk(2, dim=1)[chunk].unbind()):
            load(shard_dim=0, expert_data=w13[x], shard_id=shard_id, loaded_weight=w, tp_rank=rank)
    for x, w in enumerate(down.unbind()):
        load(shard_dim=1, expert_data=w2[x], shard_id="w2", loaded_weight=w, tp_rank=rank)
    return w13, w2


@pytest.mark.parametrize("tp", [2, 4])
def test_the_qwen3_moe_plan_slices_as_vllms_own_loaders_and_gathers_back_whole(monkeypatch, tp):
    """Every rank's shard: attention and embedding as vLLM's parallel layers keep them,
    experts as its fused-MoE loader keeps them, router and norms (Qwen3's q/k norms
    too) whole; the ranks' expert shards put back together are the learner's tensors."""
    pytest.importorskip("vllm")
    hf = moe_tensors(MOE)
    stream = [(n, tuple(t.shape)) for n, t in hf.items()]
    plan = plan_for(MOE, stream, tp)
    assert plan.family == "qwen3_moe" and plan_for(MOE, stream, tp) is plan
    shards = []
    for rank in range(tp):
        vllm_rank(monkeypatch, tp, rank)
        want = vllm_shard(MOE, hf)
        mine = dict(plan.shard(rank, hf))
        for i in range(MOE["num_hidden_layers"]):
            want[f"model.layers.{i}.{W13}"], want[f"model.layers.{i}.{W2}"] = vllm_experts(
                hf, i, tp, rank
            )
        targets = {t.name: t for t in plan.ranks[rank]}
        for name, kept in want.items():
            t = targets[name]
            assert t.shape == tuple(kept.shape), (rank, name)
            assert torch.equal(mine[name][: t.rows], kept[: t.rows]), (rank, name)
        whole = [n for n in mine if "norm" in n or n.endswith("mlp.gate.weight")]
        assert len(whole) == 2 * 5 + 1  # per layer: 2 layer norms, q/k norms, router
        assert all(torch.equal(mine[n], hf[n]) for n in whole)
        shards.append(mine)
    for i in range(MOE["num_hidden_layers"]):
        w13 = [s[f"model.layers.{i}.{W13}"] for s in shards]
        gate = torch.cat([w.chunk(2, dim=1)[0] for w in w13], dim=1)
        up = torch.cat([w.chunk(2, dim=1)[1] for w in w13], dim=1)
        gathered = torch.cat([gate, up], dim=1)
        assert torch.equal(gathered, hf[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        w2 = torch.cat([s[f"model.layers.{i}.{W2}"] for s in shards], dim=2)
        assert torch.equal(w2, hf[f"model.layers.{i}.mlp.experts.down_proj"])


def test_each_engine_rank_of_a_moe_model_gets_about_half_the_bytes():
    hf = moe_tensors(MOE)
    plan = plan_for(MOE, [(n, tuple(t.shape)) for n, t in hf.items()], 2)
    itemsize = {t.name: 4 for r in plan.ranks for t in r}
    model = sum(t.numel() * 4 for t in hf.values())
    experts = sum(t.numel() * 4 for n, t in hf.items() if ".experts." in n)
    per_rank = [plan.nbytes(r, itemsize) for r in range(2)]
    assert per_rank[0] == per_rank[1] and 0.45 * model < per_rank[0] < 0.6 * model
    assert sum(t.numel * 4 for t in plan.ranks[0] if "experts" in t.name) == experts // 2
    assert per_rank[0] == sum(x.numel() * 4 for x in dict(plan.shard(0, hf)).values())


def test_what_the_moe_plan_refuses():
    per_expert = [("model.layers.0.mlp.experts.0.gate_proj.weight", (64, 128))]
    with pytest.raises(UnsupportedLayout, match="expert tensor .*experts.0.gate_proj.*fused"):
        plan_for(MOE, per_expert, 2)
    with pytest.raises(UnsupportedLayout, match="expert tensor .*shared_expert"):
        plan_for(MOE, [("model.layers.0.mlp.shared_expert.up_proj.weight", (64, 128))], 2)
    with pytest.raises(UnsupportedLayout, match="expert width of 64 does not split 3 ways"):
        plan_for(MOE, [("model.layers.0.mlp.experts.down_proj", (8, 128, 64))], 3)
    assert check_family(MOE) is None and "qwen3_moe" in check_family({"model_type": "qwen2_moe"})


def test_the_driver_refuses_an_expert_width_vllm_cpu_pads():
    """Width 64: 32 per rank at T=2 fits vLLM-CPU's 32-wide alignment; 16 at T=4 is
    padded to 32 by the engine, so no shard fits (a GPU engine does not pad)."""
    assert check_family(MOE, 2, cpu=True) is None
    line = check_family(MOE, 4, cpu=True)
    assert "vLLM-CPU pads each rank's expert width (64 / 4 = 16) to a multiple of 32" in line
    assert check_family(MOE, 4, cpu=False) is None
    assert "moe_intermediate_size=64 does not split 3 ways" in check_family(MOE, 3)
    assert check_family(json.loads(TINY.read_text()), 4, cpu=True) is None  # dense: no experts


# ----------------------------------------------------------------- the transport
ENGINES, TP = 2, 2


def test_each_worker_receives_only_its_shard_in_every_mode():
    """Two engines of TP 2 (four workers); versions 0 -> 1 (a few elements: sparse) ->
    2 (a norm only: most buckets skipped). Every worker holds exactly the plan's slice."""
    config = json.loads(TINY.read_text())
    v0 = hf_tensors(config, layers=2)
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["model.layers.0.self_attn.q_proj.weight"][5, :3] += 1.0
    v1["model.layers.1.mlp.down_proj.weight"][:, 7] -= 1.0
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["model.norm.weight"][0] = 3.0
    versions = [v0, v1, v2]
    world, timeout_s = 1 + ENGINES * TP, 30.0
    tx = SenderEndpoint(HOST, "gloo", timeout_s, 60.0, bucket_mb=0.05, model_config=config)
    port: list[int] = []
    opened = threading.Thread(target=tx.open, args=("g", world, port.append), daemon=True)
    opened.start()
    while not port:
        threading.Event().wait(0.01)
    got: dict[int, list] = {g: [] for g in range(1, world)}

    def worker(g: int) -> None:
        rx = ReceiverEndpoint()
        spec = JoinSpec("g", HOST, port[0], g, world, timeout_s, 60.0, "gloo")
        for v in range(len(versions) + 1):
            held: list = []
            keep = lambda t, held=held: held.append({n: x.clone() for n, x in t})  # noqa: E731
            fail = lambda t: pytest.fail("full tensors where a shard was due")  # noqa: E731
            report = rx.sync(spec, load=keep if v == len(versions) else fail, load_shard=keep)
            got[g].append((report, held[0] if held else None))

    threads = [threading.Thread(target=worker, args=(g,), daemon=True) for g in got]
    for t in threads:
        t.start()
    opened.join(60.0)
    stats = []
    for v, (tensors, mode) in enumerate(zip(versions, ["full", "sparse_delta", "changed_buckets"])):
        tx.snapshot(v, list(tensors.items()), transient=False)
        base = v - 1 if v else NO_VERSION
        stats.append(tx.send("g", v, base, mode, shards=TP, with_digests=True))
    # not resharded: the workers hold shards, so a delta cannot apply and full tensors go
    last = tx.send("g", 2, 2, "sparse_delta")
    for t in threads:
        t.join(60.0)
    tx.close_all()

    plan = plan_for(config, [(n, tuple(t.shape)) for n, t in v0.items()], TP)
    model_bytes = sum(t.numel() * t.element_size() for t in v0.values())
    for g, syncs in got.items():
        rank = (g - 1) % TP
        report, held = syncs.pop()
        assert report.ok and held.keys() == v2.keys(), report.error
        assert all(torch.equal(held[n], v2[n]) for n in v2)
        for v, (report, held) in enumerate(syncs):
            assert report.ok, report.error
            want = dict(plan.shard(rank, versions[v]))
            assert held.keys() == want.keys()
            assert all(torch.equal(held[n], want[n]) for n in want), (g, v)
            assert report.digests is None  # the sender's shard digests are what verify uses
    assert [s.mode for s in stats] == ["full", "sparse_delta", "changed_buckets"]
    assert last.mode == "full" and last.bytes_per_rank > model_bytes
    full, sparse, changed = stats
    assert model_bytes * 0.4 < full.bytes_per_rank < model_bytes * 0.6  # half, plus the header
    assert full.bytes_sent > 2 * full.bytes_per_rank  # four workers, each its own shard
    assert sparse.bytes_per_rank < full.bytes_per_rank / 10 and sparse.buckets_sparse > 0
    assert changed.buckets_skipped > 0 and changed.bytes_per_rank < full.bytes_per_rank
    assert len(full.shard_digests) == TP and full.shard_digests[0] != full.shard_digests[1]
    assert full.metrics()["broker/bytes_per_engine_rank"] == full.bytes_per_rank


# ----------------------------------------------------------------- refusals before Ray
def test_resharding_what_the_plan_cannot_serve_is_refused_before_ray(tmp_path, capsys, monkeypatch):
    """``broker.reshard`` (on by default) with a TP engine: a model family the plan does
    not know, LoRA adapters, or an engine that splits whole experts over its ranks
    (vLLM's expert parallelism), stop the run with one line naming the way out."""
    import shutil

    from helpers import refused_before_ray
    from hydra import compose, initialize_config_dir

    def cfg(*overrides: str):
        with initialize_config_dir(config_dir=str(TINY.parents[3] / "conf"), version_base=None):
            return compose(config_name="config", overrides=[*overrides, "progress=false"])

    moe = tmp_path / "moe"
    shutil.copytree(TINY.parent, moe)
    config = json.loads(TINY.read_text())
    (moe / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_moe"}))
    tp2 = "actor.engine.tensor_parallel_size=2"
    line = refused_before_ray(cfg(tp2, f"model.path={moe}"), tmp_path, capsys, monkeypatch)
    assert line.startswith(
        f"asyncrl: config error: broker.reshard=true with {tp2}: model_type 'qwen2_moe'"
    ), line
    assert line.endswith("set broker.reshard=false (every worker then gets the full tensors)")
    line = refused_before_ray(cfg(tp2, "learner.lora.rank=4"), tmp_path, capsys, monkeypatch)
    assert f"broker.reshard=true with {tp2}: learner.lora sends adapters" in line, line
    ep = "+actor.engine.extra.enable_expert_parallel=true"
    line = refused_before_ray(cfg(tp2, ep), tmp_path, capsys, monkeypatch)
    assert line == (
        f"asyncrl: config error: broker.reshard=true with {tp2} and actor.engine.extra."
        "enable_expert_parallel=true: the engine splits whole experts over its ranks, the "
        "plan cuts each expert's width; set broker.reshard=false (every worker then gets "
        "the full tensors)"
    ), line
    wide = tmp_path / "wide_moe"  # the tiny model's files with tiny_moe's expert layout
    shutil.copytree(TINY.parent, wide)
    (wide / "config.json").write_text(json.dumps({**config, **MOE}))
    tp4 = "actor.engine.tensor_parallel_size=4"
    line = refused_before_ray(cfg(tp4, f"model.path={wide}"), tmp_path, capsys, monkeypatch)
    assert f"broker.reshard=true with {tp4}: vLLM-CPU pads each rank's expert width" in line
    assert line.endswith("set broker.reshard=false (every worker then gets the full tensors)")
