"""The original Search-R1 trainer's own keys, read into this trainer's: its compatibility table.

The original's `verl.trainer.main_ppo` command line (train_grpo.sh, train_ppo.sh) sets the search
agent's settings as top-level keys: `max_turns`, `retriever.url`, `retriever.topk`, and the PPO
script's `reranker.*`. The trainer here knows no search: those keys are the search loop's options
(`search_r1.agent.loop.SearchLoopOptions`, under `actor_rollout_ref.rollout.agent_kwargs`), and this
table says where each one goes. The original always ran the search agent with the data-source EM
reward, without keys to ask for them: when its keys are given, the table names those two where the
command line names none (and the log says so). Its reward terms (`reward_model.structure_format_score`,
`final_format_score`, `retrieval_score`), and this trainer's earlier `reward.*` names of them, are
the search reward's keyword arguments (`search_r1.rewards.RewardTerms`, under `reward.reward_kwargs`).

The trainer finds the table through the `verl.compat` entry point group (pyproject.toml), or through
VERL_COMPAT=search_r1.compat:ORIGINAL_SEARCH_R1 in a checkout used without installing it
(verl.config.compat).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from verl.config.compat import ENV_VAR, CompatTable, IgnoredKey, MovedKey, OneValueKey

SEARCH_LOOP = "search_r1.agent.loop:SearchAgentLoop"
OPTIONS = "actor_rollout_ref.rollout.agent_kwargs"
REWARD_KWARGS = "reward.reward_kwargs"

ORIGINAL_SEARCH_R1 = CompatTable(
    name="the original Search-R1",
    keys={
        "max_turns": MovedKey(f"{OPTIONS}.max_turns"),
        "retriever.url": MovedKey(f"{OPTIONS}.retriever.url"),
        "retriever.topk": MovedKey(f"{OPTIONS}.retriever.topk"),
        # Not the original's: this trainer's own top-level retriever keys before they became options.
        "retriever.api_key": MovedKey(f"{OPTIONS}.retriever.api_key"),
        "retriever.timeout_s": MovedKey(f"{OPTIONS}.retriever.timeout_s"),
        "retriever.connect_timeout_s": MovedKey(f"{OPTIONS}.retriever.connect_timeout_s"),
        "retriever.retries": MovedKey(f"{OPTIONS}.retriever.retries"),
        "retriever.max_failure_rate": MovedKey("actor_rollout_ref.rollout.max_tool_failure_rate", selects=False),
        # The original called a re-ranking service of its own; here the retrieval server re-ranks.
        "reranker.do_rerank": OneValueKey(False, "re-ranking runs inside the retrieval server here; start it with "
                                                 "`search-r1 serve --reranker_model MODEL --topk_retrieval N` and "
                                                 "drop reranker.*"),
        "reranker.url": IgnoredKey("the retrieval server re-ranks here: search-r1 serve --reranker_model"),
        "reranker.topk": IgnoredKey("retriever.topk sets the passages per search"),
        # The reward's terms are search_r1.rewards.score_for's keyword arguments (RewardTerms): the
        # original's reward_model.* names and this trainer's earlier reward.* ones. Giving one selects
        # nothing, as before: the run still names its reward function (or the keys above do).
        "reward_model.structure_format_score": MovedKey(f"{REWARD_KWARGS}.format_score", selects=False),
        "reward_model.final_format_score": MovedKey(f"{REWARD_KWARGS}.final_format_score", selects=False),
        "reward_model.retrieval_score": MovedKey(f"{REWARD_KWARGS}.retrieval_score", selects=False),
        **{f"reward.{term}": MovedKey(f"{REWARD_KWARGS}.{term}", selects=False)
           for term in ("format_score", "final_format_score", "retrieval_score", "search_cost", "format_needs_search")},
    },
    defaults={"actor_rollout_ref.rollout.agent_loop": SEARCH_LOOP,
              "reward.function": "search_r1.rewards:score_for"},
    # train_grpo.sh with verl's multi_turn keys: its preset's search settings give way to the tool YAML
    inactive_when="actor_rollout_ref.rollout.multi_turn.enable",
    inactive_why="the tool-calling loop's search tool takes its server and top-k from "
                 "multi_turn.tool_config_path",
)


TABLE_SPEC = f"{__name__}:ORIGINAL_SEARCH_R1"


def trainer_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a trainer that this package's own tools launch with the
    original's keys (the demo, the learning benchmark): VERL_COMPAT names this table too, so that a
    checkout used without installing it, which has no entry point, reads them all the same."""
    env = dict(os.environ if env is None else env)
    specs = [s.strip() for s in env.get(ENV_VAR, "").split(",") if s.strip()]
    env[ENV_VAR] = ",".join(dict.fromkeys([*specs, TABLE_SPEC]))
    return env
