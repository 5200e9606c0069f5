"""Problems -> prompt token ids through the tokenizer's chat template, with boba's filter
on prompt length (longer prompts are dropped and counted). Multiple-choice problems list
their options under the question; an optional forced prefix (``<think>\n``) is appended
after the generation prompt, so the model's response continues from it.

``prompts_for(dataset_cfg, tokenizer)`` is the one way training, its periodic eval,
``areal-mcore eval`` and the filters turn a dataset into prompts: the instruction and the
thinking prefix come from the dataset's config, so an eval with the run's config sees the
prompts the run trained on (an eval that appended boba's instruction to the tiny task's
own one scored 0.07 on a model the run had just measured at 0.51).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mcore.data.jsonl import LETTERS, DatasetConfig, Problem, load_problems

# boba appends this to every question, eval and training prompts alike (docs/recipe.md).
BOBA_SUFFIX = "Please reason step by step, and enclose your final answer in \\boxed{}."
THINK = "<think>\n"


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]
    solutions: tuple[str, ...]
    source: str
    fields: dict = field(default_factory=dict, compare=False)  # the row's other columns (reward.fn)


def render_choices(question: str, choices: tuple[str, ...]) -> str:
    """The question followed by its options, one per line: ``A) ...``."""
    return question + "\n\n" + "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(choices))


def instruction_for(problem: Problem, instruction: str | None) -> str:
    """The text appended to ``problem``'s question under ``DatasetConfig.instruction``."""
    if instruction is None or not isinstance(problem.prompt, str):
        return ""
    if instruction == "auto":
        # Rows that already say how to answer (boba's release, the synthetic task) keep
        # their own wording; a second instruction is a prompt the model never saw.
        return "" if "\\boxed" in problem.prompt else BOBA_SUFFIX
    return instruction


def think_prefix(tokenizer, mode: str) -> str | None:
    """``"<think>\\n"`` when responses must start with it, else None.

    auto: when the chat template mentions ``<think>`` (a reasoning model); always: for any
    template. Never when the generation prompt already ends with ``<think>`` (newer R1
    templates open the block themselves), which would open it twice.
    """
    if mode == "never":
        return None
    template = tokenizer.chat_template
    template = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
    generation = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}],
                                               add_generation_prompt=True, tokenize=False)
    if generation.rstrip().endswith("<think>"):
        return None
    return THINK if mode == "always" or "<think>" in template else None


@dataclass(frozen=True)
class PromptSet:
    prompts: list[Prompt]
    dropped_long: int  # over max_prompt_tokens
    problems: list[Problem]  # every problem loaded, dropped ones included
    response_prefix: str  # "" or "<think>\n"
    instructions: dict[str, int]  # instruction text ("" for none) -> problems given it


def prompts_for(cfg: DatasetConfig, tokenizer, *, max_prompt_tokens: int = 1 << 62,
                problems: list[Problem] | None = None) -> PromptSet:
    """The dataset's prompts with its instruction and thinking prefix (see module doc).

    Args:
        cfg: the dataset; ``instruction`` and ``think`` shape the prompt.
        tokenizer: its chat template renders the question.
        max_prompt_tokens: longer prompts are dropped and counted.
        problems: already loaded (and e.g. choice-shuffled) problems of ``cfg``; None loads them.
    """
    if problems is None:
        problems, _ = load_problems(cfg)
    prefix = think_prefix(tokenizer, cfg.think) or ""
    instructions: dict[str, int] = {}
    for p in problems:
        text = instruction_for(p, cfg.instruction)
        instructions[text] = instructions.get(text, 0) + 1
    prompts, dropped = build_prompts(problems, tokenizer, max_prompt_tokens=max_prompt_tokens,
                                     suffix=cfg.instruction, force_prefix=prefix or None)
    return PromptSet(prompts=prompts, dropped_long=dropped, problems=problems, response_prefix=prefix,
                     instructions=instructions)


def build_prompts(problems: list[Problem], tokenizer, *, max_prompt_tokens: int = 1024,
                  suffix: str | None = None, force_prefix: str | None = None) -> tuple[list[Prompt], int]:
    """(prompts that fit, number dropped for exceeding ``max_prompt_tokens``).

    ``suffix`` is appended to each question on its own line (``"auto"``: as
    :func:`instruction_for` decides per problem). ``force_prefix`` is text the response
    must start with; its tokens end the prompt (the reward still scores only the
    generated response).
    """
    # Encoded on its own: the templated ids stay exactly the template's, and a prefix that
    # starts with an added token (Qwen's and R1's "<think>") cannot merge across the boundary.
    prefix_ids = tokenizer.encode(force_prefix, add_special_tokens=False) if force_prefix else []
    prompts, dropped = [], 0
    for p in problems:
        if isinstance(p.prompt, str):
            text = render_choices(p.prompt, p.choices) if p.choices else p.prompt
            extra = instruction_for(p, suffix)
            messages = [{"role": "user", "content": f"{text}\n{extra}" if extra else text}]
        else:
            messages = [{"role": r, "content": c} for r, c in p.prompt]
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]) + prefix_ids
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        prompts.append(Prompt(input_ids=ids, solutions=p.solutions, source=p.source, fields=p.fields))
    return prompts, dropped
