"""The `tool` environment (`hpref.rl.environments.tool`), its calculator and the `tool` component kind:
pure Python, no Ray and no model, so every test here takes milliseconds."""

from __future__ import annotations

import json
import threading

import pytest
from pydantic import BaseModel

from hpref.errors import DataError, RecipeError
from hpref.hookspecs import hookimpl
from hpref.plugins import load_plugins
from hpref.recipe.rl import parse_rl_section
from hpref.rl.environments.calculator import MAX_DIGITS, MAX_NODES, Calculator, calculate, format_exact
from hpref.rl.environments.registry import build_environment
from hpref.rl.environments.tool import ToolConfig, build_tool, matches_reference, parse_calls
from hpref.rl.protocols import Environment, Episode, Tool
from hpref.rl.rollout_types import Turn
from tests.conftest import run_hpref_here

PROMPT = ("What is 12*(3+4)?",)


def turn(text: str, finished: bool = True) -> Turn:
    return Turn(role="policy", text=text, tokens=(1, 2, 3), finished=finished)


class _NoParameters(BaseModel):
    pass


class _Slow:
    """Blocks until the test releases it: past any time limit, whatever the machine's speed."""

    name, description, argument = "slow", "waits for the test", "text"

    def __init__(self) -> None:
        self.release = threading.Event()

    def run(self, arguments):
        self.release.wait(30)
        return "late"


class _Boom:
    name, description, argument = "boom", "raises", "text"

    def run(self, arguments):
        raise RuntimeError("the tool broke")


class _Echo:
    """Returns its argument repeated `times` (a JSON argument), for the result-size limit."""

    name, description, argument = "echo", "repeats its text", "text"

    def run(self, arguments):
        return arguments["text"] * int(arguments.get("times", 1))


SLOW = _Slow()


class TestTools:
    """A plugin adding tools through `register_tools`, as a third party would."""

    __name__ = "test-tools"

    @hookimpl
    def register_tools(self, register):
        register(name="slow", config=_NoParameters, build=lambda config: SLOW, description="waits")
        register(name="boom", config=_NoParameters, build=lambda config: _Boom(), description="raises")
        register(name="echo", config=_NoParameters, build=lambda config: _Echo(), description="echoes")


@pytest.fixture
def plugin_tools(fresh_registry):
    load_plugins(extra=[TestTools()])
    SLOW.release.clear()
    yield
    SLOW.release.set()  # the abandoned worker thread returns


# -- the calculator ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "exact"),
    [
        ("12*(3+4)", "84"),
        ("0.1 + 0.2", "0.3"),
        ("1/3 + 1/4", "7/12"),
        ("-2/3", "-2/3"),
        ("10/4", "2.5"),
        ("-1/4", "-0.25"),
        ("2**-3", "0.125"),
        ("-2**2", "-4"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("7.5 % 2", "1.5"),
        ("+3 - -3", "6"),
        ("1.5e-3", "0.0015"),
        ("3 × 4 − 2 =", "10"),
        ("(10**999) * 10", "1" + "0" * 1000),
        ("1" + "+1" * 999, "1000"),
    ],
)
def test_the_calculator_is_exact(expression, exact):
    """Wrong if a decimal went through a float (0.1 + 0.2 would not be 0.3), a fraction were rounded
    (7/12), Python's floor-division / modulo / power semantics were changed, or the printing of an
    exact value lost digits (a 1001-digit power, a terminating decimal)."""
    assert format_exact(calculate(expression)) == exact


def test_a_big_power_is_exact_to_the_last_digit():
    """Wrong if the digit limit refused a power inside it, or the result were not the integer itself."""
    assert Calculator().run({"expression": "2**3000"}) == str(2**3000)


