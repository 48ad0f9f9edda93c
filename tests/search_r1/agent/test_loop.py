"""The agent loop with a scripted engine (every finish reason, truncation, invalid actions,
retriever down or slow) and with the real vLLM CPU engine against a real retrieval server."""
import asyncio
import time
from dataclasses import replace

import pytest

from verl.workers.rollout.engine import Generation, SamplingConfig
from search_r1.agent.loop import (INVALID_ACTION, SEARCH_FAILED, AgentConfig, Finish, HTTPSearcher,
                                  Schedule, SearchAgent, SearchAgentLoop, SearchTrajectory)
from search_r1.local_models import load_smollm2_tokenizer
from search_r1.retrieval.client import RetrieverConfig
from verl.workers.rollout.loop_from_config import build_options
from conftest import free_port, vllm_skip_reason

GREEDY = SamplingConfig(temperature=0, max_tokens=256)


@pytest.fixture(scope="module")
def tokenizer():
    return load_smollm2_tokenizer()


class ScriptedEngine:
    """Stands in for the model: each prompt has a script of turn texts. It behaves like a real
    engine: stops right after a stop string (included), appends EOS for a turn marked `<eos>`,
    and cuts at max_tokens with finish "length". It records every id it returned."""

    continuous = True  # offers submit/step, as vLLM does

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.scripts = {tuple(tokenizer.encode(k)): list(v) for k, v in scripts.items()}
        self.calls: dict[tuple, int] = {}
        self.generated: dict[tuple, list[list[int]]] = {}
        self.queue: list[tuple] = []  # submitted, not yet returned by step()

    def _one(self, prompt, sampling, stop):
        key = next(k for k in self.scripts if tuple(prompt[:len(k)]) == k)
        turn = self.calls.get(key, 0)
        self.calls[key] = turn + 1
        text = self.scripts[key][min(turn, len(self.scripts[key]) - 1)]
        eos = text.endswith("<eos>")
        text = text.removesuffix("<eos>")
        hits = [(text.find(s) + len(s), s) for s in stop if s in text]
        stop_reason = None
        if hits:
            end, stop_reason = min(hits)
            text = text[:end]
        ids = self.tokenizer.encode(text)
        if eos and not hits:
            ids.append(self.tokenizer.eos_token_id)
        gen = Generation(ids, "stop", stop_reason)
        if len(ids) > sampling.max_tokens:
            gen = Generation(ids[:sampling.max_tokens], "length", None)
        elif not hits and not eos:
            gen = Generation(ids, "length", None)
        self.generated.setdefault(key, []).append(gen.token_ids)
        return gen

    def generate(self, prompts, sampling, stop):
        return [self._one(p, sampling, stop) for p in prompts]

    async def generate_one(self, prompt, sampling, stop):
        await asyncio.sleep(0)
        return self._one(prompt, sampling, stop)

    # continuous batching, as VLLMEngine offers it: one request finishes per step, so the turns of
    # different trajectories interleave
    def submit(self, key, prompt, sampling, stop):
        self.queue.append((key, self._one(prompt, sampling, stop)))

    def step(self):
        done, self.queue = self.queue[:1], self.queue[1:]
        return done

    def has_unfinished(self):
        return bool(self.queue)

    def abort_all(self):
        self.queue = []


class DictSearcher:
    """A retriever over a dict; can fail or be slow. Stands in for the server in unit tests."""

    def __init__(self, docs=None, fail=False, delay=0.0):
        self.docs = docs or {}
        self.fail, self.delay, self.batches = fail, delay, []

    def _hits(self, q, topk):
        text = self.docs.get(q, f"Nothing about {q}.")
        return [{"document": {"id": str(i), "contents": f'"{q} {i}"\n{text}'}, "score": 1.0 - i}
                for i in range(topk)]

    def search(self, queries, topk):
        self.batches.append(list(queries))
        if self.fail:
            raise ConnectionError("retriever down")
        time.sleep(self.delay)
        return [self._hits(q, topk) for q in queries]

    async def asearch(self, queries, topk):
        if self.fail:
            raise ConnectionError("retriever down")
        await asyncio.sleep(self.delay)
        return [self._hits(q, topk) for q in queries]


def run(tokenizer, scripts, searcher=None, schedule=Schedule.SYNC, **cfg):
    engine = ScriptedEngine(tokenizer, scripts)
    agent = SearchAgent(engine, searcher or DictSearcher(), AgentConfig(schedule=schedule, **cfg))
    prompts = [tokenizer.encode(k) for k in scripts]
    return agent.run(prompts, GREEDY), engine


