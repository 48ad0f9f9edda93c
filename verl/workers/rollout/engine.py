"""What a generation engine takes and returns: the contract the agent loops program against.

The loop hands over token ids and gets token ids back: the model's tokens are kept exactly as
generated (never decoded and re-tokenised), and the stop string that ended a turn ("</search>",
"</answer>") is part of the returned ids, so the observation can be appended right after it.
Stop strings are matched inside the engine, so no token is generated past the tag.

The engines: `VLLMEngine` (`vllm_engine.py`) and `HFEngine` (`hf_engine.py`), either by name through
`create_engine` (`engine_by_name.py`). Both also offer `generate_one` for an asynchronous agent
schedule (`micro_batcher.py`: calls that arrive within a few milliseconds of each other are served by
one batched `generate`). Only `VLLMEngine` can step (`continuous = True`: `submit`, `step`), which
the continuous schedule needs.

Seeding, two ways. `SamplingConfig.seed` gives every request a seed of its own (a row's, or the agent
loop's per trajectory and turn), so a request's random draws do not depend on the requests beside
it. `reseed(seed)` instead re-seeds the engine's random streams, from which the unseeded requests
draw (the trainer's `rollout.request_seeds=false`). What either costs depends on vLLM's model runner:
the first one draws each seeded request's noise separately, one small operation per request and
engine step, and all unseeded requests' noise together; the second (recent vLLM's GPU default for
dense models) draws every request's noise in one kernel from a seed per request, picking one from
NumPy's stream for a request that has none, so there the two ways cost the same. vLLM on CPU rejects a
per-request seed ("CPU Generator does not use offset"): there `SamplingConfig.seed` is ignored with
a warning, and only the construction seed and `reseed` apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class SamplingConfig:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 512     # new tokens per call
    seed: int | None = None   # a seed for each request (module docstring); ignored by vLLM on CPU
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    logprobs: bool = False    # also return each sampled token's log-prob (Generation.logprobs)


@dataclass
class Generation:
    token_ids: list[int]      # new tokens only, including the matched stop string or EOS
    finish_reason: str        # "stop" (stop string or EOS) or "length"
    stop_reason: str | None = None  # the stop string that matched; None for EOS or length
    # With SamplingConfig.logprobs: the log-prob of each token under the distribution it was sampled
    # from (after logit_bias, temperature and top-p), i.e. the behaviour policy of an off-policy step.
    # With top_p < 1 that is the nucleus, renormalised: above the full softmax's value by its mass.
    logprobs: list[float] | None = None


class Engine(Protocol):
    tokenizer: Any  # Hugging Face tokenizer of the model
    continuous: bool  # whether it also offers submit/step (VLLMEngine) for the continuous schedule

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, stop: list[str]) -> list[Generation]:
        """One Generation per prompt, in order."""
        ...