@pytest.mark.parametrize(
    ("expression", "refusal"),
    [
        ("1/0", "division by zero"),
        ("7 // 0", "division by zero"),
        ("5 % (2-2)", "division by zero"),
        ("0 ** -1", "division by zero (0 to a negative power)"),
        ("2 ** 0.5", "exponent 0.5 is not an integer (the result may be irrational)"),
        ("2 ** 10001", "exponent 10001 is past the limit of 10000"),
        ("2 ** 4000", f"the result would have more than {MAX_DIGITS} digits"),
        ("(10**999) * 100", f"a number past {MAX_DIGITS} digits"),
        ("9" * (MAX_DIGITS + 1), f"a number past {MAX_DIGITS} digits"),
        ("1e5000", f"'1e5000': a number past {MAX_DIGITS} digits"),
        ("1" + "+1" * MAX_NODES, f"expression too long: {2 * MAX_NODES + 1} terms and operators"),
        ("x + 1", "'x' is not allowed: only numbers, + - * / // % ** and parentheses"),
        ("__import__('os').getcwd()", "is not allowed"),
        ("abs(-3)", "'abs(-3)' is not allowed"),
        ("3 ^ 2", "'^' (a power is **) is not allowed"),
        ("~3", "'~' is not allowed"),
        ("1 < 2", "'1 < 2' is not allowed"),
        ("'a' * 3", "\"'a'\" is not a number"),
        ("True + 1", "'True' is not a number"),
        ("(1 + 2", "not an arithmetic expression: '(1 + 2'"),
        ("  = ", "empty expression"),
    ],
)
def test_the_calculator_refuses_with_a_clear_message(expression, refusal):
    """Wrong if a refusal were silent, vague or an exception other than ValueError (the environment
    shows a ValueError's message as is), or if the work bounds (digits, exponent, size) let a huge
    computation start: `2 ** 4000` must be refused before it is computed."""
    with pytest.raises(ValueError) as caught:
        calculate(expression)
    assert refusal in str(caught.value)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 200


def test_the_calculator_takes_exactly_its_one_argument():
    """Wrong if a call with a misspelt or extra argument ran on a guess instead of saying what it takes."""
    with pytest.raises(
        ValueError, match=r"calculator takes one argument, expression \(a string\); got expr='1'"
    ):
        Calculator().run({"expr": "1"})
    with pytest.raises(ValueError, match="got expression=12"):
        Calculator().run({"expression": 12})


# -- reading calls ----------------------------------------------------------------------------------


def test_both_call_forms_are_read_in_order():
    """Wrong if either form were missed, calls came out of order, the OpenAI spelling of arguments
    (a JSON string) were refused, or the short form did not pass the tool's main argument."""
    tools = {"calculator": Calculator()}
    text = (
        'First <tool_call>\n{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}\n</tool_call> '
        "then <calculator> 2**10 </calculator> and "
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1/3\\"}"}</tool_call>.'
    )
    calls = parse_calls(text, tools)
    assert [(c.name, c.arguments, c.problem) for c in calls] == [
        ("calculator", {"expression": "12*(3+4)"}, None),
        ("calculator", {"expression": "2**10"}, None),
        ("calculator", {"expression": "1/3"}, None),
    ]
    assert parse_calls("The answer is 84. <b>bold</b> 3 < 4 > 2", tools) == []


def test_a_call_left_open_is_read_to_the_end_of_a_finished_turn_only():
    """A stop string at the closing tag leaves it out of the text: wrong if such a call were not run,
    or if a turn cut at max_new_tokens in the middle of a call ran the half it wrote."""
    tools = {"calculator": Calculator()}
    (closed_by_stop,) = parse_calls("Let me compute <calculator>6*7", tools, finished=True)
    assert (closed_by_stop.arguments, closed_by_stop.problem) == ({"expression": "6*7"}, None)
    (cut,) = parse_calls("Let me compute <calculator>6*7", tools, finished=False)
    assert cut.problem == "<calculator> is not closed: the turn was cut at max_new_tokens"


# -- the episode ------------------------------------------------------------------------------------


