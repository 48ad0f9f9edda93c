"""`MicroBatcher`: the engines' `generate_one`, concurrent single calls served by batched `generate`."""

from __future__ import annotations

import asyncio
from dataclasses import astuple, replace

from verl.workers.rollout.engine import Generation, SamplingConfig


class MicroBatcher:
    """Serves concurrent `generate_one` calls with batched `generate` calls.

    Callers that arrive while the engine is busy, or within `window_s` of each other, share the next
    batch. `generate` runs in a worker thread so the event loop (retrieval requests of the other
    trajectories) keeps going meanwhile; one drain task at a time keeps the engine single-threaded.
    """

    def __init__(self, generate, window_s: float = 0.005):
        self._generate = generate
        self.window_s = window_s
        self._pending: list[tuple[list[int], SamplingConfig, tuple[str, ...], asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, prompt_ids: list[int], sampling: SamplingConfig, stop: list[str]) -> Generation:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new asyncio.run(): forget calls left over from the last loop
            self._loop, self._pending, self._drainer = loop, [], None
        future = loop.create_future()
        self._pending.append((prompt_ids, sampling, tuple(stop), future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.window_s)
            batch, self._pending = self._pending, []
            # Only calls with equal sampling settings and stop strings can share a batch.
            groups: dict[tuple, list] = {}
            for item in batch:
                groups.setdefault((_sampling_key(item[1]), item[2]), []).append(item)
            for items in groups.values():
                prompts = [prompt for prompt, *_ in items]
                sampling, stop = items[0][1], list(items[0][2])
                try:
                    generations = await asyncio.to_thread(self._generate, prompts, sampling, stop)
                except Exception as error:  # every waiting caller sees the failure
                    for *_, future in items:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for (*_, future), generation in zip(items, generations):
                    if not future.done():  # the caller may have been cancelled meanwhile
                        future.set_result(generation)


def _sampling_key(sampling: SamplingConfig) -> tuple:
    """A hashable key of the settings: equal keys can share one batched call."""
    bias = tuple(sorted(sampling.logit_bias.items())) if sampling.logit_bias else None
    return astuple(replace(sampling, logit_bias=None)) + (bias,)
