"""Prompt templates that teach the search-and-answer format.

The tags are the contract with the agent loop and the rewards: the model reasons in <think>,
asks in <search>, reads <information> (written by the environment), and ends with <answer>.
The base and instruct templates say the same thing; the base one reads as a document to continue,
the instruct one speaks to the assistant and is sent through the model's chat template. The tool
template is for the tool-calling protocol: searches are tool calls the chat template teaches, and
only <think> and <answer> remain tags.

A model whose chat template has it think on its own (Qwen3 with thinking on, templates that open
<think> themselves: `verl.utils.dataset.thinks_natively` gives the rule) gets our templates without
THINK_INSTRUCTION (`native_thinking=True`): its template asks for the thinking already, and the
tags stay the same, so the agent loop and the rewards read its responses unchanged.

Users may bring their own template instead (`qa_search.py --template-file`), e.g. the exact prompt
of runs made with the original scripts. Templates are Python format strings: PLACEHOLDERS lists the
fields, and literal braces are written `{{` and `}}`.
"""
from __future__ import annotations

import string
from pathlib import Path

_INSTRUCT = (
    "Answer the question below. You can use a search engine.\n"
    "Think inside <think> and </think> first, and again each time new information arrives.\n"
    "To look something up, write <search> your query </search>. The results come back "
    "between <information> and </information>. Search as many times as you need.\n"
    "When you know the answer, give it briefly inside <answer> and </answer>, "
    "for example <answer> Paris </answer>.\n"
    "Question: {question}\n"
)

_BASE = (
    "Below, an assistant answers a question with the help of a search engine. "
    "It thinks inside <think> and </think> whenever new information arrives, "
    "searches by writing <search> query </search>, and reads the results between "
    "<information> and </information>, searching as often as it needs. "
    "It ends with a short final answer inside <answer> and </answer>, "
    "for example <answer> Paris </answer>.\n"
    "Question: {question}\n"
)

# The instruct template with one worked trajectory, for training from a model that has never seen
# the format (reinforcement learning without a supervised warm start): a model that never writes the
# tags earns no reward, so nothing can be learned from its samples. The example's city is not in the
# bundled corpus, so it answers none of the bundled questions. Its question is shown, so that the
# model searches for its own question's subject rather than copying the example's search, which
# finds nothing (benchmarks/RESULTS.md, "Reinforcement learning alone: the rl-only preset").
_EXAMPLE = _INSTRUCT.removesuffix("Question: {question}\n") + (
    "Here is how a search goes, for another question.\n"
    "Question: Which country is the city of Tartu in?\n"
    "<think> I need the country Tartu is in. </think>\n"
    "<search> Tartu </search>\n"
    "<information> Doc 1(Title: Tartu) Tartu is a university city in Estonia. </information>\n"
    "<think> The passage says Tartu is in Estonia. </think>\n"
    "<answer> Estonia </answer>\n"
    "Question: {question}\n"
)

# The same with two searches, the second made from what the first returned: the model imitates the
# example's shape, and two-hop questions need the second step (same section). The question asks for
# the languages, which no bundled question does, so the example answers none of them.
_EXAMPLE2 = _INSTRUCT.removesuffix("Question: {question}\n") + (
    "Here is how a search goes, for another question.\n"
    "Question: Which languages are spoken in the country that Tartu is in?\n"
    "<think> I need the country Tartu is in, then the languages of that country. </think>\n"
    "<search> Tartu </search>\n"
    "<information> Doc 1(Title: Tartu) Tartu is a university city in Estonia. </information>\n"
    "<think> Tartu is in Estonia. Now I need the languages of Estonia. </think>\n"
    "<search> Estonia </search>\n"
    "<information> Doc 1(Title: Estonia) Languages spoken in Estonia include Estonian. </information>\n"
    "<think> The passage says Estonian is spoken there. </think>\n"
    "<answer> Estonian </answer>\n"
    "Question: {question}\n"
)

# The tool-calling protocol: the chat template lists the search tool (verl.tools.chat), so the
# prompt only says when to use it and how to answer.
_TOOL = (
    "Answer the question below. You can call the search tool to look things up, as many times as you "
    "need; its results come back to you as tool messages.\n"
    "Think inside <think> and </think> first, and again each time new information arrives.\n"
    "When you know the answer, give it briefly inside <answer> and </answer>, "
    "for example <answer> Paris </answer>.\n"
    "Question: {question}\n"
)
TOOL_SYSTEM = "You are a helpful assistant who answers questions with the help of a search tool."