def test_an_episode_calls_reads_the_result_then_answers():
    """The flow a runner sees: wrong if a call turn ended the episode, its observation were not the
    exact result as a tool message, the counts were off, or the final answer did not end the episode
    with the row's reference as its success (and the run's rewards, None, as its reward)."""
    environment = build_tool(ToolConfig())
    episode = environment.start(PROMPT, {"reference": "84"}, seed=3)
    assert isinstance(environment, Environment) and isinstance(episode, Episode)
    assert environment.roles == ("policy",) and episode.actor() == "policy"

    first = episode.step(turn("I will compute it. <calculator>12*(3+4)</calculator>"))
    assert (first.done, first.role, first.observation) == (False, "tool", "calculator: 84")
    assert (first.tool_calls, first.tool_errors) == (1, 0)
    second = episode.step(
        turn(
            '<tool_call>{"name": "calculator", "arguments": {"expression": "84/2"}}</tool_call>'
            "<calculator>1/3</calculator>"
        )
    )
    assert second.observation == "calculator: 42\ncalculator: 1/3"
    assert (second.tool_calls, second.tool_errors) == (2, 0)
    final = episode.step(turn("So 12*(3+4) = 84."))
    assert final.done and final.observation is None and (final.tool_calls, final.tool_errors) == (0, 0)
    assert episode.success() is True and episode.rewards() is None


def test_call_reward_rewards_a_turn_whose_calls_all_ran():
    """`call_reward`, the format reward: once per turn whose calls all ran (no more for two calls),
    none for a turn with an error or without a call, none at its default 0. Wrong: a policy paid for
    calling more often, or for a broken call."""
    environment = build_tool(ToolConfig(call_reward=0.25))
    episode = environment.start(PROMPT, {"reference": "84"}, seed=0)
    assert episode.step(turn("<calculator>12*(3+4)</calculator>")).reward == 0.25
    assert episode.step(turn("<calculator>1</calculator><calculator>2</calculator>")).reward == 0.25
    assert episode.step(turn("<calculator>1/0</calculator>")).reward is None
    assert episode.step(turn("84")).reward is None
    default = build_tool(ToolConfig()).start(PROMPT, {"reference": "84"}, seed=0)
    assert default.step(turn("<calculator>2*2</calculator>")).reward is None


def test_success_needs_a_matching_final_answer_and_a_reference():
    """Wrong if a wrong answer, or an episode a bound cut during its calls, counted as a success, or
    if a row without a reference were given a verdict (None: the environment cannot tell)."""
    environment = build_tool(ToolConfig())
    wrong = environment.start(PROMPT, {"reference": 84}, 0)
    wrong.step(turn("It is 85."))
    assert wrong.success() is False
    cut = environment.start(PROMPT, {"reference": 84}, 0)
    cut.step(turn("<calculator>12*7</calculator>"))  # the runner's max_turns ends it here
    assert cut.success() is False
    unlabelled = environment.start(PROMPT, {}, 0)
    unlabelled.step(turn("84"))
    assert unlabelled.success() is None


