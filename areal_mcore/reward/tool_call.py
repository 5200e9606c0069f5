"""Tools a multi-turn episode calls (``rollout/episodes/tool_use.py``), run like ``reward.fn``
in the reward pool's killable workers (``reward/pool.py: RewardPool.arun_tools``).

A tool is a plain function ``tool(args: str) -> str`` named by dotted path; it gets the
text the model wrote inside its call and returns the observation. What it prints is
captured and returned when it returns None (a Python-style tool). Whatever goes wrong
(it raises, overruns ``reward.tool_timeout_s``, exceeds the workers' memory limit, or
prints megabytes) becomes an observation, bounded to ``reward.tool_max_output_chars``, and
never ends the run: the model sees ``error: ...`` and may try again.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass

CALCULATOR = "areal_mcore.reward.tool_call:calculator"


@dataclass(frozen=True)
class ToolCall:
    tool: str  # package.module:function
    args: str  # the text inside the model's call


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MAX_DIGITS = 100  # a bigger intermediate is refused, not computed (9**9**9 would not end)


def calculator(args: str) -> str:
    """The value of an arithmetic expression: integers and decimals, ``+ - * / // % **``,
    unary minus and parentheses; no names, calls or attributes (it is parsed, never
    evaluated as Python). Integers stay exact; a division gives a float unless exact."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) * len(str(abs(a))) > _MAX_DIGITS:
                raise ValueError("the power is too large")
            v = _OPS[type(node.op)](a, b)
            if isinstance(v, int) and len(str(abs(v))) > _MAX_DIGITS:
                raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
            return v
        raise ValueError(f"{type(node).__name__} is not arithmetic")

    try:
        tree = ast.parse(args.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {args.strip()[:50]!r}") from None
    v = ev(tree.body)
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        v = int(v)
    return str(v)
