"""The original Search-R1's own trainer keys, read through the search package's compatibility table:
`max_turns` and `retriever.*` become the search loop's options and, with no agent loop or reward
named, select the search agent and the data-source EM reward as the original ran; its re-ranking
keys are accepted and unused (do_rerank only false); the table is registered as an entry point."""
from __future__ import annotations

import dataclasses
import logging
import tomllib
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from search_r1.agent.loop import SearchAgentLoop, SearchLoopOptions
from search_r1.compat import ORIGINAL_SEARCH_R1
from search_r1.rewards import RewardTerms
from verl.config.compat import ENTRY_POINT_GROUP, load_table
from verl.config.load import load_config
from verl.config.schema import ConfigError
from verl.trainer.metrics import load_reward_fn, reward_kwargs_for
from verl.workers.rollout.loop_from_config import agent_loop_settings

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]


def load(*overrides):
    return load_config(OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "ppo_trainer.yaml"),
                                       OmegaConf.from_dotlist(REQUIRED + list(overrides))))


def test_the_table_is_the_entry_point_pyproject_registers():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert load_table(entry["search_r1"]) is ORIGINAL_SEARCH_R1


def test_original_keys_select_the_search_agent_and_the_em_reward_and_say_so(caplog):
    with caplog.at_level(logging.INFO):
        cfg = load("max_turns=2", "retriever.url=http://h:8000/retrieve", "retriever.topk=5")
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.agent_loop == "search_r1.agent.loop:SearchAgentLoop"
    assert cfg.reward.function == "search_r1.rewards:score_for"
    assert "keys of the original Search-R1, which ran with actor_rollout_ref.rollout.agent_loop=" in caplog.text
    options = agent_loop_settings(cfg, "cpu").options
    assert isinstance(options, SearchLoopOptions)
    assert (options.max_turns, options.retriever.url, options.retriever.topk) == (2, "http://h:8000/retrieve", 5)
    # the search loop's own default where the original's key is not given: defined once, in its options
    assert agent_loop_settings(load("retriever.url=http://h/retrieve"), "cpu").options.max_turns == \
        SearchLoopOptions().max_turns


def test_names_given_are_kept_and_a_key_given_twice_must_agree():
    cfg = load("max_turns=2", "reward.function=rewards_for_tests:early_letter_reward")
    assert cfg.reward.function == "rewards_for_tests:early_letter_reward"
    assert load("actor_rollout_ref.rollout.max_tool_failure_rate=0.2",
                "retriever.max_failure_rate=0.2").actor_rollout_ref.rollout.max_tool_failure_rate == 0.2
    with pytest.raises(ConfigError, match="max_turns=2 and actor_rollout_ref.rollout.agent_kwargs.max_turns=3 set"):
        load("max_turns=2", "actor_rollout_ref.rollout.agent_kwargs={max_turns: 3}")
    # the trainer's failure limit selects nothing: a single-turn run may set it
    assert load("retriever.max_failure_rate=0.3").actor_rollout_ref.rollout.agent_loop is None


