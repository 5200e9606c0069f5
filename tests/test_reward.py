"""boba reward correctness, and the worker pool under hostile input."""

import asyncio
import os
import time

import pytest

from areal_mcore.reward.boba import boba_reward, last_boxed
from areal_mcore.reward.pool import RewardItem, RewardPool, RewardPoolConfig
from bench.reward import hostile_completions

B = "\\boxed"
# (completion, gold solutions, expected reward)
TABLE = [
    # fractions, decimals, integers
    (f"so {B}{{0.5}}", ["\\frac{1}{2}"], 1.0),
    (f"{B}{{\\frac{{1}}{{2}}}}", ["0.5"], 1.0),
    (f"{B}{{\\dfrac{{3}}{{4}}}}", ["\\frac34"], 1.0),
    (f"{B}{{1/3}}", ["\\frac{1}{3}"], 1.0),
    (f"{B}{{0.33}}", ["\\frac{1}{3}"], 0.0),
    (f"{B}{{42}}", ["42"], 1.0),
    (f"{B}{{42.0}}", ["42"], 1.0),
    (f"{B}{{-7}}", ["-7"], 1.0),
    (f"{B}{{7}}", ["-7"], 0.0),
    (f"{B}{{1,000}}", ["1000"], 1.0),
    # sets and intervals
    (f"{B}{{\\{{1,2,3\\}}}}", ["\\{1,2,3\\}"], 1.0),
    (f"{B}{{\\{{3,2,1\\}}}}", ["\\{1,2,3\\}"], 1.0),
    (f"{B}{{\\{{1,2\\}}}}", ["\\{1,2,3\\}"], 0.0),
    (f"{B}{{(1, 2]}}", ["(1,2]"], 1.0),
    (f"{B}{{[1, 2]}}", ["(1,2]"], 0.0),
    (f"{B}{{(-\\infty, 3)}}", ["(-\\infty,3)"], 1.0),
    # percentages
    (f"{B}{{50\\%}}", ["0.5"], 1.0),
    (f"{B}{{50\\%}}", ["50\\%"], 1.0),
    (f"{B}{{25\\%}}", ["0.5"], 0.0),
    # LaTeX vs plain
    (f"{B}{{\\sqrt{{2}}}}", ["\\sqrt{2}"], 1.0),
    (f"{B}{{\\sqrt{{2}}}}", ["2^{1/2}"], 1.0),
    (f"{B}{{2\\sqrt{{3}}}}", ["\\sqrt{12}"], 1.0),
    (f"{B}{{\\pi}}", ["\\pi"], 1.0),
    (f"{B}{{3.14}}", ["\\pi"], 0.0),
    (f"{B}{{x^2+2x+1}}", ["(x+1)^2"], 1.0),
    (f"{B}{{x=3}}", ["3"], 1.0),
    (f"{B}{{\\text{{3}}}}", ["3"], 1.0),
    (f"{B}{{\\frac{{\\sqrt{{3}}}}{{2}}}}", ["\\frac{\\sqrt3}{2}"], 1.0),
    (f"{B}{{2^{{10}}}}", ["1024"], 1.0),
    (f"{B}{{10!}}", ["3628800"], 1.0),
    # multiple choice letters
    (f"{B}{{B}}", ["B"], 1.0),
    (f"{B}{{C}}", ["B"], 0.0),
    # no boxed answer, empty boxed
    ("The answer is 42.", ["42"], 0.0),
    (f"{B}{{}}", ["42"], 0.0),
    # several boxed answers: the last wins
    (f"first {B}{{1}} then {B}{{2}}", ["2"], 1.0),
    (f"first {B}{{2}} then {B}{{1}}", ["2"], 0.0),
    ("\\fbox{5}", ["5"], 1.0),
    # any of the solutions
    (f"{B}{{4}}", ["3", "4"], 1.0),
    (f"{B}{{5}}", ["3", "4"], 0.0),
    # gold given as a boxed solution text
    (f"{B}{{12}}", ["We get \\boxed{12}."], 1.0),
    (f"{B}{{12}}", ["We get \\boxed{13}."], 0.0),
    # boxed content with nested braces
    (f"{B}{{\\frac{{1}}{{\\frac{{1}}{{2}}}}}}", ["2"], 1.0),
]


