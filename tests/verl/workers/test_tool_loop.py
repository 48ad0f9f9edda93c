"""The tool-calling loop with a scripted engine and tools defined here (an echo and a slow tool: the
loop is generic, so any tool will do): call parsing, token-exact tool messages against the chat
template, error messages for malformed calls, every schedule, the runner's limits and timeouts,
and the node-wide bucket through a real Ray instance."""
import asyncio
import threading
import time

import pytest

from verl.tools.base import Tool, ToolArgumentError, ToolRunner, ToolSpec, build_tools, read_tool_config, tool_class
from verl.tools.chat import CHATML_TOOLS_TEMPLATE, ChatFormat, renders_tools
from verl.workers.rollout.engine import Generation, SamplingConfig
from verl.workers.rollout.multi_turn import Finish, Schedule
from verl.workers.rollout.tool_loop import MAX_CALL_CHARS, MAX_CALL_DEPTH, ToolAgentConfig, ToolCallingAgent, parse_call
from search_r1.local_models import load_smollm2_tokenizer

GREEDY = SamplingConfig(temperature=0, max_tokens=256)
SYSTEM = {"role": "system", "content": "Answer with the tools."}


class EchoTool(Tool):
    default_schema = {"type": "function", "function": {
        "name": "echo", "description": "Repeats the text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    async def call(self, arguments):
        if "text" not in arguments:
            raise ToolArgumentError("echo takes {\"text\": …}")
        return f"echo: {arguments['text']}"


class SlowTool(Tool):
    """Sleeps; records how many of its calls ran at once."""
    default_schema = {"type": "function", "function": {"name": "slow", "parameters": {"type": "object"}}}
    lock = threading.Lock()

    def __init__(self, config, schema=None):
        super().__init__(config, schema)
        self.running = self.peak = 0

    async def call(self, arguments):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(float(arguments.get("s", 0.05)))
            if arguments.get("fail"):
                raise ConnectionError("backend down")
            return "slept"
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture(scope="module")
def tokenizer():
    return load_smollm2_tokenizer()


def call_text(name, arguments, thought="I should call it."):
    import json
    return f"<think> {thought} </think>\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedEngine:
    """Stands in for the model: each prompt (by its last user message) has a list of turn texts. Like a
    real engine it stops right after a stop string, appends EOS for a turn marked `<eos>`, cuts at
    max_tokens, and offers submit/step for the continuous schedule."""
    continuous = True

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts, self.calls, self.queue = tokenizer, scripts, {}, []

    def _one(self, prompt, sampling, stop):
        text = self.tokenizer.decode(prompt)
        key = next(k for k in self.scripts if f"\n{k}<|im_end|>" in text)
        turn = self.calls.get(key, 0)
        self.calls[key] = turn + 1
        out = self.scripts[key][min(turn, len(self.scripts[key]) - 1)]
        eos = out.endswith("<eos>")
        out = out.removesuffix("<eos>")
        hit = next((s for s in stop if s in out), None)
        if hit:
            out = out[:out.index(hit) + len(hit)]
        ids = self.tokenizer.encode(out, add_special_tokens=False) + ([self.tokenizer.eos_token_id] if eos and not hit else [])
        if len(ids) > sampling.max_tokens:
            return Generation(ids[:sampling.max_tokens], "length", None)
        return Generation(ids, "stop" if hit or eos else "length", hit)

    def generate(self, prompts, sampling, stop):
        return [self._one(p, sampling, stop) for p in prompts]

    async def generate_one(self, prompt, sampling, stop):
        await asyncio.sleep(0)
        return self._one(prompt, sampling, stop)

    def submit(self, key, prompt, sampling, stop):
        self.queue.append((key, self._one(prompt, sampling, stop)))

    def step(self):
        done, self.queue = self.queue[:1], self.queue[1:]
        return done

    def has_unfinished(self):
        return bool(self.queue)

    def abort_all(self):
        self.queue = []


def make_agent(tokenizer, scripts, tools=None, schedule=Schedule.SYNC, **cfg):
    tools = tools or {"echo": EchoTool({})}
    chat = ChatFormat(tokenizer, [t.schema for t in tools.values()])
    runner = ToolRunner(tools)
    agent = ToolCallingAgent(ScriptedEngine(tokenizer, scripts), chat, runner,
                             ToolAgentConfig(**{"max_turns": 3, "max_response_tokens": 2048, "schedule": schedule,
                                                **cfg}))
    prompts = [chat.prompt_ids([SYSTEM, {"role": "user", "content": q}]) for q in scripts]
    return agent, chat, runner, prompts


# -- parsing ---------------------------------------------------------------------------------------

def test_parse_call_reads_json_and_names_every_error():
    names = {"search"}
    ok, err = parse_call('x <tool_call>\n{"name": "search", "arguments": {"query_list": ["a"]}}\n</tool_call>', names)
    assert err is None and ok.name == "search" and ok.arguments == {"query_list": ["a"]}
    ok, err = parse_call('<tool_call>{"name": "search", "arguments": "{\\"query_list\\": [\\"b\\"]}"}</tool_call>', names)
    assert err is None and ok.arguments == {"query_list": ["b"]}  # arguments written as a JSON string
    bad, err = parse_call("<tool_call>{name: search}</tool_call>", names)
    assert err == "malformed_calls" and bad.name is None and "not valid JSON" in bad.error
    bad, err = parse_call('<tool_call>{"name": "browse", "arguments": {}}</tool_call>', names)
    assert err == "unknown_tool_calls" and "no tool 'browse'" in bad.error and "search" in bad.error
    bad, err = parse_call("text then </tool_call>", names)
    assert err == "malformed_calls" and "no <tool_call>" in bad.error
    bad, err = parse_call('<tool_call>["search"]</tool_call>', names)
    assert err == "malformed_calls"



@pytest.mark.parametrize("nested", ["[" * 1000, '{"a":' * 1000, '{"name": "search", "arguments": "' + "[" * 1000 + '"}',
                                    '{"name": "search", "arguments": {"q": ' + "[" * (MAX_CALL_DEPTH + 1) + "]" * (MAX_CALL_DEPTH + 1) + "}}"],
                         ids=["arrays", "objects", "arguments-string", "just-past-the-bound"])
def test_a_call_nested_too_deep_is_a_malformed_call_not_a_recursion_error(nested):
    bad, err = parse_call(f"<tool_call>{nested}</tool_call>", {"search"})
    assert err == "malformed_calls" and bad.name is None and f"more than {MAX_CALL_DEPTH} levels" in bad.error
    ok, err = parse_call('<tool_call>{"name": "search", "arguments": {"q": "[[[[{{{{"}}</tool_call>', {"search"})
    assert err is None and ok.arguments == {"q": "[[[[{{{{"}   # brackets inside strings are text


def test_an_oversized_call_is_malformed_and_unclosed_openings_are_read_in_linear_time():
    huge = '{"name": "search", "arguments": {"q": "' + "x" * MAX_CALL_CHARS + '"}}'
    bad, err = parse_call(f"<tool_call>{huge}</tool_call>", {"search"})
    assert err == "malformed_calls" and f"at most {MAX_CALL_CHARS}" in bad.error
    start = time.monotonic()
    bad, err = parse_call("<tool_call>x" * 50_000, {"search"})  # quadratic for a lazy regex
    assert err == "malformed_calls" and "no <tool_call>" in bad.error and time.monotonic() - start < 1
    ok, err = parse_call('<tool_call>{"name": "a"}</tool_call> <tool_call>x <tool_call>{"name": "search"}</tool_call>',
                         {"a", "search"})
    assert err == "malformed_calls"   # as before: the last block runs from its first opening tag

# -- the chat template -----------------------------------------------------------------------------

def test_smollm2_gets_our_chatml_tool_template_and_a_template_with_tools_is_kept(tokenizer, caplog):
    assert not renders_tools(tokenizer)  # SmolLM2's ChatML has no tools section
    with caplog.at_level("WARNING"):
        chat = ChatFormat(tokenizer, [EchoTool.default_schema])
    assert chat.template == CHATML_TOOLS_TEMPLATE and "cannot render tools" in caplog.text
    assert (chat.turn_end, chat.tool_open, chat.tool_close) == (
        "<|im_end|>\n", "<|im_start|>user\n<tool_response>\n", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    prompt = chat.render([SYSTEM, {"role": "user", "content": "Q?"}])
    assert prompt.startswith("<|im_start|>system\nAnswer with the tools.\n\n# Tools") and '"name": "echo"' in prompt
    assert prompt.endswith("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")

    import copy
    own = copy.deepcopy(tokenizer)
    own.chat_template = CHATML_TOOLS_TEMPLATE   # a tokenizer whose own template renders tools
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert ChatFormat(own, [EchoTool.default_schema]).template is None
    assert "cannot render tools" not in caplog.text


def test_tool_message_is_cut_to_its_budget_keeping_the_frame(tokenizer):
    chat = ChatFormat(tokenizer, [EchoTool.default_schema])
    ids = chat.tool_message_ids("word " * 500, max_tokens=40)
    text = tokenizer.decode(ids)
    assert len(ids) <= 41 and text.startswith(chat.turn_end + chat.tool_open) and text.endswith(chat.tool_close)


# -- trajectories ----------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", list(Schedule))
def test_trajectory_equals_the_template_rendering_of_the_conversation(tokenizer, schedule):
    """Token-exact: prompt + response ids are the template's ids for the whole conversation, with the
    model's own turns as assistant messages and the tool's answer as a tool message; the mask is 1
    exactly on the model's turns."""
    turn1 = call_text("echo", {"text": "hello"})
    turn2 = "<think> It echoed. </think>\n<answer> hello </answer>"
    agent, chat, runner, prompts = make_agent(tokenizer, {"Say hello?": [turn1, turn2 + "<eos>"]}, schedule=schedule)
    (t,) = agent.run(prompts, GREEDY)
    runner.close()
    assert t.finish == Finish.EOS and t.tool_calls == 1 and t.turns == 2 and not t.tool_failed
    conversation = [SYSTEM, {"role": "user", "content": "Say hello?"}, {"role": "assistant", "content": turn1},
                    {"role": "tool", "content": "echo: hello"}, {"role": "assistant", "content": turn2}]
    expected = chat.encode(chat.render(conversation, generation_prompt=False))
    assert t.prompt_ids + t.response_ids == expected[:-1]  # the template ends with a newline after EOS
    model = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    assert tokenizer.decode(model) == turn1 + turn2 + "<|im_end|>"
    tool = tokenizer.decode([i for i, m in zip(t.response_ids, t.loss_mask) if not m])
    assert tool == "<|im_end|>\n<|im_start|>user\n<tool_response>\necho: hello\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("schedule", list(Schedule))
def test_bad_calls_become_messages_to_the_model_and_are_counted(tokenizer, schedule):
    scripts = {
        "Broken?": ["<think> x </think>\n<tool_call>\n{not json}\n</tool_call>", "<answer> a </answer><eos>"],
        "Unknown?": [call_text("browse", {"url": "x"}), "<answer> b </answer><eos>"],
        "Arguments?": [call_text("echo", {"words": "x"}), "<answer> c </answer><eos>"],
        "Failing?": [call_text("slow", {"fail": True}), "<answer> d </answer><eos>"],
        "Slow?": [call_text("slow", {"s": 5}), "<answer> e </answer><eos>"],
    }
    tools = {"echo": EchoTool({}), "slow": SlowTool({"timeout": 0.3})}
    agent, chat, runner, prompts = make_agent(tokenizer, scripts, tools, schedule)
    start = time.monotonic()
    broken, unknown, arguments, failing, slow = agent.run(prompts, GREEDY)
    runner.close()
    assert time.monotonic() - start < 4   # the 5 s call was cut at its timeout
    told = {name: tokenizer.decode([i for i, m in zip(t.response_ids, t.loss_mask) if not m])
            for name, t in [("broken", broken), ("unknown", unknown), ("arguments", arguments),
                            ("failing", failing), ("slow", slow)]}
    assert "not valid JSON" in told["broken"] and broken.metrics == {"malformed_calls": 1}
    assert "no tool 'browse'" in told["unknown"] and unknown.metrics == {"unknown_tool_calls": 1}
    assert "echo takes" in told["arguments"] and arguments.metrics == {"tool_argument_errors": 1}
    assert "failed (ConnectionError)" in told["failing"] and failing.tool_failed and failing.metrics == {"tool_errors": 1}
    assert "did not answer within 0.3 s" in told["slow"] and slow.tool_failed and slow.metrics == {"tool_timeouts": 1}
    assert broken.invalid_actions == unknown.invalid_actions == 1 and broken.tool_calls == 0
    assert all(t.finish == Finish.EOS for t in (broken, unknown, arguments, failing, slow))
    assert not (broken.tool_failed or unknown.tool_failed or arguments.tool_failed)
    stats = failing.stats()
    assert stats.tool_failed and stats.metrics["tool_errors"] == 1 and stats.metrics["tool_calls"] == 1



@pytest.mark.parametrize("schedule", list(Schedule))
def test_a_deeply_nested_call_is_answered_as_malformed_in_every_schedule(tokenizer, schedule):
    """A policy's `[[[[…` call once raised RecursionError inside the rollout: sync and continuous lost
    the whole rollout, async marked the trajectory a timeout without counting it."""
    scripts = {"Deep?": ["<tool_call>" + "[" * 1000 + "</tool_call>", "<answer> a </answer><eos>"],
               "Fine?": [call_text("echo", {"text": "hi"}), "<answer> b </answer><eos>"]}
    agent, chat, runner, prompts = make_agent(tokenizer, scripts, schedule=schedule, max_response_tokens=4096)
    deep, fine = agent.run(prompts, SamplingConfig(temperature=0, max_tokens=2048))
    runner.close()
    told = tokenizer.decode([i for i, m in zip(deep.response_ids, deep.loss_mask) if not m])
    assert f"more than {MAX_CALL_DEPTH} levels" in told and deep.metrics == {"malformed_calls": 1}
    assert deep.finish == fine.finish == Finish.EOS and deep.invalid_actions == 1 and fine.tool_calls == 1
    assert deep.stats().metrics["malformed_calls"] == 1

def test_turn_and_length_limits(tokenizer):
    loop = [call_text("echo", {"text": "again"})]
    agent, _, runner, prompts = make_agent(tokenizer, {"Forever?": loop, "Long?": ["word " * 400]}, max_turns=2)
    forever, long = agent.run(prompts, SamplingConfig(temperature=0, max_tokens=100))
    assert forever.finish == Finish.MAX_TURNS and forever.tool_calls == 2 and forever.turns == 3
    assert long.finish == Finish.LENGTH and len(long.response_ids) == 100
    agent, _, _, prompts = make_agent(tokenizer, {"Tight?": loop}, max_response_tokens=60, max_obs_length=40)
    (tight,) = agent.run(prompts, GREEDY)
    runner.close()
    assert tight.finish == Finish.LENGTH and len(tight.response_ids) <= 60


# -- limits ----------------------------------------------------------------------------------------

def test_runner_keeps_num_workers_and_rate_limit():
    few = SlowTool({"num_workers": 3, "rate_limit": 100})
    runner = ToolRunner({"slow": few})
    results = runner.call_many([("slow", {"s": 0.05})] * 12)
    assert [r.status for r in results] == ["ok"] * 12 and few.peak == 3
    runner.close()
    bucket = SlowTool({"num_workers": 10, "rate_limit": 2})
    runner = ToolRunner({"slow": bucket})
    runner.call_many([("slow", {"s": 0.05})] * 8)
    assert bucket.peak == 2
    runner.close()
    free = SlowTool({"num_workers": 4, "rate_limit": 1, "enable_global_rate_limit": False})
    runner = ToolRunner({"slow": free})
    runner.call_many([("slow", {"s": 0.05})] * 8)
    assert free.peak == 4   # verl's switch: no shared bound, num_workers only
    runner.close()


@pytest.mark.e2e  # a Ray instance
def test_rate_limit_is_shared_by_the_workers_of_a_node():
    """Two runners (two rollout workers) under one Ray instance take tokens from one bucket actor."""
    import ray
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        a, b = SlowTool({"num_workers": 8, "rate_limit": 3}), SlowTool({"num_workers": 8, "rate_limit": 3})
        runners = [ToolRunner({"slow": a}), ToolRunner({"slow": b})]
        threads = [threading.Thread(target=r.call_many, args=([("slow", {"s": 0.2})] * 6,)) for r in runners]
        peaks = []

        def watch():
            while any(t.is_alive() for t in threads):
                peaks.append(a.running + b.running)
                time.sleep(0.005)
        for t in threads:
            t.start()
        watch()
        for r in runners:
            r.close()
        assert max(peaks) == 3 and a.peak <= 3 and b.peak <= 3
    finally:
        ray.shutdown()


# -- the tool config -------------------------------------------------------------------------------

def test_tool_yaml_in_verls_layout(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        f"  - class_name: {__name__}.EchoTool\n"
        "    config: {num_workers: 4, rate_limit: 8, timeout: 5, type: native}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function: {name: repeat, description: d, parameters: {type: object, properties: {}}}\n")
    (spec,) = read_tool_config(path)
    tools = build_tools([spec])
    assert list(tools) == ["repeat"] and tools["repeat"].num_workers == 4 and tools["repeat"].timeout_s == 5
    path.write_text("tools:\n  - class_name: x.Y\n    config: {type: mcp}\n")
    with pytest.raises(ValueError, match="only native tools"):
        read_tool_config(path)
    with pytest.raises(ValueError, match="cannot be loaded"):
        tool_class("no.such.Tool")
    with pytest.raises(ValueError, match="not a verl.tools.base.Tool"):
        tool_class("collections.OrderedDict")
    with pytest.raises(ValueError, match="unique"):
        build_tools([ToolSpec(f"{__name__}.EchoTool", {}, None)] * 2)


def test_verls_own_search_tool_yaml_loads_as_written(tmp_path):
    """verl's example file: its class name resolves to our search tool, its schema (with `item:` where
    JSON schema says `items:`) is rendered as given."""
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: verl.tools.search_tool.SearchTool\n"
        "    config:\n"
        "      retrieval_service_url: http://127.0.0.1:8000/retrieve\n"
        "      num_workers: 120\n      rate_limit: 120\n      timeout: 30\n      type: native\n"
        "    tool_schema:\n      type: function\n      function:\n        name: search\n"
        "        description: Searches for relevant information based on the given query.\n"
        "        parameters:\n          type: object\n          properties:\n            query_list:\n"
        "              type: array\n              item:\n                type: string\n"
        "              description: A list of fully-formed semantic queries.\n"
        "          required: \n            - query_list\n")
    (tool,) = build_tools(read_tool_config(path)).values()
    assert type(tool).__name__ == "SearchTool" and tool.rate_limit == 120 and tool.timeout_s == 30
    assert tool.schema["function"]["parameters"]["properties"]["query_list"]["item"] == {"type": "string"}
