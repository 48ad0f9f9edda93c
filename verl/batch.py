"""The typed batch that flows through one training step.

Layout of every row: [left-padded prompt | right-padded response], so column P (the padded prompt
width) is the first response token of every row and response-aligned tensors are `[:, P:]`.
Shape letters: B = trajectories, T = P + R tokens, P = prompt width, R = response width.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class RolloutBatch:
    input_ids_BT: torch.Tensor       # int64
    attention_mask_BT: torch.Tensor  # int64, 1 on real tokens (prompt and response)
    loss_mask_BR: torch.Tensor       # float32, 1 on model-written response tokens; 0 on observations/padding
    response_mask_BR: torch.Tensor   # float32, 1 on every real response token (model or observation)
    prompt_width: int                # P
    group_ids_B: torch.Tensor        # int64, trajectories of the same prompt share an id
    rewards_B: torch.Tensor | None = None          # float32 outcome reward
    old_logprobs_BR: torch.Tensor | None = None    # actor log-probs at rollout time
    ref_logprobs_BR: torch.Tensor | None = None
    values_BR: torch.Tensor | None = None
    advantages_BR: torch.Tensor | None = None
    returns_BR: torch.Tensor | None = None
    rollout_logprobs_BR: torch.Tensor | None = None  # float32, the engine's log-prob of each sampled token (0 elsewhere)
    info: dict = field(default_factory=dict)       # per-trajectory python lists (stats, texts)

    def __len__(self) -> int:
        return self.input_ids_BT.shape[0]

    @property
    def response_ids_BR(self) -> torch.Tensor:
        return self.input_ids_BT[:, self.prompt_width:]

    def _tensor_fields(self):
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def select(self, idx) -> "RolloutBatch":
        """Rows `idx` (a slice, list or index tensor); info lists follow along."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        else:
            rows = torch.as_tensor(idx).tolist()
        out = replace(self, info={k: [v[i] for i in rows] for k, v in self.info.items()})
        for name in self._tensor_fields():
            setattr(out, name, getattr(self, name)[rows])
        return out

    def split(self, n: int) -> list["RolloutBatch"]:
        """n contiguous, equal parts (the caller checks divisibility at start-up)."""
        if len(self) % n:
            raise ValueError(f"a batch of {len(self)} rows cannot be split into {n} equal parts")
        size = len(self) // n
        return [self.select(slice(i * size, (i + 1) * size)) for i in range(n)]

    @staticmethod
    def concat(parts: list["RolloutBatch"]) -> "RolloutBatch":
        """Rows of all parts; prompts and responses are re-padded to the widest part."""
        P = max(p.prompt_width for p in parts)
        R = max(p.input_ids_BT.shape[1] - p.prompt_width for p in parts)
        padded = [_repad(p, P, R) for p in parts]
        out = replace(padded[0], info={k: [x for p in padded for x in p.info[k]] for k in padded[0].info})
        for name in padded[0]._tensor_fields():
            setattr(out, name, torch.cat([getattr(p, name) for p in padded]))
        return out

    def cat_responses(self, parts_BR: list[torch.Tensor]) -> torch.Tensor:
        """Per-token tensors of this batch's parts (its `split`, computed by the workers) as one
        [B, R] tensor: each part is right-padded with 0 to this batch's response width."""
        width = self.input_ids_BT.shape[1] - self.prompt_width
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts_BR])

    def to(self, device) -> "RolloutBatch":
        out = replace(self)
        for name in self._tensor_fields():
            setattr(out, name, getattr(self, name).to(device))
        return out


def balanced_order(tokens: list[int], parts: int) -> list[int]:
    """Row indices reordered so that `RolloutBatch.split(parts)` gives every part the same number of
    rows and nearly the same number of tokens: the longest rows first, each to the part with the
    fewest tokens that still has room. Multi-turn trajectories vary widely in length and the rows of
    one prompt sit together, so contiguous equal splits can leave one GPU with far more work."""
    if len(tokens) % parts:
        raise ValueError(f"{len(tokens)} rows cannot be split into {parts} equal parts")
    size = len(tokens) // parts
    members: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        part = min((p for p in range(parts) if len(members[p]) < size), key=lambda p: totals[p])
        members[part].append(i)
        totals[part] += tokens[i]
    return [i for part in members for i in sorted(part)]


def token_budget_parts(tokens: list[int], max_tokens: int, parts: int | None = None) -> list[list[int]]:
    """Row indices of micro-batches holding at most `max_tokens` tokens each, as few as that allows
    (`parts`: exactly that many, e.g. a count all ranks agreed on). Longest rows first, each to the
    part with the fewest tokens, so parts come out nearly even. A row longer than the budget gets a
    part of its own (the trainer checks at start-up that the longest possible row fits). Each part
    lists its rows in batch order; parts are ordered by their first row."""
    n = len(tokens)
    if parts is not None and not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} rows into {parts} non-empty parts")
    over = [t for t in tokens if t > max_tokens]   # each needs a part of its own
    k = parts or max(1, min(n, len(over) + -(-(sum(tokens) - sum(over)) // max_tokens)))
    order = sorted(range(n), key=lambda i: -tokens[i])
    while True:
        members: list[list[int]] = [[] for _ in range(k)]
        totals = [0] * k
        for i in order:
            p = min(range(k), key=lambda j: (totals[j], len(members[j])))
            members[p].append(i)
            totals[p] += tokens[i]
        fits = all(t <= max_tokens or len(m) == 1 for t, m in zip(totals, members))
        if parts is not None or fits or k == n:
            return sorted((sorted(m) for m in members if m), key=lambda m: m[0])
        k += 1


def _repad(b: RolloutBatch, P: int, R: int) -> RolloutBatch:
    dp, dr = P - b.prompt_width, R - (b.input_ids_BT.shape[1] - b.prompt_width)
    if dp == 0 and dr == 0:
        return b
    out = replace(b, prompt_width=P)
    for name in b._tensor_fields():
        t = getattr(b, name)
        if name.endswith("_BT"):
            t = torch.nn.functional.pad(t, (dp, dr))
        elif name.endswith("_BR"):
            t = torch.nn.functional.pad(t, (0, dr))
        setattr(out, name, t)
    return out


def pack_trajectories(prompts: list[list[int]], responses: list[list[int]], loss_masks: list[list[int]],
                      group_ids: list[int], pad_id: int) -> RolloutBatch:
    """Build the padded batch from token lists (prompt left-padded, response right-padded)."""
    B = len(prompts)
    P = max(map(len, prompts))
    R = max(1, max(map(len, responses)))
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    loss_mask = torch.zeros((B, R), dtype=torch.float32)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, r, m) in enumerate(zip(prompts, responses, loss_masks)):
        input_ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        attention[i, P - len(p):P] = 1
        if r:
            input_ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
            attention[i, P:P + len(r)] = 1
            loss_mask[i, :len(r)] = torch.tensor(m, dtype=torch.float32)
            response_mask[i, :len(r)] = 1
    return RolloutBatch(input_ids, attention, loss_mask, response_mask, P,
                        torch.tensor(group_ids, dtype=torch.long))
