"""``env=browser`` with ``task=browser``: the policy operates a real headless Chromium.

    prompt   Click the button "Delta".          (the task's instruction)
             [1] button "Alpha"                 (the start page's tree, tree.py)
             [2] button "Delta"
    turn 1   click(2)<eos>                      (generated, trained; actions.py)
    (the page posts its form to the task server: final submission, graded: reward 1)

An action that leaves the episode going gets the page's new tree as its observation
(never trained); a malformed or failed action gets ``error: ...`` and the page stays.
The reward (1 or 0, at the step whose submission is final) reads only what the task
server received (sites.grade), never the policy's text. A hung page, a crashed browser
or an episode over ``episode_timeout_s`` raises :class:`BrowserError`: the runner scores
the episode ``env_error`` and the pool relaunches what it killed.
"""

from __future__ import annotations

import importlib.util
import random
import string
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.envs.base import StepResult
from asyncrl.envs.browser.actions import Action, parse_action
from asyncrl.envs.browser.pool import (
    BrowserError,
    BrowserPool,
    PoolSettings,
    Session,
    find_chromium,
    shared_pool,
)
from asyncrl.envs.browser.sites import KINDS, demonstrations, grade, make_site, observation
from asyncrl.envs.browser.tree import WALK_JS, render
from asyncrl.tasks.base import Prompt, Task

READ_RETRIES = 3  # reading the tree while a navigation replaces the document: retried


class BrowserTask:
    """Web tasks drawn uniformly from ``kinds`` (keys of sites.KINDS; None: all). The
    prompt is the instruction and the start page's tree; ``meta["site"]`` is the site,
    ``meta["task"]`` its kind (the per-task reward breakdown's key)."""

    def __init__(self, kinds: Sequence[str] | None = None):
        self.kinds = list(KINDS) if kinds is None else [str(k) for k in kinds]
        if not self.kinds:
            raise ValueError("task.kinds: expected at least one kind")
        for k in self.kinds:
            if k not in KINDS:
                raise ValueError(
                    f"task.kinds: unknown kind {k!r}; expected some of {sorted(KINDS)}"
                )

    @property
    def alphabet(self) -> str:
        return string.printable

    def sample(self, rng: random.Random) -> Prompt:
        site = make_site(rng.choice(self.kinds), rng)
        text = f"{site['instruction']}\n{observation(site, site['start'])}\n"
        answer = "\n".join(site["solution"])
        return Prompt(text=text, answer=answer, meta={"task": site["kind"], "site": site})

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        raise RuntimeError(
            "task=browser is graded from the page's state by env=browser, not from text: "
            "run it with env=browser"
        )

    def demonstration(self, prompt: Prompt, rng: random.Random) -> list[tuple[str, bool]]:
        """(text, trained) segments after the prompt for the tiny model's warm start:
        each scripted action (trained) and the tree after it (not trained)."""
        pairs = demonstrations(prompt.meta["site"])
        out: list[tuple[str, bool]] = []
        for i, (_, action) in enumerate(pairs):
            out.append((action, True))
            if i + 1 < len(pairs):
                out.append((f"\n{pairs[i + 1][0]}\n", False))
        return out