def segments(t):
    """(model?, text) runs of the response."""
    out, start = [], 0
    for i in range(1, len(t.loss_mask) + 1):
        if i == len(t.loss_mask) or t.loss_mask[i] != t.loss_mask[start]:
            out.append((bool(t.loss_mask[start]), t.response_ids[start:i]))
            start = i
    return out


@pytest.mark.parametrize("schedule", list(Schedule))
def test_search_then_answer(tokenizer, schedule):
    searcher = DictSearcher({"capital of Japan": "Tokyo is the capital of Japan."})
    (t,), engine = run(tokenizer, {"Q1:": ["<think>look up</think><search> capital of Japan </search> extra",
                                           "<think>found</think><answer> Tokyo </answer> trailing"]},
                       searcher, schedule)
    assert t.finish == Finish.ANSWER and t.searches == 1 and t.turns == 2 and t.valid_actions == 2
    segs = segments(t)
    assert [m for m, _ in segs] == [True, False, True]
    # the model's tokens are exactly what the engine returned, nothing after the stop tag
    key = next(iter(engine.generated))
    assert [ids for m, ids in segs if m] == engine.generated[key]
    obs = tokenizer.decode(segs[1][1])
    assert obs.startswith("\n\n<information>Doc 1(Title: capital of Japan 0) Tokyo is the capital")
    assert obs.endswith("</information>\n\n") and "Doc 3(Title:" in obs
    assert tokenizer.decode(t.response_ids).endswith("<answer> Tokyo </answer>")


@pytest.mark.parametrize("schedule", list(Schedule))
def test_finish_reasons(tokenizer, schedule):
    scripts = {
        "A:": ["<answer> yes </answer>"],
        "B:": ["I am done.<eos>"],
        "C:": ["<search> again </search>"],          # searches forever
        "D:": ["word " * 400],                        # never stops
        "E:": ["<search></search>", "<answer> x </answer>"],  # invalid, then answers
    }
    ts, _ = run(tokenizer, scripts, schedule=schedule, max_turns=2, max_response_tokens=200)
    a, b, c, d, e = ts
    assert a.finish == Finish.ANSWER and a.loss_mask == [1] * len(a.response_ids)
    assert b.finish == Finish.EOS and b.response_ids[-1] == tokenizer.eos_token_id
    assert c.finish == Finish.MAX_TURNS and c.searches == 2 and c.turns == 3
    assert d.finish == Finish.LENGTH and len(d.response_ids) == 200
    assert e.finish == Finish.ANSWER and e.invalid_actions == 1 and e.searches == 0
    assert tokenizer.encode(INVALID_ACTION) == segments(e)[1][1]
    for t in ts:
        assert len(t.response_ids) == len(t.loss_mask) <= 200


@pytest.mark.parametrize("schedule", list(Schedule))
def test_each_trajectory_notes_when_it_ended(tokenizer, schedule):
    """done_s: seconds from the rollout's start to the trajectory's end (the trainer's rollout/done_s_*)."""
    scripts = {"A:": ["<answer> now </answer>"], "B:": ["<search> x </search>", "<answer> later </answer>"]}
    (a, b), _ = run(tokenizer, scripts, DictSearcher(delay=0.3), schedule)
    assert 0 <= a.done_s < 0.3 <= b.done_s   # B waited for its search, A did not
    assert b.stats().done_s == b.done_s and b.stats().as_row()["done_s"] == b.done_s


def test_observation_truncated_keeps_closing_tag(tokenizer):
    searcher = DictSearcher({"q": "long passage " * 200})
    (t,), _ = run(tokenizer, {"Q:": ["<search>q</search>", "<answer>a</answer>"]}, searcher,
                  max_obs_length=40)
    obs = segments(t)[1][1]
    assert len(obs) == 40 and tokenizer.decode(obs).endswith("</information>\n\n")


def test_turn_prefix_opens_the_turn_after_every_observation(tokenizer):
    """With turn_prefix the environment writes "<think>" after the passages, the correction and a failed
    search: not trained on, and within max_obs_length; the whole response is then in the valid format."""
    from search_r1.rewards import check_format
    scripts = {"Q:": [" I look.</think><search></search>", " Again.</think><search>q</search>",
                     " Found.</think><answer>a</answer>"]}
    (t,), _ = run(tokenizer, scripts, DictSearcher({"q": "long passage " * 200}), max_turns=3,
                  max_obs_length=40, turn_prefix="<think>")
    (correction, passages) = [ids for model, ids in segments(t) if not model]
    assert tokenizer.decode(correction) == INVALID_ACTION + "<think>"
    assert len(passages) == 40 and tokenizer.decode(passages).endswith("</information>\n\n<think>")
    assert check_format("<think>" + tokenizer.decode(t.response_ids)).valid
    (failed,), _ = run(tokenizer, {"Q:": ["<search>q</search>", "<answer>a</answer>"]},
                       DictSearcher(fail=True), turn_prefix="<think>")
    assert tokenizer.decode(segments(failed)[1][1]) == SEARCH_FAILED + "<think>"


