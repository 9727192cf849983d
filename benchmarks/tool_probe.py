"""Does a model write well-formed tool calls, and right answers, in ``env=calculator_chat``
before any training? Greedy and sampled episodes on held-out prompts under a few system
prompts (``env.system``): the signal an RL run would start from.

    per variant:  env.system = the variant's text (the tool schema described after it
                  by env.tool_format, as a run renders it)
                  ─▶ each prompt: 1 greedy episode and a group of --samples at
                     --temperature, through the actor's runner (MultiTurnEpisodes:
                     the env code, chat rendering and tool parsing a run uses)
                  ─▶ well-formed share (episodes with >= 1 call the env served),
                     correct share (reward 1), groups whose rewards differ (what a
                     group-relative advantage can learn from)

The prompts are the held-out split ``benchmarks/learn.py`` evaluates (its heldout_frac,
set seed 1). The last stdout line is one JSON object: ``by_variant``, ``model``, the host.

    python -m benchmarks.tool_probe                          # SmolLM2, bf16, 48 prompts
    python -m benchmarks.tool_probe --variants example --prompts 16
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import asyncio  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import yaml  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from benchmarks.common import compose, emit_json, host, parser, print_table, probe_args  # noqa: E402

HERMES_CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>'
INSTRUCT = (
    "You are a calculator assistant. For every multiplication, first call the calc tool, "
    "then reply with its result as a number only."
)
CALC_SYSTEM = (
    "You are a calculator assistant. To multiply, write the product in calc tags, like "
    "<calc>12*34</calc>, and nothing else. The result comes back; then reply with that "
    "number only."
)
EXAMPLE = "\n\nExample:\nuser: 12*34=\nassistant: {call}\ntool: 408\nassistant: 408"
# each variant's env keys: env.system (a system message before the prompt, the tool schema
# described after it by env.tool_format: hermes describes it, calc does not), env.examples
# (worked examples as chat turns before the prompt)
EXAMPLES = '["12*34", "56*78"]'  # env.examples: two worked examples before the prompt
VARIANTS: dict[str, dict[str, str]] = {
    "schema": {"env.tool_format": "hermes", "env.system": ""},
    "hermes_example": {"env.tool_format": "hermes",
                       "env.system": INSTRUCT + EXAMPLE.format(call=HERMES_CALL)},
    "hermes_fewshot": {"env.tool_format": "hermes", "env.system": INSTRUCT,
                       "env.examples": EXAMPLES},
    "hermes_one": {"env.tool_format": "hermes", "env.system": INSTRUCT,
                   "env.examples": '["12*34"]'},
    "calc_example": {"env.tool_format": "calc",
                     "env.system": CALC_SYSTEM + EXAMPLE.format(call="<calc>12*34</calc>")},
    "calc_fewshot": {"env.tool_format": "calc", "env.system": CALC_SYSTEM,
                     "env.examples": EXAMPLES},
}  # fmt: skip

HELDOUT_FRAC = 0.3  # benchmarks/learn.py's split, so the probe's prompts are its held-out ones
SET_SEED = 1  # its first set
# what the probe's episodes need beyond the preset: a hermes call is ~30 tokens, and the
# system text with the schema ~150
OVERRIDES = [
    "env=calculator_chat",
    "env.chat_template=null",
    "~task.chat",  # model=smollm2's addition keys: the calculator task takes neither
    "~task.system",
    "env.max_tokens=160",
    "env.timeout_s=3600",  # every episode at once on 2 shared cores: none cut short
    "actor.engine.max_model_len=512",
    "actor.engine.kv_cache_memory_mb=512",
]


def hydra_value(value: str) -> str:
    """A variant's value as a Hydra override's: a list as it is, text quoted."""
    return value if value.startswith("[") else "'" + value.replace("'", "\\'") + "'"


def setup(args: Any, keys: dict[str, str]):
    """The task, model path, actor and env settings, and prompts of one variant."""
    from asyncrl.actor.settings import ActorSettings
    from asyncrl.envs.settings import EnvSettings
    from asyncrl.eval.split import heldout_prompts
    from asyncrl.models.resolve import resolve_model
    from asyncrl.wiring import build_task

    cfg = compose(f"model={args.model}", *OVERRIDES, f"actor.engine.dtype={args.dtype}",
                  *args.overrides)  # fmt: skip
    for key, value in keys.items():
        OmegaConf.update(cfg, key, yaml.safe_load(value) if key == "env.examples" else value)
    task = build_task(cfg)
    path = resolve_model(cfg, task)
    actor = ActorSettings.from_config(cfg.actor)
    env = EnvSettings.from_config(cfg.env, cfg.get("sandbox"), task)
    env.check_template(str(path))
    return task, str(path), actor, env, heldout_prompts(task, HELDOUT_FRAC, SET_SEED, args.prompts)


async def probe(engine: Any, task: Any, actor: Any, env: Any, prompts: list, args: Any):
    from asyncrl.actor.env_runner import MultiTurnEpisodes
    from asyncrl.engine.protocol import Sampling

    def runner(n: int, temperature: float) -> MultiTurnEpisodes:
        s = Sampling(n, temperature, args.max_tokens)
        return MultiTurnEpisodes(engine, task, actor, env, lambda: 0, sampling=s)

    greedy, sampled = runner(1, 0.0), runner(args.samples, args.temperature)
    t0 = time.time()
    groups = await asyncio.gather(*[greedy.run_group(p) for p in prompts],
                                  *[sampled.run_group(p) for p in prompts])  # fmt: skip
    n = len(prompts)
    ones = [g.trajectories[0] for g in groups[:n]]
    many = [t for g in groups[n:] for t in g.trajectories]

    def called(ts: list) -> float:
        return sum(t.episode.get("tool_calls", 0.0) > 0 for t in ts) / max(len(ts), 1)

    def correct(ts: list) -> float:
        return sum(t.reward >= 1.0 for t in ts) / max(len(ts), 1)

    rewards = [[t.reward for t in g.trajectories] for g in groups[n:]]
    return {
        "prompts": n,
        "greedy_well_formed": called(ones),
        "greedy_correct": correct(ones),
        "sampled_well_formed": called(many),
        "sampled_correct": correct(many),
        "sampled_reward_mean": statistics.fmean(t.reward for t in many) if many else 0.0,
        "groups_any_correct": sum(max(r) >= 1.0 for r in rewards) / max(n, 1),
        "groups_with_signal": sum(max(r) > min(r) for r in rewards) / max(n, 1),
        "finish": {
            f: sum(t.finish_reason == f for t in many)
            for f in sorted({t.finish_reason for t in many})
        },
        "greedy_examples": [t.response_text[:200] for t in ones[:3]],
        "seconds": time.time() - t0,
    }


async def run(args: Any) -> dict[str, dict[str, Any]]:
    from asyncrl.engine.backend import make_engine

    engine = None
    out = {}
    try:
        for name in args.variants:
            task, path, actor, env, prompts = setup(args, VARIANTS[name])
            if engine is None:  # one engine: the variants differ in text only
                engine = make_engine(path, actor.engine, args.seed)
                await engine.label(0)
            out[name] = await probe(engine, task, actor, env, prompts, args)
            print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
        return out
    finally:
        if engine is not None:
            engine.shutdown()


def main() -> None:
    p = parser("tool_probe", __doc__)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    args = probe_args(p, 48, "episode")
    t0 = time.time()
    rows = asyncio.run(run(args))
    print_table(
        f"{args.model} in env=calculator_chat: {args.prompts} held-out prompts, greedy and "
        f"{args.samples} samples at T {args.temperature}",
        ["variant", "greedy well-formed", "greedy correct", "sampled well-formed",
         "sampled correct", "groups any correct", "groups with signal", "s"],
        [[k, r["greedy_well_formed"], r["greedy_correct"], r["sampled_well_formed"],
          r["sampled_correct"], r["groups_any_correct"], r["groups_with_signal"],
          r["seconds"]] for k, r in rows.items()],
    )  # fmt: skip
    emit_json({"by_variant": rows, "variants": {k: VARIANTS[k] for k in rows},
               "model": args.model, "dtype": args.dtype, "seconds": time.time() - t0,
               "host": host()})  # fmt: skip


if __name__ == "__main__":
    main()