def test_table_has_at_least_40_pairs():
    assert len(TABLE) >= 40


@pytest.mark.parametrize("completion, solutions, expected", TABLE)
def test_boba_reward_table(completion, solutions, expected):
    assert boba_reward(completion, solutions) == expected


def test_last_boxed_handles_nesting_and_unbalanced():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} \\boxed{2") is None
    assert last_boxed("nothing") is None


def _children() -> list[int]:
    """Live child processes of this process (from /proc)."""
    me, kids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                kids.append(int(entry))
    return kids


@pytest.mark.slow
def test_pool_survives_hostile_completions_without_leaks():
    cfg = RewardPoolConfig(num_workers=2, timeout_s=2.0, memory_mb=1024)
    before = set(_children())
    pool = RewardPool(cfg)
    # 4 rounds of the 13 hostile kinds (each with its own timeouts and worker
    # replacements); 200 items (15 rounds) took 25 s and proved nothing more.
    items = hostile_completions(52)
    t0 = time.monotonic()
    rewards = pool.score([c for c, _, _ in items], [s for _, s, _ in items])
    elapsed = time.monotonic() - t0
    assert all(r in (0.0, expected) for r, (_, _, expected) in zip(rewards, items, strict=True))
    assert max(pool.latencies) <= cfg.timeout_s + 1.0, f"slowest item {max(pool.latencies):.2f}s"
    # Still serving normal requests, with the same number of live workers.
    assert pool.score([f"{B}{{0.5}}", f"{B}{{3}}"], [["\\frac12"], ["4"]]) == [1.0, 0.0]
    assert len(set(_children()) - before) == cfg.num_workers
    pool.close()
    assert set(_children()) - before == set()
    print(f"{len(items)} hostile items in {elapsed:.1f}s, timeouts {pool.timeouts}, crashes {pool.crashes}")


def test_pool_scores_in_order_and_validates_lengths():
    with RewardPool(RewardPoolConfig(num_workers=2, timeout_s=5.0)) as pool:
        assert pool.score([f"{B}{{{i}}}" for i in range(6)], [[str(i)] for i in (0, 1, 9, 3, 9, 5)]) == \
            [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
        with pytest.raises(ValueError, match="2 completions but 1 solution lists"):
            pool.score(["a", "b"], [["1"]])


def test_overrunning_item_is_killed_counted_and_its_worker_replaced():
    # 9^387420489: verifying it runs until a timeout cuts it (measured: 30 s at a 30 s
    # timeout). A long sum (the old item) was slow only while the worker's LaTeX parser
    # warmed up (0.9 s the first time, 0.01 s after), and scored inside the deadline once
    # the parser was warm. Workers now warm it before they are ready: the quick item's
    # 0.5 s is its own (a cold worker's first parse overran it on a loaded CI machine).
    slow = f"{B}{{9^{{9^{{9}}}}}}"
    before = set(_children())
    with RewardPool(RewardPoolConfig(num_workers=2, timeout_s=0.5)) as pool:
        first = pool.worker_pids()
        assert pool.score([slow, f"{B}{{2}}"], [["1"], ["2"]]) == [0.0, 1.0]
        assert pool.timeouts == 1 and max(pool.latencies) <= 0.5 + 1.0
        assert len(set(pool.worker_pids()) & set(first)) == 1  # one worker was replaced
        assert pool.score([f"{B}{{3}}"], [["3"]]) == [1.0]
        assert len(set(_children()) - before) == 2
    assert set(_children()) - before == set()


def test_workers_that_cannot_start_raise_instead_of_looping():
    with pytest.raises(RuntimeError, match="memory_mb=16 too low"):
        with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=2.0, memory_mb=16)) as pool:
            pool.score([f"{B}{{1}}"], [["1"]])


