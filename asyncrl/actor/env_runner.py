"""Multi-turn episodes: one env per episode, one trajectory per episode, built from the
engine's own token ids turn by turn.

    run_group(prompt): n episodes at once (asyncio.gather), each one:
      env.reset(sample) ─▶ None, or an opening observation appended to the prompt
      turn: engine.generate(ids so far, n=1) ─▶ generated ids, log-probs, versions
              (mask 1; the engine's ids, never the text tokenized again)
            await env.step(text, ids) ─▶ observation ─▶ tokenized once (mask 0)
              (its images' placeholders expanded: asyncrl/actor/image_tokens.py)
      until done / env.max_turns / the token budget / env.timeout_s
    then the group's episodes are scored by the reward components (asyncrl/rewards/pool.py,
    awaited: env_reward = the steps' summed reward, response = the generated turns only)
    what waits: the engine's requests and the env's steps (both awaited: every episode
    of every group shares the actor's event loop); nothing else.

A message-level env (asyncrl/envs/messages.py ChatEnv) runs through the same loop,
wrapped in :class:`asyncrl.envs.chat_turns.ChatTurns`: its opening is the whole prompt,
rendered by the chat template and sent as token ids; its messages after a turn are the
rendered segment appended as the observation. Their image parts are the opening's and
the observations' images below, one placeholder each in the rendered text.

Every turn's request carries its own sampling seed, from the run's seed, the group's
place in the actor's start order, the sample and the turn (``turn_sampling``): the same
episode with the same seed samples the same tokens, whatever else is in flight.

Images: the prompt's (``Prompt.meta["images"]``) and those an observation shows
(``StepResult.images``, one ``<image>`` placeholder each in its text) go to the engine
with every later request, all of the episode's so far in placeholder order; the request
holds one placeholder token per image (the engine expands it), the trajectory the
expanded tokens (mask 0) and ``Trajectory.images`` every image in order.

Observation tokens carry behaviour log-prob 0 and the version of the generated token
before them, so a consumer that forgot the mask still sees no older version; staleness
reads ``Trajectory.min_version`` (generated tokens only). Turn k's request is the whole
sequence so far: with ``actor.engine.enable_prefix_caching`` the engine reuses the KV
of earlier turns (``perf/prefix_cache_hit_rate``: cached / prompt tokens over turns).
Each request is salted with the version the engine's weights carry when it is made
(``version_salt``): a turn after a weight update reads no KV of an older version, and
recomputes its prefix under the new weights.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from asyncrl.actor.agent_runner import AgentEpisodes
from asyncrl.actor.episode import (
    EpisodeAborted,
    EpisodeRunner,
    SingleTurnEpisodes,
    reward_input,
    turn_sampling,
)
from asyncrl.actor.image_tokens import ImageTokens, tokenizer_path
from asyncrl.actor.settings import ActorSettings
from asyncrl.config import locate_target
from asyncrl.engine.protocol import Completion, Engine, Sampling, policy_sampling, version_salt
from asyncrl.envs.base import Rendered, StepResult
from asyncrl.envs.chat_turns import ChatRenderer, ChatTurns
from asyncrl.envs.messages import ChatEnv
from asyncrl.envs.settings import EnvSettings
from asyncrl.rewards.pool import RewardClient
from asyncrl.tasks.base import Prompt, Task
from asyncrl.trajectory import Image, Trajectory, TrajectoryGroup


@dataclass
class _Episode:
    """One episode's growing sequence (per-token lists in response order)."""

    prompt_ids: list[int]
    opening: str = ""  # what env.reset returned: the prompt's text ends with it
    prompt_text: str = ""  # a Rendered opening's text (the whole prompt); "": the task's
    group: int = 0  # the group's place in the actor's start order (the sampling seed's)
    sample: int = 0  # the episode's place in its group
    ids: list[int] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    generated: list[str] = field(default_factory=list)  # the policy's turns (what rewards read)
    reward: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    tool_calls: int = 0
    turn_prompt_tokens: int = 0
    cached_tokens: int = 0
    env_seconds: float = 0.0  # awaiting env.step (a tool's answer, a grading)
    finish: str = ""
    error: str = ""
    # the last turn's routed experts (actor.record_experts): its request was the whole
    # sequence so far, so they cover every position it read
    routes: np.ndarray | None = None
    # the prompt's images, then the observations', in placeholder order (prompt's: the
    # group's shared Image objects)
    images: list[Image] = field(default_factory=list)
    # with images: the sequence so far as a request holds it (one placeholder token per
    # image, asyncrl/actor/image_tokens.py); None: the trajectory's ids themselves
    compact: list[int] | None = None
    # each turn's StepResult.frame (None where its step gave none)
    frames: list[Image | None] = field(default_factory=list)

    def add(
        self, ids: np.ndarray, lps: np.ndarray, vers: np.ndarray, trained: bool,
        compact: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Append tokens; ``compact``: their request form where it differs (images)."""
        if self.compact is not None:
            self.compact += ids.tolist() if compact is None else compact
        self.ids += ids.tolist()
        self.logprobs.append(lps)
        self.versions.append(vers)
        self.mask.append(np.full(len(ids), trained, dtype=bool))

    def last_version(self, fallback: int) -> int:
        return int(self.versions[-1][-1]) if self.ids else fallback


class MultiTurnEpisodes:
    """An :class:`asyncrl.actor.episode.EpisodeRunner` over an env (asyncrl/envs/base.py):
    the n samples of a prompt are n concurrent episodes, one group."""

    def __init__(
        self,
        engine: Engine,
        task: Task,
        settings: ActorSettings,
        env: EnvSettings,
        version: Callable[[], int],
        rewards: RewardClient | None = None,  # None: the env's reward, in-process
        sampling: Sampling | None = None,  # a group's: n episodes, each turn's request;
        #   None: actor.sampling's (the held-out evaluation's greedy or pass@k groups)
    ):
        self.engine = engine
        self.task = task
        self.env = env
        self.rewards = rewards or RewardClient()
        env.prepare()  # the sandbox pool, if the env grades programs
        sampling = sampling or policy_sampling(settings.sampling)
        self.n = sampling.n
        self.max_model_len = settings.engine.max_model_len
        self.turn_tokens = sampling.max_tokens
        self.version = version
        # n=1: each episode diverges after its first turn
        self.sampling = replace(sampling, n=1)
        self._groups = 0  # groups started so far: the sampling seeds count them
        self._tokenizer = None
        self._renderer: ChatRenderer | None = None
        self._image_tokens: ImageTokens | None = None

    async def run_group(self, prompt: Prompt) -> TrajectoryGroup:
        index = self._groups  # before any await: the start order decides the seeds
        self._groups += 1
        gid = f"{index:08x}{uuid.uuid4().hex[:16]}"  # as SingleTurnEpisodes' group ids
        pngs = prompt.meta.get("images")  # one Image each, shared by the group's episodes
        images = [Image.of(png) for png in pngs] if pngs else []
        try:  # a TaskGroup: an aborted episode cancels its siblings (the group reruns)
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._episode(prompt, gid, index, i, images))
                    for i in range(self.n)
                ]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        trajs = [t.result()[0] for t in tasks]
        inputs = [
            reward_input(self.task, prompt, "".join(ep.generated), t.response_ids[t.loss_mask],
                         ep.breakdown, ep.reward)
            for t, (_, ep) in zip(trajs, (t.result() for t in tasks))
        ]  # fmt: skip
        await self.rewards.apply(trajs, inputs)
        return TrajectoryGroup(gid, trajs)

    async def _episode(
        self, prompt: Prompt, gid: str, index: int, i: int, images: list[Image]
    ) -> tuple[Trajectory, _Episode]:
        t_start = time.time()
        env = self.env.make()
        ep = _Episode(prompt_ids=[], group=index, sample=i, images=list(images))
        try:
            if isinstance(env, ChatEnv):  # speaks messages: rendered turn by turn
                env = ChatTurns(env, self.renderer(env))
            await asyncio.wait_for(self._turns(env, prompt, ep, f"{gid}-{i}"), self.env.timeout_s)
        except TimeoutError:
            ep.finish = "timeout"
        except EpisodeAborted:
            raise
        except Exception as e:  # noqa: BLE001 - an env's failure is a recorded outcome
            ep.finish, ep.error, ep.reward = "env_error", f"{type(e).__name__}: {e}", 0.0
        finally:
            await close_env(env)
        if not ep.prompt_ids and not ep.images:  # ended before its first request (a
            # timeout waiting for the env): the prompt's ids, so the learner has a prompt
            text = prompt.text + ep.opening
            ep.prompt_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._trajectory(ep, prompt, gid, i, t_start), ep

    async def _turns(self, env: Any, prompt: Prompt, ep: _Episode, rid: str) -> None:
        opening = await env.reset(prompt, self.task)
        if isinstance(opening, Rendered):  # a message env's chat: the prompt itself
            self._open(ep, opening)
        else:
            ep.opening = opening if isinstance(opening, str) else ""
        ep.finish = "max_turns"
        for turn in range(self.env.max_turns):
            room = self._room(ep)
            if room < 1:
                ep.finish = "token_budget"
                return
            comp = await self._generate(prompt, ep, min(self.turn_tokens, room), f"{rid}-{turn}")
            ids = comp.token_ids
            ep.add(ids, comp.logprobs, comp.versions, trained=True)
            ep.routes = comp.routed_experts
            ep.turns += 1
            text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            ep.texts.append(text)
            ep.generated.append(text)
            t_env = time.perf_counter()
            step: StepResult = await env.step(text, ids.tolist())
            ep.env_seconds += time.perf_counter() - t_env
            ep.reward += float(step.reward)
            ep.tool_calls += int(step.tool_calls)
            ep.breakdown = {k: float(v) for k, v in step.info.items()}
            ep.frames.append(Image.of(step.frame) if step.frame else None)
            if step.done:
                ep.finish = "done"
                return
            if step.observation or step.images:
                if not self._observe(ep, step.observation or "", step.images):
                    ep.finish = "token_budget"
                    return
                ep.texts.append(step.observation or "")

    def _open(self, ep: _Episode, opening: Rendered) -> None:
        """A rendered opening as the episode's prompt: its images (the whole prompt's:
        the task's are the env's to show) expanded as an observation's, the compact ids
        the first request. Nothing is set if that fails (a model without images): the
        episode's error then leaves a text prompt."""
        images = [Image.of(png) for png in opening.images]
        ids = self.image_tokens.expand(opening.ids, images) if images else list(opening.ids)
        ep.prompt_text, ep.images, ep.prompt_ids = opening.text, images, ids
        ep.compact = list(opening.ids) if images else None

    def _room(self, ep: _Episode) -> int:
        """Tokens the next turn may generate: the episode's budget and the model's length."""
        # before the first turn the prompt's length is the engine's to know: vLLM stops a
        # request at max_model_len itself
        left = self.max_model_len - len(ep.prompt_ids) - len(ep.ids)
        if self.env.max_tokens is not None:
            left = min(left, self.env.max_tokens - len(ep.ids))
        return left

    def _observe(self, ep: _Episode, text: str, pngs: list[bytes]) -> bool:
        """Append the observation's tokens (mask 0), each image's placeholder expanded into
        the image's tokens; False if they leave no room for a turn."""
        compact = list(self.tokenizer.encode(text, add_special_tokens=False))
        new = [Image.of(png) for png in pngs]
        ids = self.image_tokens.expand(compact, new) if new else compact
        if len(ids) >= self._room(ep):
            return False
        if new and ep.compact is None:  # the episode's first images: the forms part here
            ep.compact = ep.prompt_ids + ep.ids
        ep.images += new
        ids = np.asarray(ids, dtype=np.int32)
        version = ep.last_version(self.version())
        lps, vers = np.zeros(len(ids), np.float32), np.full(len(ids), version, np.int32)
        ep.add(ids, lps, vers, False, compact if new else None)
        return True

    async def _generate(
        self, prompt: Prompt, ep: _Episode, max_tokens: int, rid: str
    ) -> Completion:
        """One turn: the whole sequence so far as the request's prompt (token ids after the
        first turn, whose prompt the engine tokenizes from text), salted with the version
        the engine's weights carry now (``version_salt``): each turn reuses cached KV of
        that version only."""
        sampling = turn_sampling(self.engine, self.sampling, ep.group, ep.sample, ep.turns)
        sampling = replace(sampling, max_tokens=max_tokens)
        first = not ep.prompt_ids
        if first:
            request = prompt.text + ep.opening
        elif ep.compact is not None:  # the engine expands the images' placeholders
            self.image_tokens.check_request(ep.compact, ep.images)
            request = list(ep.compact)
        else:
            request = ep.prompt_ids + ep.ids
        kw = {"images": [im.png for im in ep.images]} if ep.images else {}
        salt = version_salt(self.version())
        out = await self.engine.generate(request, sampling, rid, salt, **kw)
        if not out.completions or out.completions[0].finish_reason == "abort":
            raise EpisodeAborted(f"episode {rid}: a weight update aborted its request")
        if first:
            ep.prompt_ids = list(out.prompt_ids)
            if ep.images:  # the prompt's images: the request form folds them back
                ep.compact = self.image_tokens.collapse(ep.prompt_ids, ep.images)
        elif ep.compact is not None and list(out.prompt_ids) != ep.prompt_ids + ep.ids:
            raise ValueError(
                "the engine expanded the episode's images into other tokens than the "
                "trajectory holds (the model's processor and the engine disagree)"
            )
        ep.turn_prompt_tokens += len(out.prompt_ids)
        ep.cached_tokens += out.cached_tokens
        return out.completions[0]

    def _trajectory(
        self, ep: _Episode, prompt: Prompt, gid: str, i: int, t_start: float
    ) -> Trajectory:
        def cat(xs: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)

        return Trajectory(
            traj_id=f"{gid}-{i}",
            group_id=gid,
            prompt_ids=np.asarray(ep.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(ep.ids, dtype=np.int32),
            behaviour_logprobs=cat(ep.logprobs, np.float32),
            versions=cat(ep.versions, np.int32),
            loss_mask=cat(ep.mask, bool),
            reward=ep.reward,
            reward_breakdown=ep.breakdown,
            finish_reason=ep.finish,
            error=ep.error,
            prompt_text=ep.prompt_text or prompt.text + ep.opening,
            response_text="".join(ep.texts),
            t_start=t_start,
            t_end=time.time(),
            routed_experts=ep.routes,
            images=ep.images,
            frames=ep.frames if any(ep.frames) else [],
            episode={
                "turns": float(ep.turns),
                "tool_calls": float(ep.tool_calls),
                "turn_prompt_tokens": float(ep.turn_prompt_tokens),
                "cached_tokens": float(ep.cached_tokens),
                "env_seconds": ep.env_seconds,
            },
        )

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self.engine.get_tokenizer()
        return self._tokenizer

    @property
    def image_tokens(self) -> ImageTokens:
        """The model's processor, for the episodes' images (loaded on the first image)."""
        if self._image_tokens is None:
            self._image_tokens = ImageTokens(tokenizer_path(self.tokenizer))
        return self._image_tokens

    def renderer(self, env: ChatEnv) -> ChatRenderer:
        """The chat renderer of a message env (one per runner: every episode's env has
        the same options); for an env that ``shows_images``, with the model's image
        placeholder (a model whose processor takes no images: ValueError)."""
        if self._renderer is None:
            name = str(getattr(self.tokenizer, "name_or_path", "") or "the model")
            placeholder = self.image_tokens.placeholder if env.shows_images else None
            self._renderer = ChatRenderer(self.tokenizer, env.chat, name, placeholder)
        return self._renderer


async def close_env(env: Any) -> None:
    """Await the env's optional ``close()`` (the episode is over, however it ended: its
    sessions and leases go back); a failing close is the env's own, never the episode's."""
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        out = close()
        if asyncio.iscoroutine(out):
            await out
    except Exception:  # noqa: BLE001 - the episode's outcome is already recorded
        pass


def make_runner(
    engine: Engine,
    task: Task,
    settings: ActorSettings,
    env: EnvSettings | None,
    version: Callable[[], int],
    rewards: RewardClient | None = None,
) -> EpisodeRunner:
    """The actor's episode runner: today's single-turn one for ``env=single_turn`` (one
    request for the whole group), the agent one for an agent program (``env=agent``),
    the multi-turn one for any other env. ``rewards``:
    what scores the finished groups (None: the env's reward, in-process)."""
    if env is None or env.single_turn:
        return SingleTurnEpisodes(engine, task, settings.sampling, version, rewards)
    if env.agent:
        return AgentEpisodes(engine, task, settings, env, version, rewards)
    cls = locate_target("env", env.target)
    if own_loop(cls):
        return own_loop_runner(cls(**env.kwargs), engine, task, settings, env, version)
    return MultiTurnEpisodes(engine, task, settings, env, version, rewards)


def own_loop(cls: type) -> bool:
    """Whether an env class drives its own turn loop (an ``episodes`` method)."""
    return callable(getattr(cls, "episodes", None))


def runs_turns(env: EnvSettings | None) -> bool:
    """Whether :func:`make_runner` runs ``env``'s episodes with :class:`MultiTurnEpisodes`
    (a text or message env; not the single-turn env, an agent program or an env with its
    own turn loop)."""
    if env is None or env.single_turn or env.agent:
        return False
    return not own_loop(locate_target("env", env.target))


def own_loop_runner(
    env_obj: Any,
    engine: Engine,
    task: Task,
    settings: ActorSettings,
    env: EnvSettings,
    version: Callable[[], int],
) -> EpisodeRunner:
    """The runner of an env that runs its own turns (``env=verifiers``): it gets the
    episode limits, each turn's seeded sampling and the abort signal, and scores with
    its own rubric."""
    from asyncrl.envs.verifiers_env import Limits

    sampling = replace(policy_sampling(settings.sampling), n=1)

    def turn(group: int, sample: int, k: int) -> Sampling:
        return turn_sampling(engine, sampling, group, sample, k)

    limits = Limits(env.max_tokens, settings.engine.max_model_len, settings.sampling.max_tokens)
    return env_obj.episodes(engine, task, settings.sampling.n, limits, env.timeout_s, turn,
                            version, EpisodeAborted)  # fmt: skip
