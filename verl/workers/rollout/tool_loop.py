"""The tool-calling agent loop: tools advertised by the chat template, calls as `<tool_call>` JSON.

Selected by verl's keys (`actor_rollout_ref.rollout.multi_turn.enable=true`,
`…multi_turn.tool_config_path=tools.yaml`, `…multi_turn.max_assistant_turns`) or by name
(`actor_rollout_ref.rollout.agent_loop=verl.workers.rollout.tool_loop:ToolAgentLoop`). It knows
nothing of any particular tool: the YAML names them (`verl.tools.base`).

A turn: the model writes until `</tool_call>` (the engine stops there: nothing is decoded after a
complete call) or until it ends its message. A call is parsed as JSON `{"name", "arguments"}`;
malformed JSON, an unknown tool or arguments the tool refuses go back to the model as the tool's
answer, saying what was wrong, and are counted (`agent/malformed_calls`, `agent/unknown_tool_calls`,
`agent/tool_argument_errors`). The policy writes the call, so its text is bounded before JSON reads it:
a call longer than `MAX_CALL_CHARS` or nested deeper than `MAX_CALL_DEPTH` is a malformed call too
(Python's JSON parser recurses once per level and would raise RecursionError, ending the rollout,
on a thousand `[`). A tool that fails or times out is counted in `tool_failed`, which
the trainer checks against `actor_rollout_ref.rollout.max_tool_failure_rate`. The tool message is appended with the
template's own framing (`verl.tools.chat.ChatFormat`), closing the model's turn first: the model
stopped at `</tool_call>`, so the end-of-turn marker is written by the loop, with the tool message,
at loss_mask 0. A message without a call ends the trajectory (finish `eos`).

Budgets follow verl's multi-turn rollout: `data.max_response_length` is the whole response (all
turns and tool messages), `max_assistant_turns` the model's messages (so one fewer tool round), and
`data.max_obs_length` the tokens of one tool message.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from verl.config.schema import MultiTurnConfig
from verl.tools.base import ToolRunner, build_tools, read_tool_config, tool_schemas
from verl.tools.chat import CALL_CLOSE, CALL_OPEN, ChatFormat
from verl.workers.rollout.agent_loop import AgentLoopSettings
from verl.workers.rollout.multi_turn import Finish, MultiTurnAgent, Schedule, Trajectory, TurnConfig

CALL_HINT = f'Write {CALL_OPEN}{{"name": "<tool>", "arguments": {{...}}}}{CALL_CLOSE}.'
# A real call is a name and a few arguments: a few levels deep and far shorter than this. The depth
# bound sits well below Python's recursion limit, which json.loads would otherwise hit.
MAX_CALL_CHARS = 32_768
MAX_CALL_DEPTH = 32


@dataclass
class ToolAgentConfig(TurnConfig):
    """max_turns: tool rounds allowed (max_assistant_turns - 1)."""
    max_obs_length: int = 512         # tokens of one tool message, framing included


@dataclass
class ToolRequest:
    name: str | None                  # None: the call could not be read; `error` says why
    arguments: dict[str, Any]
    error: str | None = None


def last_call_block(text: str) -> str | None:
    """The text inside the last complete `<tool_call>…</tool_call>` of `text`, else None.

    Blocks pair each opening tag with the first closing tag after it, left to right, as a lazy
    regex would; scanning with str.find keeps it linear where a regex goes quadratic on thousands of
    opening tags that are never closed."""
    block, pos = None, 0
    while (start := text.find(CALL_OPEN, pos)) != -1:
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end == -1:
            break   # no later opening tag can be closed either
        block, pos = text[start + len(CALL_OPEN):end], end + len(CALL_CLOSE)
    return block


def json_depth_exceeds(text: str, limit: int) -> bool:
    """Whether the JSON-like `text` nests arrays/objects deeper than `limit` (brackets inside
    strings do not count). One linear pass, so it is safe on any input the parser would see."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _bounded_json(text: str):
    """json.loads after the size and depth checks; ValueError names what was too much."""
    if len(text) > MAX_CALL_CHARS:
        raise ValueError(f"the call is {len(text)} characters long; at most {MAX_CALL_CHARS} are read")
    if json_depth_exceeds(text, MAX_CALL_DEPTH):
        raise ValueError(f"the call nests more than {MAX_CALL_DEPTH} levels deep")
    return json.loads(text)


def parse_call(text: str, tool_names: set[str]) -> tuple[ToolRequest, str | None]:
    """The last complete `<tool_call>` block of `text` → (request, metric name of its error or None)."""
    block = last_call_block(text)
    if block is None:
        return ToolRequest(None, {}, f"Error: no {CALL_OPEN} before {CALL_CLOSE}. {CALL_HINT}"), "malformed_calls"
    try:
        call = _bounded_json(block.strip())
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("expected an object with a string `name`")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = _bounded_json(arguments)
        if not isinstance(arguments, dict):
            raise ValueError("`arguments` must be an object")
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        return ToolRequest(None, {}, f"Error: the tool call is not valid JSON ({e}). {CALL_HINT}"), "malformed_calls"
    if call["name"] not in tool_names:
        known = ", ".join(sorted(tool_names))
        return ToolRequest(None, {}, f"Error: there is no tool {call['name']!r}; the tools are: {known}."), \
            "unknown_tool_calls"
    return ToolRequest(call["name"], arguments), None