def test_the_trainer_loop_takes_turn_prefix_and_refuses_unknown_options(tokenizer):
    from search_r1.agent.loop import SearchAgentLoop
    from verl.config.schema import ConfigError
    from verl.workers.rollout.agent_loop import AgentLoopSettings
    from verl.workers.rollout.loop_from_config import build_options
    retriever = {"url": "http://127.0.0.1:1/retrieve"}
    options = build_options(SearchAgentLoop, {"max_turns": 2, "retriever": retriever, "turn_prefix": "<think>"},
                            "agent_kwargs")
    loop = SearchAgentLoop(ScriptedEngine(tokenizer, {}), AgentLoopSettings(max_tokens_per_turn=16, options=options))
    assert loop.agent.cfg.turn_prefix == "<think>" and loop.agent.cfg.max_turns == 2
    with pytest.raises(ConfigError, match="agent_kwargs.prefix: .*no such option; its options here: .*turn_prefix"):
        build_options(SearchAgentLoop, {"retriever": retriever, "prefix": "x"}, "agent_kwargs")


def test_malformed_queries_are_invalid_actions_unless_the_original_behaviour_is_asked_for(tokenizer):
    """An empty <search></search> and a query that still holds <search> get a correction here; with
    search_malformed_queries (the original's behaviour) they are searched as written."""
    script = {"Q:": ["<search></search>", "<search>a <search> b</search>", "<answer>x</answer>"]}
    searcher = DictSearcher()
    (ours,), _ = run(tokenizer, script, searcher, max_turns=3)
    assert (ours.invalid_actions, ours.searches, searcher.batches) == (2, 0, [])
    (original,), _ = run(tokenizer, script, searcher, max_turns=3, search_malformed_queries=True)
    assert (original.invalid_actions, original.searches) == (0, 2)
    # the health watch's no_action: neither searched nor answered
    (silent,), _ = run(tokenizer, {"Q:": ["no tags"]}, searcher)
    assert [t.stats().metrics["no_action"] for t in (ours, original, silent)] == [0.0, 0.0, 1.0]
    assert sorted(q for batch in searcher.batches for q in batch) == ["", "a <search> b"]


def test_observation_that_does_not_fit_cuts_the_trajectory(tokenizer):
    searcher = DictSearcher({"q": "long passage " * 200})
    (t,), _ = run(tokenizer, {"Q:": ["<search>q</search>", "<answer>a</answer>"]}, searcher,
                  max_obs_length=500, max_response_tokens=100)
    assert t.finish == Finish.LENGTH and len(t.response_ids) <= 100 and t.searches == 1


def test_sync_schedule_batches_retrieval(tokenizer):
    searcher = DictSearcher()
    scripts = {f"P{i}:": [f"<search> q{i} </search>", "<answer> a </answer>"] for i in range(5)}
    run(tokenizer, scripts, searcher)
    assert searcher.batches == [[f"q{i}" for i in range(5)]]


def test_long_queries_are_cut_before_they_reach_the_retriever(tokenizer):
    # One over-long query (3,000 characters on a GPU run) made the server refuse the whole batch of
    # a sync turn.
    searcher = DictSearcher()
    long_query = "word " * 150
    scripts = {"P0:": [f"<search>{long_query}</search>", "<answer> a </answer>"],
               "P1:": ["<search> short </search>", "<answer> b </answer>"]}
    trajectories, _ = run(tokenizer, scripts, searcher, max_query_chars=100)
    assert searcher.batches == [[long_query.strip()[:100], "short"]]
    assert all(t.searches == 1 and t.finish == Finish.ANSWER for t in trajectories)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_retriever_down_never_crashes(tokenizer, schedule):
    # a real client against a port nobody listens on: retries, then the search is marked failed
    port = free_port()
    searcher = HTTPSearcher(RetrieverConfig(url=f"http://127.0.0.1:{port}/retrieve", retries=1,
                                            backoff_s=0.01, timeout_s=2))
    (t,), _ = run(tokenizer, {"Q:": ["<search> x </search>", "<answer> a </answer>"]}, searcher, schedule)
    assert t.retrieval_failed and t.finish == Finish.ANSWER
    assert tokenizer.decode(segments(t)[1][1]) == SEARCH_FAILED


