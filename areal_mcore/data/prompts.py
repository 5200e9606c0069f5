"""Problems -> prompt token ids through the tokenizer's chat template, with boba's filter
on prompt length (longer prompts are dropped and counted)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_mcore.data.jsonl import Problem

# boba appends this to every question (DESIGN.md, eval and training prompts alike).
BOBA_SUFFIX = "Please reason step by step, and enclose your final answer in \\boxed{}."


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]
    solutions: tuple[str, ...]
    source: str


def build_prompts(problems: list[Problem], tokenizer, *, max_prompt_tokens: int = 1024,
                  suffix: str | None = None) -> tuple[list[Prompt], int]:
    """(prompts that fit, number dropped for exceeding ``max_prompt_tokens``)."""
    prompts, dropped = [], 0
    for p in problems:
        if isinstance(p.prompt, str):
            messages = [{"role": "user", "content": f"{p.prompt}\n{suffix}" if suffix else p.prompt}]
        else:
            messages = [{"role": r, "content": c} for r, c in p.prompt]
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        prompts.append(Prompt(input_ids=ids, solutions=p.solutions, source=p.source))
    return prompts, dropped