# What went wrong with calls, counted per trajectory and logged as agent/<name> (means over all
# trajectories, so each is reported for every trajectory, 0 where it did not happen).
CALL_ERRORS = ("malformed_calls", "unknown_tool_calls", "tool_argument_errors", "tool_errors", "tool_timeouts")


class ToolTrajectory(Trajectory):
    def stats(self):
        stats = super().stats()
        stats.metrics = {name: 0 for name in CALL_ERRORS} | stats.metrics
        # A message without a call is the protocol's final answer (finish eos): no action is neither.
        stats.metrics["no_action"] = float(self.tool_calls == 0 and self.finish != Finish.EOS)
        return stats


class ToolCallingAgent(MultiTurnAgent):
    stop = [CALL_CLOSE]
    trajectory_cls = ToolTrajectory
    context_tokens = 64   # a call's opening and JSON head may be prefilled in the prompt

    def __init__(self, engine, chat: ChatFormat, runner: ToolRunner, cfg: ToolAgentConfig, on_event=None):
        super().__init__(engine, cfg, on_event)
        self.chat, self.runner = chat, runner
        self.tool_names = set(runner.tools)

    def parse_turn(self, trajectory, gen, context, last_turn) -> ToolRequest | None:
        if gen.stop_reason == CALL_CLOSE:
            if last_turn:
                trajectory.finish = Finish.MAX_TURNS
                return None
            text = self.engine.tokenizer.decode(context + gen.token_ids, skip_special_tokens=True)
            request, error = parse_call(text, self.tool_names)
            if error:
                trajectory.invalid_actions += 1
                trajectory.count(error)
            else:
                trajectory.valid_actions += 1
                trajectory.tool_calls += 1
            return request
        trajectory.finish = Finish.LENGTH if gen.finish_reason == "length" else Finish.EOS
        return None

    def _record(self, trajectory, result) -> str:
        if result.status == "bad_arguments":
            trajectory.count("tool_argument_errors")
        elif result.status in ("error", "timeout"):
            trajectory.tool_failed = True
            trajectory.count("tool_timeouts" if result.status == "timeout" else "tool_errors")
        return result.text

    def run_tools(self, trajectories, requests):
        calls = [(i, r) for i, r in enumerate(requests) if r.error is None]
        results = [r.error for r in requests]
        for (i, r), result in zip(calls, self.runner.call_many([(r.name, r.arguments) for _, r in calls])):
            results[i] = self._record(trajectories[i], result)
        return results

    async def arun_tool(self, trajectory, request):
        if request.error is not None:
            return request.error
        return self._record(trajectory, await self.runner.acall(request.name, request.arguments))

    def observation_ids(self, trajectory, request, text) -> list[int]:
        return self.chat.tool_message_ids(text, self.cfg.max_obs_length)


class ToolAgentLoop:
    """The tool-calling loop as a trainer agent loop. Its options are verl's multi_turn keys
    (`MultiTurnConfig`): `tool_config_path` (required), `max_assistant_turns` (model messages per
    trajectory; null: 2, one tool round and the answer) and `format` (`hermes`: `<tool_call>` JSON,
    the only one)."""

    Options = MultiTurnConfig

    def __init__(self, engine, settings: AgentLoopSettings):
        path, rounds = self._options(settings)
        specs = read_tool_config(path)
        self.runner = ToolRunner(build_tools(specs))
        chat = ChatFormat(engine.tokenizer, tool_schemas(specs), settings.chat_template_kwargs)
        cfg = ToolAgentConfig(max_turns=rounds, max_response_tokens=self.max_response_tokens(settings),
                              max_obs_length=settings.max_obs_length, schedule=Schedule(settings.schedule),
                              admit_every_steps=settings.admit_every_steps)
        self.agent = ToolCallingAgent(engine, chat, self.runner, cfg)

    @classmethod
    def _options(cls, settings: AgentLoopSettings) -> tuple[str, int]:
        options: MultiTurnConfig = settings.options
        if not options.tool_config_path:
            raise ValueError("the tool-calling loop needs a tool config: set "
                             "actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml")
        if options.format not in ("hermes", "qwen"):
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={options.format!r}: only hermes "
                             "(<tool_call> JSON, as Qwen2.5 writes it) is supported")
        turns = options.max_assistant_turns if options.max_assistant_turns is not None else 2
        if turns < 1:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={turns}: give at least 1")
        return options.tool_config_path, turns - 1

    @classmethod
    def max_response_tokens(cls, settings: AgentLoopSettings) -> int:
        return settings.max_tokens_per_turn   # verl's meaning: the whole response, every turn

    @classmethod
    def preflight(cls, settings: AgentLoopSettings) -> None:
        """Each tool's own check (e.g. the search tool asks its retriever once)."""
        path, _ = cls._options(settings)
        for tool in build_tools(read_tool_config(path)).values():
            tool.check()

    def run(self, prompts, sampling):
        return self.agent.run(prompts, sampling)