def test_with_the_tool_protocol_the_search_keys_give_way_to_the_tool_yaml(caplog, tmp_path):
    """train_grpo.sh with verl's multi_turn keys (docs/TRAINING.md): the preset's max_turns and
    retriever.* are the tag agent's; the tool loop's search tool is configured by its YAML, so they
    are dropped, said in the log, and select nothing; the trainer's failure limit still applies."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: []\n")
    with caplog.at_level(logging.INFO):
        cfg = load("max_turns=2", "retriever.url=http://h:8000/retrieve", "retriever.max_failure_rate=0.3",
                   "actor_rollout_ref.rollout.multi_turn.enable=true",
                   f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}")
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.agent_loop is None and not rollout.agent_kwargs and rollout.max_tool_failure_rate == 0.3
    assert "max_turns=2: a key of the original Search-R1, unused with actor_rollout_ref.rollout.multi_turn" \
        ".enable=true" in caplog.text
    assert "retriever.url=http://h:8000/retrieve: a key of the original Search-R1, unused" in caplog.text
    assert agent_loop_settings(cfg, "cpu").options.tool_config_path == str(tools)


def test_reranker_keys_are_accepted_and_unused_and_do_rerank_only_false(caplog):
    with caplog.at_level(logging.INFO):
        cfg = load("reranker.do_rerank=false", "reranker.url=http://10.0.0.1:6980/rerank", "reranker.topk=5")
    assert "reranker.topk=5: a key of the original Search-R1, accepted and unused" in caplog.text
    assert cfg.actor_rollout_ref.rollout.agent_loop is None   # accepted keys select nothing
    with pytest.raises(ConfigError, match="--reranker_model"):
        load("reranker.do_rerank=true")


@pytest.mark.parametrize("override, message", [
    ("retriever.urll=http://h/retrieve", r"retriever.urll: not a key of the original Search-R1 .*retriever.url"),
    ("actor_rollout_ref.rollout.agent_kwargs={max_turn: 2}",
     r"agent_kwargs.max_turn: the agent loop search_r1.agent.loop:SearchAgentLoop has no such option; its options "
     r"here: max_turns, retriever, search_malformed_queries, turn_prefix"),
    ("actor_rollout_ref.rollout.agent_kwargs={retriever: {uri: x}}", r"agent_kwargs.retriever.uri: .*no such option"),
    ("actor_rollout_ref.rollout.agent_kwargs={max_turns: many}", r"agent_kwargs.max_turns: Value 'many'"),
])
def test_unknown_or_mistyped_options_stop_at_start_up_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        cfg = load("actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop", override)
        agent_loop_settings(cfg, "cpu")


def test_single_turn_generation_takes_no_options():
    with pytest.raises(ConfigError, match="SingleTurnLoop has no such option"):
        agent_loop_settings(load("actor_rollout_ref.rollout.agent_kwargs={turn_prefix: x}"), "cpu")


def test_prompts_that_teach_the_tool_protocol_are_refused_by_the_tag_agent():
    settings = agent_loop_settings(load("max_turns=2"), "cpu")
    tools = "Call a tool as <tool_call>{\"name\": \"search\", \"arguments\": {...}}</tool_call>."
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.multi_turn.enable=true"):
        SearchAgentLoop.check_prompts(settings, ["Question: who?", tools])
    SearchAgentLoop.check_prompts(settings, ["Search with <search> query </search>. Question: who?"])


# -- the reward's terms: search_r1.rewards.score_for's keyword arguments ---------------------------

TERMS = {"format_score": 0.2, "final_format_score": 0.1, "retrieval_score": 0.3, "search_cost": 0.05,
         "format_needs_search": True}
SCORE_FOR = "reward.function=search_r1.rewards:score_for"


def reward_kwargs(*overrides):
    cfg = load(SCORE_FOR, *overrides)
    return reward_kwargs_for(load_reward_fn(cfg.reward.function), cfg.reward.reward_kwargs)


def test_the_old_and_the_originals_reward_keys_give_the_kwargs_the_new_ones_give():
    new = reward_kwargs("reward.reward_kwargs={" + ", ".join(f"{k}: {v}" for k, v in TERMS.items()) + "}")
    ours = reward_kwargs(*(f"reward.{k}={v}" for k, v in TERMS.items()))
    original = reward_kwargs("reward_model.structure_format_score=0.2", "reward_model.final_format_score=0.1",
                             "reward_model.retrieval_score=0.3", "reward.search_cost=0.05",
                             "reward.format_needs_search=true")
    assert new == ours == original == TERMS
    # none given: the terms' defaults, the paper's plain EM, as before
    assert reward_kwargs() == dataclasses.asdict(RewardTerms()) and not any(reward_kwargs().values())
    # the same key in two spellings must agree
    with pytest.raises(ConfigError, match=r"format_score=0.2 and reward.reward_kwargs.format_score=0.3 set the same"):
        reward_kwargs("reward.format_score=0.2", "reward_model.structure_format_score=0.3")


def test_reward_terms_select_nothing():
    """As before they were the function's keyword arguments: a reward term alone names no agent loop
    and no reward function."""
    cfg = load("reward.format_score=0.2")
    assert cfg.actor_rollout_ref.rollout.agent_loop is None and cfg.reward.function is None
    assert cfg.reward.reward_kwargs == {"format_score": 0.2}


@pytest.mark.parametrize("override, message", [
    ("reward.reward_kwargs={format_scor: 0.2}", r"reward.reward_kwargs.format_scor: the reward function "
                                                r"search_r1.rewards:score_for has no such option; its options here: "
                                                r"final_format_score, format_needs_search, format_score, "
                                                r"retrieval_score, search_cost"),
    ("reward.reward_kwargs={search_cost: many}", r"reward.reward_kwargs.search_cost: Value 'many'"),
    ("reward.search_cost=-0.1", r"reward.reward_kwargs: search_cost = -0.1 must be >= 0"),
    ("reward_model.final_format_score=0.3", r"reward.reward_kwargs: final_format_score = 0.3 must lie in \[0, "
                                            r"format_score = 0.0\]"),
    ("reward.format_score=0.6", r"reward.reward_kwargs: format_score \+ retrieval_score = 1.0 must be below 1"),
    ("reward.format_needs_search=true", r"reward.reward_kwargs: format_needs_search=true .* set format_score too"),
])
def test_a_bad_reward_kwarg_stops_the_start_naming_the_key(override, message, tmp_path):
    """Through the trainer's start-up itself: refused before the model, the data or any worker."""
    from hydra import compose, initialize_config_dir

    from verl.trainer.main_ppo import accept_plus_on_existing_keys, run

    overrides = [SCORE_FOR, "reward.reward_kwargs={retrieval_score: 0.4}", override,
                 f"actor_rollout_ref.model.path={tmp_path / 'no-model'}", f"data.train_files={tmp_path / 't.parquet'}",
                 f"trainer.default_local_dir={tmp_path / 'run'}"]
    if override.startswith("reward.reward_kwargs="):   # in place of the retrieval term
        overrides.pop(1)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        raw = compose("ppo_trainer", overrides=accept_plus_on_existing_keys(overrides))
    with pytest.raises(ConfigError, match=message):
        run(raw)
    assert not (tmp_path / "run").exists()


def test_the_packages_own_launchers_name_the_table_for_a_checkout_that_was_not_installed(monkeypatch):
    """The demo and the learning benchmark launch the trainer with the original's keys; without an
    installed entry point the trainer finds the table through VERL_COMPAT, which they set, once, beside
    what the user's environment names."""
    from search_r1.compat import ORIGINAL_SEARCH_R1, TABLE_SPEC, trainer_env
    from verl.config import compat
    assert trainer_env({})["VERL_COMPAT"] == TABLE_SPEC
    assert trainer_env({"VERL_COMPAT": f"mine.compat:T, {TABLE_SPEC}", "A": "1"}) == {
        "VERL_COMPAT": f"mine.compat:T,{TABLE_SPEC}", "A": "1"}
    monkeypatch.setattr(compat.importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(compat.os, "environ", trainer_env({}))
    assert compat.compat_tables() == [ORIGINAL_SEARCH_R1]
