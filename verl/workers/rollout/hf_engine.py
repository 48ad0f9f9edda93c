"""`HFEngine`: transformers `generate` behind the engine contract (`engine.py`), for machines or models
vLLM does not cover, and as a reference for vLLM's results."""

from __future__ import annotations

import torch
from transformers import StoppingCriteria

from verl.workers.rollout.engine import Generation, SamplingConfig
from verl.workers.rollout.micro_batcher import MicroBatcher


class _StopOnStrings(StoppingCriteria):
    """Per-row stopping criterion for transformers `generate`: a row is done once its new text
    contains a stop string. Records, per row, how many new tokens it had at that moment."""

    def __init__(self, tokenizer, stop: list[str], prompt_len: int):
        self.tokenizer = tokenizer
        self.stop = stop
        self.prompt_len = prompt_len
        # Decode only the tail: a stop string of n characters ends within its last 4n tokens
        # (a character takes at most 4 byte-level tokens); every step is checked, so an earlier
        # occurrence would already have been caught.
        self.window = 4 * max(map(len, stop)) + 1 if stop else 0
        self.hits: dict[int, tuple[int, str]] = {}  # row -> (new tokens up to the match, stop string)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        new = input_ids[:, self.prompt_len:]
        if not self.stop or new.shape[1] == 0:
            return done
        tails = self.tokenizer.batch_decode(new[:, -self.window:].tolist(), skip_special_tokens=True)
        for row, text in enumerate(tails):
            if row not in self.hits:
                found = [(text.find(s), s) for s in self.stop if s in text]
                if found:
                    self.hits[row] = (new.shape[1], min(found)[1])  # the one that starts first
            done[row] = row in self.hits
        return done


class HFEngine:
    """transformers `generate` in left-padded batches; same results format as VLLMEngine."""

    continuous = False  # whole batches only

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 batch_size: int = 32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
        self.device = device
        self.batch_size = batch_size
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos) if isinstance(eos, list) else {eos}
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        # transformers samples from torch's global RNG: seed it, as vLLM seeds its engine.
        torch.manual_seed(seed)
        self._batcher = MicroBatcher(self.generate)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, stop: list[str]) -> list[Generation]:
        if sampling.seed is not None:  # rows draw from one stream, so they differ
            torch.manual_seed(sampling.seed)
        generations = []
        for start in range(0, len(prompts), self.batch_size):
            generations += self._generate_batch(prompts[start:start + self.batch_size], sampling, stop)
        return generations

    async def generate_one(self, prompt_ids: list[int], sampling: SamplingConfig, stop: list[str]) -> Generation:
        return await self._batcher.submit(prompt_ids, sampling, stop)

    def reseed(self, seed: int) -> None:  # unseeded calls draw from torch's global stream
        torch.manual_seed(seed)

    def sleep(self) -> None:  # the HF engine keeps its weights; nothing to free
        pass

    def wake(self) -> None:
        pass

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @torch.no_grad()  # in-place copies into parameters that require grad
    def load_weights(self, named_tensors) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name in params:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingConfig, stop: list[str]) -> list[Generation]:
        from transformers import GenerationConfig, StoppingCriteriaList

        prompt_len = max(map(len, prompts))
        input_ids_BT = torch.full((len(prompts), prompt_len), self.pad_id, dtype=torch.long)
        attention_mask_BT = torch.zeros_like(input_ids_BT)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at prompt_len
            input_ids_BT[row, prompt_len - len(prompt):] = torch.tensor(prompt)
            attention_mask_BT[row, prompt_len - len(prompt):] = 1
        greedy = sampling.temperature == 0
        # Added to the raw logits before temperature and top-p, as vLLM applies logit_bias.
        bias = [[[token], b] for token, b in sampling.logit_bias.items()] if sampling.logit_bias else None
        config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else 0,  # transformers would otherwise default to top-50; vLLM uses all
            sequence_bias=bias,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            output_scores=sampling.logprobs,  # after bias, temperature and top-p: the scores sampled from
            return_dict_in_generate=True,
        )
        stopper = _StopOnStrings(self.tokenizer, stop, prompt_len)
        out = self.model.generate(
            input_ids=input_ids_BT.to(self.device),
            attention_mask=attention_mask_BT.to(self.device),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stopper]),
        )
        new_ids_BN = out.sequences[:, prompt_len:]
        logprobs_BN = None
        if sampling.logprobs:
            scores_BNV = torch.stack(out.scores, dim=1).float().log_softmax(-1)
            logprobs_BN = scores_BNV.gather(-1, new_ids_BN.unsqueeze(-1)).squeeze(-1).tolist()
        generations = []
        for row, new_ids in enumerate(new_ids_BN.tolist()):
            # Finished rows are padded until the whole batch stops: cut at the first EOS or
            # stop-string match, whichever came first.
            eos_at = next((i + 1 for i, t in enumerate(new_ids) if t in self.eos_ids), None)
            stop_at, stop_str = stopper.hits.get(row, (None, None))
            if eos_at is not None and (stop_at is None or eos_at <= stop_at):
                end, finish, stop_reason = eos_at, "stop", None
            elif stop_at is not None:
                end, finish, stop_reason = stop_at, "stop", stop_str
            else:
                end, finish, stop_reason = len(new_ids), "length", None  # never padded: it ran to the end
            generations.append(Generation(new_ids[:end], finish, stop_reason,
                                          None if logprobs_BN is None else logprobs_BN[row][:end]))
        return generations
