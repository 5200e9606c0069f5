"""Problems -> prompt token ids through the tokenizer's chat template, with boba's filter
on prompt length (longer prompts are dropped and counted). Multiple-choice problems list
their options under the question; an optional forced prefix (eval's ``<think>\n``) is
appended after the generation prompt, so the model's response continues from it."""

from __future__ import annotations

from dataclasses import dataclass

from areal_mcore.data.jsonl import LETTERS, Problem

# boba appends this to every question (DESIGN.md, eval and training prompts alike).
BOBA_SUFFIX = "Please reason step by step, and enclose your final answer in \\boxed{}."


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]
    solutions: tuple[str, ...]
    source: str


def render_choices(question: str, choices: tuple[str, ...]) -> str:
    """The question followed by its options, one per line: ``A) ...``."""
    return question + "\n\n" + "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(choices))


def build_prompts(problems: list[Problem], tokenizer, *, max_prompt_tokens: int = 1024,
                  suffix: str | None = None, force_prefix: str | None = None) -> tuple[list[Prompt], int]:
    """(prompts that fit, number dropped for exceeding ``max_prompt_tokens``).

    ``force_prefix`` is text the response must start with; its tokens end the prompt (the
    reward still scores only the generated response).
    """
    # Encoded on its own: the templated ids stay exactly the template's, and a prefix that
    # starts with an added token (Qwen's and R1's "<think>") cannot merge across the boundary.
    prefix_ids = tokenizer.encode(force_prefix, add_special_tokens=False) if force_prefix else []
    prompts, dropped = [], 0
    for p in problems:
        if isinstance(p.prompt, str):
            text = render_choices(p.prompt, p.choices) if p.choices else p.prompt
            messages = [{"role": "user", "content": f"{text}\n{suffix}" if suffix else text}]
        else:
            messages = [{"role": r, "content": c} for r, c in p.prompt]
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]) + prefix_ids
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        prompts.append(Prompt(input_ids=ids, solutions=p.solutions, source=p.source))
    return prompts, dropped