def test_start_depends_only_on_its_arguments():
    """Wrong if an episode kept the caller's row (a later change to it would change a replayed
    episode) or if two starts on the same arguments played differently."""
    environment = build_tool(ToolConfig())
    row = {"reference": "84"}
    episodes = [environment.start(PROMPT, row, 7), environment.start(PROMPT, row, 7)]
    row["reference"] = "0"
    observations = [e.step(turn("<calculator>2**5 - 1/8</calculator>")).observation for e in episodes]
    assert observations == ["calculator: 31.875", "calculator: 31.875"]
    for episode in episodes:
        episode.step(turn("84"))
    assert [e.success() for e in episodes] == [True, True]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
            "search: error: unknown tool 'search' (tools: calculator, slow, boom, echo)",
        ),
        (
            '<tool_call>["calculator", "1+1"]</tool_call>',
            'tool_call: error: a <tool_call> holds {"name": "<tool>", "arguments": {...}}',
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>',
            "tool_call: error: bad JSON in <tool_call>: Expecting ',' delimiter (character 57)",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
            'calculator: error: a <tool_call> holds {"name": "<tool>", "arguments": {...}}: its arguments '
            "are not an object",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>',
            "calculator: error: calculator takes one argument, expression (a string); got expr='1+1'",
        ),
        ("<calculator>1/(3-3)</calculator>", "calculator: error: division by zero"),
        (
            "<calculator>import os</calculator>",
            "calculator: error: not an arithmetic expression: 'import os' (invalid syntax)",
        ),
        ("<boom>now</boom>", "boom: error: RuntimeError: the tool broke"),
        (
            '<tool_call>{"name": "' + "x" * 100 + '"}</tool_call>',
            "x" * 40 + "...: error: unknown tool '" + "x" * 40 + "...' (tools: calculator, slow, boom, echo)",
        ),
    ],
)
def test_every_tool_error_is_an_observation(plugin_tools, text, line):
    """Wrong if a failing call raised out of `step` (that ends the run), were not shown to the policy
    as its own line saying why, or were not counted as an error."""
    environment = build_tool(ToolConfig(tools=["calculator", "slow", "boom", "echo"]))
    step = environment.start(PROMPT, {}, 0).step(turn(f"Trying: {text}"))
    assert (step.done, step.observation, step.tool_calls, step.tool_errors) == (False, line, 1, 1)


def test_calls_past_the_per_turn_cap_are_errors_not_run():
    """Wrong if a turn could run any number of calls, or the ones refused were silently dropped."""
    environment = build_tool(ToolConfig(max_calls_per_turn=2))
    step = environment.start(PROMPT, {}, 0).step(
        turn("<calculator>1</calculator>" * 2 + "<calculator>1/0</calculator>")
    )
    assert step.observation.splitlines() == [
        "calculator: 1",
        "calculator: 1",
        "calculator: error: not run: at most 2 calls per turn",
    ]
    assert (step.tool_calls, step.tool_errors) == (3, 1)


def test_a_tool_past_its_time_limit_is_an_error_and_the_episode_goes_on(plugin_tools):
    """A registered tool that never returns by itself: wrong if `step` waited for it (the run would
    hang), raised, or did not go on to the next call and the next turn."""
    environment = build_tool(ToolConfig(tools=["calculator", "slow"], time_limit_s=0.05))
    episode = environment.start(PROMPT, {"reference": "2"}, 0)
    step = episode.step(turn("<slow>hi</slow> <calculator>1+1</calculator>"))
    assert step.observation == "slow: error: no result within 0.05 s (time_limit_s)\ncalculator: 2"
    assert (step.tool_calls, step.tool_errors) == (2, 1)
    assert episode.step(turn("2")).done and episode.success() is True


def test_results_and_arguments_are_bounded(plugin_tools):
    """Wrong if a long result reached the context whole (or cut without saying so), a result's line
    breaks split it over lines, or an argument past `max_argument_chars` were run."""
    environment = build_tool(ToolConfig(tools=["echo"], max_result_chars=20))
    episode = environment.start(PROMPT, {}, 0)
    long = episode.step(
        turn('<tool_call>{"name": "echo", "arguments": {"text": "ab", "times": 50}}</tool_call>')
    )
    assert long.observation == "echo: " + "ab" * 10 + " [cut: 100 characters, max_result_chars = 20]"
    assert long.tool_errors == 0
    lines = episode.step(turn("<echo>one\ntwo</echo>"))
    assert lines.observation == "echo: one two"
    bounded = build_tool(ToolConfig(max_argument_chars=30)).start(PROMPT, {}, 0)
    too_long = bounded.step(turn("<calculator>" + "1+" * 20 + "1</calculator>"))
    assert too_long.observation == (
        "calculator: error: argument 'expression' is 41 characters long (max_argument_chars = 30)"
    )
    assert too_long.tool_errors == 1
    assert bounded.step(turn("<calculator>" + "1+" * 14 + "1</calculator>")).observation == "calculator: 15"