# The line of the chat templates (instruct, example, tool) that asks for thinking; dropped for a model
# that thinks natively.
THINK_INSTRUCTION = "Think inside <think> and </think> first, and again each time new information arrives.\n"

# "base": raw text, no chat template applied; "instruct" and "example": wrapped by the tokenizer's chat template;
# "tool": a system and a user message, rendered with the search tool by the chat template;
# "example_think": "example", with the model's response begun by "<think>" (RESPONSE_PREFIXES);
# "example2" and "example2_think": the same with the two-search example.
TEMPLATES: dict[str, str] = {"base": _BASE, "instruct": _INSTRUCT, "example": _EXAMPLE, "tool": _TOOL,
                             "example_think": _EXAMPLE, "example2": _EXAMPLE2, "example2_think": _EXAMPLE2}

# Text the response starts with, written into the rows as an unfinished assistant message that the
# model continues (verl.utils.dataset.response_prefix); the rewards read it as part of the response.
# A model that never opens a <think> block never writes the valid format, which the original's
# reward (and its retrieval term) requires; begun this way, the bundled model writes valid responses
# often enough for GRPO's groups to hold a signal from the first step (benchmarks/RESULTS.md,
# "Reinforcement learning alone: the rl-only preset").
RESPONSE_PREFIXES: dict[str, str] = {"example_think": "<think>", "example2_think": "<think>"}


# Placeholder -> what it becomes; README's "Data" section documents the same list.
PLACEHOLDERS: dict[str, str] = {
    "question": "the question, stripped, with a question mark added when it has none",
}


def _clean_question(question: str) -> str:
    # Many QA sets (NQ, TriviaQA) store questions in lower case without the question mark.
    question = question.strip()
    return question if question.endswith("?") else question + "?"


def check_template(text: str, source: str) -> str:
    """`text` if it is a usable template; else a ValueError that names `source` and the fix."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as e:  # a lone brace
        raise ValueError(f"{source}: {e}. Placeholders are written {{question}}; write a literal "
                         "brace twice ({{ or }}).") from e
    unknown = sorted(fields - set(PLACEHOLDERS))
    if unknown:
        raise ValueError(f"{source} uses the placeholders {unknown}; the known ones are "
                         f"{sorted(PLACEHOLDERS)}. Write a literal brace twice ({{{{ or }}}}).")
    if "question" not in fields:
        raise ValueError(f"{source} has no {{question}} placeholder, so every prompt would be the "
                         "same: put {question} where the question goes.")
    return text


def read_template_file(path: str | Path) -> str:
    """A user's template, checked; its text is used exactly, final newline included."""
    return check_template(Path(path).read_text(encoding="utf-8"), f"Template file {path}")


def fill_template(text: str, question: str) -> str:
    """A template's text with its placeholders filled in for `question`."""
    return text.format(question=_clean_question(question))


def without_think_instruction(text: str) -> str:
    """A template's text without THINK_INSTRUCTION, for a model that thinks natively."""
    return text.replace(THINK_INSTRUCTION, "")


def make_prompt_text(question: str, template: str = "instruct", native_thinking: bool = False) -> str:
    """The prompt as plain text, for models fed without a chat template."""
    if template not in TEMPLATES:
        raise ValueError(f"Unknown prompt template {template!r}: use one of {sorted(TEMPLATES)}.")
    text = TEMPLATES[template]
    return fill_template(without_think_instruction(text) if native_thinking else text, question)


def make_prompt(question: str, template: str = "instruct", native_thinking: bool = False) -> list[dict]:
    """The prompt as chat messages (one user turn), the form stored in the training parquet.

    For `base` the content is the raw text; the trainer decides not to apply a chat template.
    `tool` adds a system message, as verl's search-tool rows have. `native_thinking`: the model's chat
    template asks for thinking itself, so ours does not.
    """
    user = [{"role": "user", "content": make_prompt_text(question, template, native_thinking)}]
    return [{"role": "system", "content": TOOL_SYSTEM}] + user if template == "tool" else user
