"""Prompt templates that teach the search-and-answer format.

The tags are the contract with the agent loop and the rewards: the model reasons in <think>,
asks in <search>, reads <information> (written by the environment), and ends with <answer>.
Both templates say the same thing; the base one reads as a document to continue, the instruct
one speaks to the assistant and is sent through the model's chat template.
"""
from __future__ import annotations

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

# "base": raw text, no chat template applied; "instruct": wrapped by the tokenizer's chat template.
TEMPLATES: dict[str, str] = {"base": _BASE, "instruct": _INSTRUCT}


def _clean_question(question: str) -> str:
    # Many QA sets (NQ, TriviaQA) store questions in lower case without the question mark.
    question = question.strip()
    return question if question.endswith("?") else question + "?"


def make_prompt_text(question: str, template: str = "instruct") -> str:
    """The prompt as plain text, for models fed without a chat template."""
    if template not in TEMPLATES:
        raise ValueError(f"Unknown prompt template {template!r}: use one of {sorted(TEMPLATES)}.")
    return TEMPLATES[template].format(question=_clean_question(question))


def make_prompt(question: str, template: str = "instruct") -> list[dict]:
    """The prompt as chat messages (one user turn), the form stored in the training parquet.

    For `base` the content is the raw text; the trainer decides not to apply a chat template.
    """
    return [{"role": "user", "content": make_prompt_text(question, template)}]