class BrowserEnv:
    """One episode in a fresh browser context of this process's pool (pool.py) for these
    settings. ``screenshots``: keep a PNG of the page after each action in
    :attr:`screenshots` (and write it under ``screenshot_dir`` when set), and return it
    as the step's ``StepResult.frame`` (the trajectory log and the report show it)."""

    def __init__(
        self,
        browsers: int = 1,
        contexts_per_browser: int = 4,
        action_timeout_s: float = 10.0,
        episode_timeout_s: float = 120.0,
        executable: str = "",
        screenshots: bool = False,
        screenshot_dir: str = "",
    ):
        self.settings = PoolSettings(
            browsers, contexts_per_browser, action_timeout_s, episode_timeout_s, executable
        )
        find_chromium(executable)  # a missing browser names env.executable at start-up
        if importlib.util.find_spec("playwright") is None:
            raise ValueError(
                "env._target_=asyncrl.envs.browser.BrowserEnv needs Playwright: "
                "pip install 'asyncrl[browser]' (scripts/setup.sh does)"
            )
        self.screenshots_on = bool(screenshots)
        self.screenshot_dir = screenshot_dir
        self.screenshots: list[bytes] = []
        self.pool: BrowserPool | None = None
        self.session: Session | None = None
        self.sample: Prompt | None = None
        self.actions = 0
        self.errors = 0

    async def reset(self, sample: Prompt, task: Task) -> None:
        site = sample.meta.get("site")
        if not isinstance(site, dict):
            raise ValueError("env=browser: the prompt has no meta['site'] (use task=browser)")
        self.sample, self.actions, self.errors = sample, 0, 0
        self.pool = shared_pool(self.settings)
        self.session = await self.pool.open(site)
        weakref.finalize(self, self.pool.release, self.session)

    @property
    def refused(self) -> list[str]:
        """URLs this episode's page tried and the pool's routing refused."""
        return list(self.session.refused) if self.session else []

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        action = parse_action(text)
        self.actions += 1
        if isinstance(action, str):
            self.errors += 1
            return StepResult(observation=f"\nerror: {action}\n", info=self._info(0.0))
        error, recs, png = await self.pool.run(self._act(action))
        self._keep(png)
        final = self.pool.server.final(self.session.token)
        if final is not None:
            reward = grade(self.session.site, final)
            await self.pool.close_session(self.session)
            return StepResult(reward=reward, done=True, info=self._info(reward), frame=png)
        if error:
            self.errors += 1
            text = f"\nerror: {error}\n"
            return StepResult(observation=text, info=self._info(0.0), frame=png)
        return StepResult(observation=f"\n{render(recs)}\n", info=self._info(0.0), frame=png)

    def _info(self, success: float) -> dict[str, float]:
        """The reward breakdown: ``task/<kind>`` is the success again under the task's
        kind (``reward/task/<kind>`` per step; summary.json ``reward_by_task``)."""
        kind = self.session.site.get("kind") if self.session else None
        return {
            "success": success,
            **({f"task/{kind}": success} if kind else {}),
            "actions": float(self.actions),
            "action_errors": float(self.errors),
            "refused": float(len(self.refused)),
        }

    def _keep(self, png: bytes | None) -> None:
        if png is None:
            return
        self.screenshots.append(png)
        if self.screenshot_dir:
            d = Path(self.screenshot_dir)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{self.session.token}-{len(self.screenshots):02d}.png").write_bytes(png)

    async def _act(self, action: Action) -> tuple[str, list[dict[str, Any]], bytes | None]:
        """On the pool's loop: run the action, then read the page (error text, tree
        records, screenshot or None)."""
        s, pool = self.session, self.pool
        error = ""
        try:
            await pool.guard(s, _perform(s.page, action))
        except BrowserError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed action is the policy's error
            error = f"{action.kind} failed: {str(e).splitlines()[0][:120]}"
        await pool.guard(s, s.page.wait_for_load_state("load"))
        if not s.page.url.startswith(pool.server.prefix(s.token)):  # a refused navigation
            error = error or "navigation refused: only the task's pages are reachable"
            await pool.guard(s, s.page.go_back(wait_until="load"))
        recs = await self._read(s)
        png = await pool.guard(s, s.page.screenshot(type="png")) if self.screenshots_on else None
        return error, recs, png

    async def _read(self, s: Session) -> list[dict[str, Any]]:
        for attempt in range(READ_RETRIES):
            await self.pool.guard(s, s.page.wait_for_load_state("load"))
            try:
                return await self.pool.guard(s, s.page.evaluate(WALK_JS))
            except BrowserError:
                raise
            except Exception:  # noqa: BLE001 - the document was replaced under us: read again
                if attempt + 1 == READ_RETRIES:
                    raise
        return []


async def _perform(page: Any, action: Action) -> None:
    if action.kind == "press":
        await page.keyboard.press(action.text)
        return
    if action.kind == "scroll":
        await page.mouse.wheel(0, action.dy)
        return
    el = page.locator(f'[data-aid="{action.target}"]')
    if await el.count() == 0:
        raise LookupError(f"no element {action.target}")
    if action.kind == "click":
        await el.click()
    elif action.kind == "type":
        await el.fill(action.text)
    else:
        await el.select_option(label=action.text)
