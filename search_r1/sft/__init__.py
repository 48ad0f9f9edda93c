"""Supervised warm start on search trajectories written in the exact rollout format.

A small instruct model (the bundled SmolLM2-135M) rarely writes `<search>` or `<answer>` on its own,
so RL starts with almost no reward to learn from. A short SFT pass on gold trajectories teaches
the format first. The original Search-R1 has no SFT stage; this one is ours.

What makes a trajectory "exact": it is built from ids the way `SearchAgent` builds a rollout (or,
with `--protocol tools`, the tool-calling loop: search tool calls, tool messages from the chat
template's own framing, the prompt rendered with the search tool).
- prompt ids as `verl.utils.dataset.load_examples` makes them (chat template + generation prompt);
- each model segment (`<think> … </think>` then `<search> … </search>` or `<answer> … </answer>`)
  tokenized on its own and appended, loss 1;
- each observation made by `SearchAgent.passage_ids` from real retrieval hits (same wrapper,
  same cut at `max_obs_length`), loss 0: the model is never trained on the passages;
- EOS after the answer, loss 1. The rollout's engine stops on `</answer>` before any EOS, so this
  token is never sampled in RL; it is here so the SFT model also stops when run without stop strings.

Gold paths for the bundled geography task use the retriever the model will meet in RL, and a
question is kept only if its answer (and, for two hops, the country) is in the observation the
model actually reads, so we never teach answering without evidence.

One module per job:
- `trajectories.py`: `Example` and the ids of a trajectory as the rollout makes them; gold
  trajectories for the bundled questions, a user's trajectories from JSONL, the test-split check;
- `train.py`: the masked loss (`masked_nll`, `mean_nll`) and `run_sft`, the training loop;
- `cli.py`: the `search-r1 sft` command.
"""
from search_r1.sft.cli import add_parser, sft_command
from search_r1.sft.train import METRICS_FILE, masked_nll, mean_nll, run_sft
from search_r1.sft.trajectories import (Example, SearchFn, check_train_split, load_trajectory_jsonl,
                                        make_bundled_trajectories)

__all__ = ["METRICS_FILE", "Example", "SearchFn", "add_parser", "check_train_split", "load_trajectory_jsonl",
           "make_bundled_trajectories", "masked_nll", "mean_nll", "run_sft", "sft_command"]