@pytest.mark.parametrize("fn, why", [
    ("no_such_module:f", "reward.fn='no_such_module:f' cannot be imported: ModuleNotFoundError"),
    ("_rewards:missing", "reward.fn='_rewards:missing' names no function"),
    ("_rewards", "reward.fn='_rewards' must look like 'package.module:function'"),
    ("_rewards:not_a_function", "reward.fn='_rewards:not_a_function' is not callable"),
    ("_rewards:too_few_args", r"reward.fn='_rewards:too_few_args' has the wrong signature "
                              r"too_few_args\(completion, solutions\)"),
])
def test_a_bad_reward_fn_path_or_signature_is_refused_at_load_naming_the_key(fn, why):
    from areal_mcore.config import ConfigError, InferenceConfig, load_config

    with pytest.raises(ConfigError, match=why):
        load_config(None, [f"reward.fn={fn}"], schema=InferenceConfig)


def test_a_dotted_path_reward_gets_prompt_and_ids_and_its_raises_score_zero_and_are_counted():
    from areal_mcore.reward.pool import RewardCounts, RewardItem

    items = [RewardItem(prompt="p", completion="c", prompt_ids=[1, 2], completion_ids=[5] * n,
                        solutions=["1"], fields={"source": "f:1", "level": 0}) for n in (1, 2, 4)]
    counts = RewardCounts()
    with RewardPool(RewardPoolConfig(fn="_rewards:parity_reward", num_workers=1)) as pool:
        assert pool.score_items(items, counts) == [1.0, 0.0, 0.0]  # 4 tokens: it raised
        assert (counts.errors, counts.timeouts, pool.errors) == (1, 0, 1)


def test_tools_that_hang_raise_print_a_megabyte_or_exhaust_memory_become_observations_without_leaks():
    """Tool calls run in the pool's workers (reward/tool_call.py): every failure is an ``error:``
    observation within the tool's deadline, the output is cut, the pool keeps its worker
    count and leaves no process behind; and what a reward function prints (stdout, fd 1,
    stderr) does not break the workers' answers."""
    from areal_mcore.reward.tool_call import CALCULATOR, ToolCall

    before = set(_children())
    cfg = RewardPoolConfig(fn="_rewards:noisy_reward", num_workers=2, tool_timeout_s=1.0, tool_max_output_chars=100,
                           memory_mb=1024)
    with RewardPool(cfg) as pool:
        calls = [ToolCall(CALCULATOR, "37 * 48"), ToolCall("_rewards:hanging_tool", ""),
                 ToolCall("_rewards:raising_tool", "x"), ToolCall("_rewards:chatty_tool", ""),
                 ToolCall("_rewards:greedy_tool", ""), ToolCall(CALCULATOR, "2 ** 10 - 1 / 0"),
                 ToolCall(CALCULATOR, "__import__('os')"), ToolCall("no_such_module:tool", "")]
        t0 = time.monotonic()
        out = pool.run_tools(calls)
        # Bounded: each answer within the tool's 1 s and a poll (workers are replaced
        # between calls, ~1-2 s each on a loaded 2-core machine).
        assert time.monotonic() - t0 < 30.0 and max(pool.latencies) <= 1.0 + 2.0
        assert out[0] == "1776"
        assert out[1] == "error: the tool ran past 1 s and was stopped"
        assert out[2] == "error: RuntimeError: no tool for 'x'"
        assert out[3].startswith("x" * 100 + "... [") and len(out[3]) < 200
        assert out[4].startswith("error: MemoryError") or out[4].startswith("error: the tool failed")
        assert out[5] == "error: ZeroDivisionError: division by zero"
        assert out[6] == "error: ValueError: Call is not arithmetic"
        assert out[7].startswith("error: ValueError: cannot be imported")
        assert pool.errors == pool.timeouts == 0  # tool failures are observations, not reward errors
        assert pool.score(["ab", "abc"], [["1"], ["1"]]) == [0.0, 1.0]

        # Callers on one event loop (an async run's rollouts, its eval, its tools) take
        # turns: two threads in the pool at once mixed up their workers' answers.
        async def together():
            items = [RewardItem(completion="x" * n, solutions=["1"]) for n in range(40)]
            return await asyncio.gather(pool.ascore(items[:20]), pool.ascore(items[20:]),
                                        pool.arun_tools([ToolCall(CALCULATOR, f"{n} * 3") for n in range(10)]))

        first, second, tools = asyncio.run(together())
        assert first + second == [float(n % 2) for n in range(40)] and tools == [str(3 * n) for n in range(10)]
        assert len(set(_children()) - before) == cfg.num_workers
    assert set(_children()) - before == set()
