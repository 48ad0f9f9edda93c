"""The baselines of the rollout benchmark (bench_rollout.py): the engine generating, without the
agent loop, exactly the model tokens the agent's rollout wrote.

- `plain_vllm` / `plain_hf`: one plain generate call that writes, from each trajectory's prompt,
  as many tokens as the agent wrote in it (the "plain_with_obs" baseline is the same call with the
  trajectory's observations appended to its prompt);
- `replay_vllm`: the agent's own turns replayed in order, observations appended as each turn
  ends, with no search and no parsing (vLLM only: it needs the engine's step loop).

Each returns (seconds, statistics), so that bench_rollout.py can take the median of repeats.
`cold_prefix_cache` empties vLLM's prefix cache before every run, the agent's included.
"""
from __future__ import annotations

import time

import torch
from transformers import StoppingCriteria

from rollout_stats import StepTimer


def cold_prefix_cache(engine) -> None:
    """Every run starts with an empty prefix cache: a repeat would otherwise find the prompts and
    observations of the one before it cached and skip their prefill."""
    if hasattr(engine, "llm"):  # vLLM; the HF engine keeps no cache between calls
        engine.llm.reset_prefix_cache()


def exact_length_params(sampling, n_tokens: int, k: int):
    """vLLM sampling settings of the agent's, writing exactly `n_tokens` (EOS ignored, no stop
    strings); where the agent's requests carry seeds of their own (sampling.seed), request k's too."""
    from vllm import SamplingParams

    seed = None if sampling.seed is None else (sampling.seed + k) % 2**31
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=n_tokens,
                          ignore_eos=True, logit_bias=sampling.logit_bias, seed=seed)


def plain_vllm(engine, prompts, n_tokens_B: list[int], sampling, timeline: list | None = None) -> tuple[float, dict]:
    """One `LLM.generate` call: exactly n_tokens_B[i] new tokens for prompt i. Returns seconds and
    the engine-step statistics; with `timeline`, appends its core steps."""
    from vllm.inputs import TokensPrompt

    params = [exact_length_params(sampling, n, i) for i, n in enumerate(n_tokens_B)]
    t0 = time.perf_counter()
    with StepTimer(engine) as timer:
        outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                      use_tqdm=False)
    wall_s = time.perf_counter() - t0
    if timeline is not None:
        timeline.append(timer.timeline())
    got = [len(o.outputs[0].token_ids) for o in outputs]
    if got != n_tokens_B:
        raise RuntimeError(f"plain vLLM run generated {sum(got)} tokens instead of {sum(n_tokens_B)}")
    return wall_s, {k: v for k, v in timer.stats(wall_s).items() if k != "prefix_cached_frac"}


def replay_vllm(engine, prompts, turns_B: list[list[tuple[int, list[int]]]], sampling, admit_every: int,
                timeline: list | None = None) -> tuple[float, dict]:
    """The agent's rollout without its tools: every trajectory's turns in order, turn k writing
    exactly as many tokens as the agent's turn k did (EOS ignored, no stop strings), its observation
    ids appended the moment it ends (no search to wait for, no parsing), and the turns ready to go
    on joining the running batch every `admit_every` steps, as the continuous schedule admits them.
    The engine gets the same requests, prefills and context lengths as in the agent's rollout; what
    the agent takes beyond this is the time its tool calls and its own loop cost the engine."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm_engine = engine.llm.llm_engine
    contexts_B = [list(p) for p in prompts]
    next_turn_B = [0] * len(prompts)
    ready = [i for i, turns in enumerate(turns_B) if turns]
    live: dict[str, int] = {}  # request id -> trajectory
    steps_since_admit, written = 0, 0
    t0 = time.perf_counter()
    with StepTimer(engine) as timer:
        while live or ready:
            if ready and (steps_since_admit >= admit_every or not live):
                for i in ready:
                    request_id = f"replay-{i}-{next_turn_B[i]}"
                    params = exact_length_params(sampling, turns_B[i][next_turn_B[i]][0],
                                                 1_009 * i + next_turn_B[i])
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                    llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(contexts_B[i])), params)
                    live[request_id] = i
                ready.clear()
                steps_since_admit = 0
            steps_since_admit += 1
            for output in llm_engine.step():
                if not output.finished:
                    continue
                i = live.pop(output.request_id)
                new_ids = list(output.outputs[0].token_ids)
                written += len(new_ids)
                contexts_B[i] += new_ids + turns_B[i][next_turn_B[i]][1]
                next_turn_B[i] += 1
                if next_turn_B[i] < len(turns_B[i]):
                    ready.append(i)
    wall_s = time.perf_counter() - t0
    if timeline is not None:
        timeline.append(timer.timeline())
    expected = sum(n for turns in turns_B for n, _ in turns)
    if written != expected:
        raise RuntimeError(f"the replay generated {written} tokens instead of {expected}")
    return wall_s, timer.stats(wall_s)


class _StopAtLengths(StoppingCriteria):
    """Row i of a left-padded batch is done after lengths_B[i] new tokens."""

    def __init__(self, lengths_B: torch.Tensor, prompt_len: int):
        self.lengths_B, self.prompt_len = lengths_B, prompt_len

    def __call__(self, input_ids_BT: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return self.lengths_B.to(input_ids_BT.device) <= input_ids_BT.shape[1] - self.prompt_len


@torch.no_grad()
def plain_hf(engine, prompts, n_tokens_B: list[int], sampling, timeline: list | None = None) -> tuple[float, dict]:
    """`generate` in the engine's batches, as HFEngine runs them: row i stops after n_tokens_B[i] new
    tokens, EOS ignored; a batch runs until its longest row is done. Returns seconds (and no stats;
    no timeline)."""
    from transformers import GenerationConfig, StoppingCriteriaList

    bias = [[[token], b] for token, b in sampling.logit_bias.items()] if sampling.logit_bias else None
    t0 = time.perf_counter()
    for lo in range(0, len(prompts), engine.batch_size):
        batch, lengths = prompts[lo:lo + engine.batch_size], n_tokens_B[lo:lo + engine.batch_size]
        prompt_len = max(map(len, batch))
        input_ids_BT = torch.full((len(batch), prompt_len), engine.pad_id, dtype=torch.long)
        attention_mask_BT = torch.zeros_like(input_ids_BT)
        for row, prompt in enumerate(batch):
            input_ids_BT[row, prompt_len - len(prompt):] = torch.tensor(prompt)
            attention_mask_BT[row, prompt_len - len(prompt):] = 1
        config = GenerationConfig(max_new_tokens=max(lengths), do_sample=True, temperature=sampling.temperature,
                                  top_p=sampling.top_p, top_k=0, pad_token_id=engine.pad_id,
                                  eos_token_id=[],  # None would fall back to the model's EOS
                                  sequence_bias=bias)
        engine.model.generate(input_ids=input_ids_BT.to(engine.device),
                              attention_mask=attention_mask_BT.to(engine.device), generation_config=config,
                              stopping_criteria=StoppingCriteriaList([_StopAtLengths(torch.tensor(lengths),
                                                                                     prompt_len)]))
    if engine.device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, {}