# -- the recipe and the component kinds --------------------------------------------------------------


def test_an_unknown_tool_in_the_recipe_is_refused_in_one_line():
    """`[rl.environment] tools` names registered tools: wrong if a misspelt one built an environment
    that fails mid-run, or the message did not name the key and the nearest tool."""
    config = parse_rl_section(
        {"policies": {"a": {}}, "environment": {"name": "tool", "tools": ["calculater"]}}, "r.toml"
    )
    with pytest.raises(RecipeError) as caught:
        build_environment(config, "r.toml")
    # the file, the key and the nearest tool, in one line
    message = "r.toml: rl.environment.tools: unknown tool 'calculater' (did you mean 'calculator'?)"
    assert str(caught.value) == message
    assert caught.value.exit_code == 2


def test_the_environment_and_the_calculator_satisfy_their_protocols():
    """Wrong if the built-ins lacked a member the runner or a plugin author relies on."""
    environment = build_environment(
        parse_rl_section({"policies": {"a": {}}, "environment": {"name": "tool"}})
    )
    assert isinstance(environment, Environment) and environment.name == "tool"
    calculator = load_plugins().get("tool", "calculator")
    built = calculator.build(calculator.config())
    assert isinstance(built, Tool) and (built.name, built.argument) == ("calculator", "expression")
    assert calculator.plugin == "hpref.rl.environments.calculator"


def test_hpref_components_lists_the_environment_and_tool_kinds():
    """Wrong if `hpref components` did not know the two new kinds, or the built-ins were missing
    from them with their parameters."""
    environments = json.loads(run_hpref_here("components", "environments", "--json").stdout)
    tool = next(c for c in environments if c["name"] == "tool")
    assert {"single-turn", "tool"} <= {c["name"] for c in environments}
    assert {p["name"]: p["default"] for p in tool["parameters"]}["tools"] == ["calculator"]
    tools = json.loads(run_hpref_here("components", "tool", "--json").stdout)
    assert [(c["kind"], c["name"], c["plugin"]) for c in tools] == [
        ("tool", "calculator", "hpref.rl.environments.calculator")
    ]


# -- the reward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "reference", "reward"),
    [
        ("12*(3+4) = 84.", "84", 1.0),
        ("The answer is 84.0", 84, 1.0),
        ("It is 1,234 in all.", "1234", 1.0),
        ("0.1 + 0.2 = 0.30", 0.3, 1.0),
        ("7/12", "7/12", 1.0),
        ("-5", "-5", 1.0),
        ("0.333", "1/3", 0.0),
        ("84, or maybe 85", "84", 0.0),
        ("I cannot tell.", "84", 0.0),
    ],
)
def test_matches_reference_compares_the_last_number_exactly(answer, reference, reward):
    """Wrong if the reward read another number than the last, compared through floats (0.333 is not a
    third), or missed the spellings of one value (84.0, 1,234, 0.30)."""
    assert matches_reference(PROMPT, answer, {"reference": reference}) == reward


def test_matches_reference_is_a_rule_reward_function_and_refuses_a_bad_reference():
    """Wrong if `[rl.reward] name = "rule"` could not load it as a row-reading function, or a
    reference that is not a number silently scored 0 instead of naming the row."""
    from hpref.builtin.rewards import RuleConfig, build_rule

    reward = build_rule(
        RuleConfig(function="hpref.rl.environments.tool:matches_reference", columns=["reference"])
    )
    assert reward.wants_rows is True
    scores = reward.score_groups([PROMPT], [["84", "It is 85", "none"]], rows=[{"reference": "84"}])
    assert scores == [[1.0, 0.0, 0.0]]
    with pytest.raises(
        DataError, match=r"the prompt row 'What is 12\*\(3\+4\)\?': reference 'eighty' is not a number"
    ):
        matches_reference(PROMPT, "84", {"reference": "eighty"})