def test_slow_retriever_hits_overall_timeout(tokenizer):
    searcher = DictSearcher(delay=5.0)
    t0 = time.monotonic()
    (t,), _ = run(tokenizer, {"Q:": ["<search> x </search>", "<answer> a </answer>"]}, searcher,
                  Schedule.ASYNC, timeout_s=0.5)
    assert time.monotonic() - t0 < 3 and t.finish == Finish.TIMEOUT and 0.5 <= t.done_s < 3


@pytest.mark.parametrize("schedule", [Schedule.ASYNC, Schedule.CONTINUOUS])
def test_schedules_agree_with_sync(tokenizer, schedule):
    scripts = {f"P{i}:": [f"<search> q{i} </search>"] * i + ["<answer> a </answer>"] for i in range(4)}
    sync, _ = run(tokenizer, scripts, schedule=Schedule.SYNC)
    other, _ = run(tokenizer, scripts, schedule=schedule)
    for a, b in zip(sync, other):
        assert (a.response_ids, a.loss_mask, a.finish, a.searches) == \
               (b.response_ids, b.loss_mask, b.finish, b.searches)


def test_continuous_schedule_batches_the_searches_of_a_step_and_times_out(tokenizer):
    # ScriptedEngine finishes one request per step, so each search goes out alone here; what
    # matters is that every query reaches the retriever once and a slow one ends in a timeout.
    searcher = DictSearcher()
    scripts = {f"P{i}:": [f"<search> q{i} </search>", "<answer> a </answer>"] for i in range(3)}
    trajectories, _ = run(tokenizer, scripts, searcher, Schedule.CONTINUOUS)
    assert sorted(q for batch in searcher.batches for q in batch) == ["q0", "q1", "q2"]
    assert all(t.finish == Finish.ANSWER and t.searches == 1 for t in trajectories)
    t0 = time.monotonic()
    (t,), _ = run(tokenizer, {"Q:": ["<search> x </search>", "<answer> a </answer>"]}, DictSearcher(delay=2.0),
                  Schedule.CONTINUOUS, timeout_s=0.3)
    assert t.finish == Finish.TIMEOUT and time.monotonic() - t0 < 3


def test_continuous_schedule_admits_ready_turns_together(tokenizer):
    # Turns that are ready wait for the next admission, every admit_every_steps engine steps (or at
    # once when the engine has nothing to run), so their prefills share a step. Loop passes that
    # only wait for a tool thread are not engine steps and must not count.
    class CountingEngine(ScriptedEngine):
        steps, submitted_at = 0, []

        def step(self):
            self.steps += 1
            time.sleep(0.02)  # room for the tool threads to finish before the next step
            return super().step()

        def submit(self, key, prompt, sampling, stop):
            self.submitted_at.append((self.steps, self.has_unfinished()))
            super().submit(key, prompt, sampling, stop)

    scripts = {f"P{i}:": ["bad </search>", "<answer> a </answer>"] for i in range(6)}  # invalid, then answer
    engine = CountingEngine(tokenizer, scripts)
    agent = SearchAgent(engine, DictSearcher(), AgentConfig(schedule=Schedule.CONTINUOUS, admit_every_steps=4))
    trajectories = agent.run([tokenizer.encode(k) for k in scripts], GREEDY)
    assert all(t.finish == Finish.ANSWER and t.invalid_actions == 1 for t in trajectories)
    later = engine.submitted_at[6:]  # after the first turns, all submitted at the start
    assert len(later) == 6
    admissions = sorted({step for step, _ in engine.submitted_at})
    for step, busy in later:  # while the engine is busy, an admission waits 4 steps since the last
        previous = admissions[admissions.index(step) - 1]
        assert not busy or step - previous >= 4, engine.submitted_at
    assert len({step for step, _ in later}) < len(later)  # some were admitted together


def test_continuous_schedule_needs_a_stepping_engine(tokenizer, tiny_model_dir):
    from verl.workers.rollout.hf_engine import HFEngine

    agent = SearchAgent(HFEngine(tiny_model_dir), DictSearcher(), AgentConfig(schedule=Schedule.CONTINUOUS))
    with pytest.raises(ValueError, match="continuous schedule needs an engine with submit/step"):
        agent.run([tokenizer.encode("Q:")], GREEDY)


# ---------------------------------------------------------------------------------------------
# Real engine, real server

@pytest.mark.e2e  # a vLLM engine
def test_vllm_agent_against_real_retrieval_server(smollm2_dir, dense_server):
    """SmolLM2-135M on vLLM CPU. The prompt ends with an open <search> tag, which the small model
    reliably closes, so the real search path runs: stop handling in the engine, the HTTP client,
    the server, observation tokens; greedy, so both schedules must agree."""
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    from search_r1.data.templates import make_prompt
    from verl.workers.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(smollm2_dir, seed=0, max_model_len=2048, kv_cache_memory_bytes=256 << 20)
    tok = engine.tokenizer
    prompts = []
    for q in ["What is the capital of Japan?", "Who painted the Mona Lisa?"]:
        text = tok.apply_chat_template(make_prompt(q), add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text + "<think> I will search. </think>\n<search>").input_ids)
    searcher = HTTPSearcher(RetrieverConfig(url=dense_server.url + "/retrieve"))
    results = {}
    for schedule in Schedule:
        agent = SearchAgent(engine, searcher, AgentConfig(max_turns=1, max_response_tokens=160,
                                                          schedule=schedule))
        results[schedule] = agent.run(prompts, SamplingConfig(temperature=0, max_tokens=64))
    for t in results[Schedule.SYNC]:
        assert t.searches >= 1 and not t.retrieval_failed
        obs = tok.decode([i for i, m in zip(t.response_ids, t.loss_mask) if m == 0])
        assert "<information>Doc 1(Title:" in obs and "</information>" in obs
        assert len(t.response_ids) <= 160
    for schedule in (Schedule.ASYNC, Schedule.CONTINUOUS):
        for a, b in zip(results[Schedule.SYNC], results[schedule]):
            assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask, schedule


# ---------------------------------------------------------------------------------------------
# Sampling settings reach the engine

@pytest.mark.parametrize("schedule", [Schedule.SYNC, Schedule.ASYNC])  # HF has no continuous batching
def test_logit_bias_reaches_the_engine(tiny_model_dir, schedule):
    """A real HF engine on a random model: a large bias on one token makes every model token that
    token, so the loop's per-turn settings (room-limited max_tokens) keep the bias; the trainer's
    SearchAgentLoop, which caps tokens per turn, keeps it too. No search happens: nothing listens."""
    from search_r1.agent.loop import SearchAgentLoop
    from verl.workers.rollout.agent_loop import AgentLoopSettings
    from verl.workers.rollout.hf_engine import HFEngine

    engine = HFEngine(tiny_model_dir, seed=0)
    tok = engine.tokenizer
    token = tok.encode(" Paris", add_special_tokens=False)[0]
    prompts = [tok.encode("Q: where?"), tok.encode("Q: who wrote it?")]
    sampling = SamplingConfig(temperature=1.0, max_tokens=64, logit_bias={token: 100.0})
    agent = SearchAgent(engine, DictSearcher(), AgentConfig(max_response_tokens=12, schedule=schedule))
    settings = AgentLoopSettings(max_tokens_per_turn=6, schedule=schedule, options=build_options(SearchAgentLoop, {
        "max_turns": 1, "retriever": {"url": f"http://127.0.0.1:{free_port()}/retrieve"}}, "agent_kwargs"))
    trainer_loop = SearchAgentLoop(engine, settings)
    for trajectories, length in ((agent.run(prompts, sampling), 12), (trainer_loop.run(prompts, sampling), 6)):
        for t in trajectories:
            assert t.response_ids == [token] * length and t.finish == Finish.LENGTH


def test_each_trajectory_and_turn_samples_with_a_seed_of_its_own(tokenizer):
    """Seeds follow the trajectory's place in the run and its turn, not the order in which turns
    reach the engine: a resumed step draws what the uninterrupted one drew."""
    agent = SearchAgent(ScriptedEngine(tokenizer, {}), DictSearcher(), AgentConfig())
    base = SamplingConfig(temperature=1.0, max_tokens=64, seed=7)
    first, second = SearchTrajectory([1], index=0), SearchTrajectory([1], index=1)
    seeds = {agent._sampling(first, base).seed, agent._sampling(second, base).seed}
    first.turns = 1
    seeds.add(agent._sampling(first, base).seed)
    assert len(seeds) == 3
    again = SearchAgent(ScriptedEngine(tokenizer, {}), DictSearcher(), AgentConfig())
    assert again._sampling(first, base).seed == agent._sampling(first, base).seed
    assert agent._sampling(first, replace(base, seed=None)).seed is None
