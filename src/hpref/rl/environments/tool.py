"""`tool`: the policy calls tools written in its answer, over several turns, then answers.

A turn's text is read for calls in two forms: the Hermes / Qwen form that verl's and TRL's tool
parsers read, `<tool_call>{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}</tool_call>`,
and a short one for small models, `<calculator>12*(3+4)</calculator>` (the tool's one main argument,
`Tool.argument`). A turn with calls is answered by a "tool" observation, each call's result (or its
error) on a line of its own, `calculator: 84`; a turn without one is the final answer and ends the
episode (the runner ends it earlier at `[rl.environment] max_turns`). A call left open at the end of
a finished turn is read to the end, so a stop string at the closing tag (`stop = ["</calculator>"]`:
the engines cut the text before it) works.

Whatever goes wrong with a call (an unknown tool, bad JSON, a wrong argument, an exception in the
tool, its time limit, an argument too long, one call too many) is a line `<tool>: error: <why>` the
policy reads, counted in `Step.tool_errors`, never an exception out of `step`.

The reward is the run's (`rewards()` is None): the shipped recipe scores the final answer with
`matches_reference` below as a `rule` function; `success()` is the same test, when the row has a
`reference`.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hpref.rl.rollout_types import Step, Turn

if TYPE_CHECKING:
    from hpref.rl.protocols import Tool

Prompt = tuple[str, ...]

ROLE = "policy"
HERMES = "tool_call"  # the tag of the Hermes / Qwen form (whose JSON names the tool)


class ToolConfig(BaseModel):
    """`[rl.environment] name = "tool"`: the tools the policy may call and the limits of one call."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        min_length=1,
        description="registered tools the policy may call (see `hpref components tool`)",
    )
    max_calls_per_turn: int = Field(
        4, ge=1, description="calls run per turn; each one past it is an error line, not run"
    )
    time_limit_s: float = Field(
        2.0, gt=0, description="seconds the environment waits for one call's result; past it, an error line"
    )
    max_result_chars: int = Field(
        512, ge=16, description="a longer result (or error) is cut to this many characters, with a marker"
    )
    max_argument_chars: int = Field(
        1024, ge=1, description="the longest argument a call may pass; a longer one is an error, not run"
    )
    call_reward: float = Field(
        0.0,
        ge=0,
        description="a per-turn reward for a turn whose calls all ran without error (a format reward, as "
        "tool-use RL recipes add while a policy has never called the tool), added to the episode's",
    )

    @field_validator("tools")
    @classmethod
    def _each_once(cls, tools: list[str]) -> list[str]:
        twice = sorted({t for t in tools if tools.count(t) > 1})
        if twice:
            raise ValueError(f"named more than once: {', '.join(twice)}")
        return tools


@dataclass(frozen=True)
class Call:
    """One call read from a turn: the tool's name and its arguments, or why it cannot run."""

    name: str
    arguments: dict[str, Any]
    problem: str | None = None


def parse_calls(text: str, tools: dict[str, Tool], finished: bool = True) -> list[Call]:
    """Every call in `text`, in order: `<tool_call>{json}</tool_call>` and `<name>arg</name>` for each
    tool of `tools`. A call left open at the end is read to the end of a `finished` turn (its closing
    tag was a stop string) and is malformed in one cut at `max_new_tokens`."""
    opening = re.compile("<(" + "|".join(re.escape(t) for t in (HERMES, *tools)) + ")>")
    calls = []
    position = 0
    while (match := opening.search(text, position)) is not None:
        tag = match[1]
        close = text.find(f"</{tag}>", match.end())
        if close < 0 and not finished:
            calls.append(Call(tag, {}, f"<{tag}> is not closed: the turn was cut at max_new_tokens"))
            break
        body = text[match.end() : close if close >= 0 else len(text)]
        calls.append(_hermes(body) if tag == HERMES else Call(tag, {tools[tag].argument: body.strip()}))
        if close < 0:
            break
        position = close + len(tag) + 3
    return calls


def _hermes(body: str) -> Call:
    """`{"name": ..., "arguments": {...}}`; `arguments` may also be a JSON string of an object (the
    OpenAI tool-call spelling)."""
    shape = 'a <tool_call> holds {"name": "<tool>", "arguments": {...}}'
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return Call(HERMES, {}, f"bad JSON in <tool_call>: {exc.msg} (character {exc.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Call(HERMES, {}, shape)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # refused below as not an object
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return Call(call["name"], {}, f"{shape}: its arguments are not an object")
    return Call(call["name"], arguments)


class ToolEnvironment:
    name = "tool"
    roles = (ROLE,)

    def __init__(self, config: ToolConfig, tools: dict[str, Tool]) -> None:
        self.config = config
        #: registered name -> tool, in the recipe's order
        self.tools = tools

    def start(self, prompt: Prompt, row: dict[str, Any], seed: int) -> ToolEpisode:
        """The tools are deterministic: `seed` changes nothing."""
        return ToolEpisode(self, tuple(prompt), dict(row))

    def run_calls(self, calls: list[Call]) -> tuple[list[str], int]:
        """One observation line per call (the first `max_calls_per_turn` run, the rest refused) and
        how many of them are errors."""
        lines, errors = [], 0
        for index, call in enumerate(calls):
            if index >= self.config.max_calls_per_turn:
                outcome, ok = f"not run: at most {self.config.max_calls_per_turn} calls per turn", False
            else:
                outcome, ok = self._run(call)
            errors += not ok
            lines.append(f"{_short(call.name)}: {self._cut(outcome if ok else 'error: ' + outcome)}")
        return lines, errors

    def _run(self, call: Call) -> tuple[str, bool]:
        """(result, True) or (what went wrong, False)."""
        if call.problem is not None:
            return call.problem, False
        tool = self.tools.get(call.name)
        if tool is None:
            return f"unknown tool '{_short(call.name)}' (tools: {', '.join(self.tools)})", False
        limit = self.config.max_argument_chars
        for key, value in call.arguments.items():
            size = len(value if isinstance(value, str) else json.dumps(value))
            if size > limit:
                return f"argument '{key}' is {size} characters long (max_argument_chars = {limit})", False
        return _run_with_limit(tool, dict(call.arguments), self.config.time_limit_s)

    def _cut(self, text: str) -> str:
        """On one line (a result's own line breaks become spaces), at most `max_result_chars` of it."""
        flat = " ".join(text.splitlines())
        limit = self.config.max_result_chars
        if len(flat) <= limit:
            return flat
        return f"{flat[:limit]} [cut: {len(flat)} characters, max_result_chars = {limit}]"


def _short(name: str) -> str:
    """A tool's name as a line shows it: a policy may write any name, of any length."""
    return name if len(name) <= 40 else name[:40] + "..."


def _run_with_limit(tool: Tool, arguments: dict[str, Any], seconds: float) -> tuple[str, bool]:
    """`tool.run(arguments)` on a worker thread, waited for `seconds`. Python cannot kill a thread:
    past the limit the call is abandoned (a daemon thread, so it never holds the process open) and
    keeps its CPU until it returns, which is why a tool bounds its own work (the calculator refuses
    huge numbers and exponents before computing them)."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["result"] = tool.run(arguments)
        except Exception as exc:  # what a tool raises is the policy's to read, never the run's end
            outcome["error"] = exc

    worker = threading.Thread(target=call, name=f"hpref-tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        return f"no result within {seconds:g} s (time_limit_s)", False
    if "error" in outcome:
        exc = outcome["error"]
        message = str(exc) or type(exc).__name__
        return (message if isinstance(exc, ValueError) else f"{type(exc).__name__}: {message}"), False
    return str(outcome["result"]), True


class ToolEpisode:
    def __init__(self, environment: ToolEnvironment, prompt: Prompt, row: dict[str, Any]) -> None:
        self._environment = environment
        self._prompt = prompt
        self._row = row
        #: the final answer, once a turn without a call gave it
        self.answer: str | None = None

    def actor(self) -> str:
        return ROLE

    def step(self, turn: Turn) -> Step:
        calls = parse_calls(turn.text, self._environment.tools, turn.finished)
        if not calls:
            self.answer = turn.text
            return Step(done=True)
        lines, errors = self._environment.run_calls(calls)
        # a format reward, once per turn (no gain in calling twice): only for calls that all ran
        reward = self._environment.config.call_reward if errors == 0 else 0.0
        return Step(
            observation="\n".join(lines),
            role="tool",
            tool_calls=len(calls),
            tool_errors=errors,
            reward=reward or None,
        )

    def rewards(self) -> dict[str, float] | None:
        return None

    def success(self) -> bool | None:
        """The final answer matches the row's `reference` (`matches_reference`); False when the
        episode ended without one (a bound cut it during its calls); None without a reference."""
        if "reference" not in self._row:
            return None
        return self.answer is not None and matches_reference(self._prompt, self.answer, self._row) == 1.0


def build_tool(config: ToolConfig) -> ToolEnvironment:
    """The policy calls tools written in its answer (a calculator, or a plugin's), over several turns."""
    from hpref.errors import ComponentError, RecipeError
    from hpref.plugins import load_plugins

    registry = load_plugins()
    tools = {}
    for name in config.tools:
        try:
            component = registry.get("tool", name)
        except ComponentError as exc:
            raise RecipeError(f"rl.environment.tools: {exc}") from None
        tools[name] = component.build(component.config())
    return ToolEnvironment(config, tools)


# a number as an answer writes it: a sign, thousands grouped by commas, a decimal part, or a fraction
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_number(text: str) -> Fraction | None:
    """The last number written in `text`, exactly (`1,234.5`, `-3`, `7/2`), or None."""
    for spelt in reversed(_NUMBER.findall(text)):
        try:
            return Fraction(spelt.replace(",", ""))
        except ZeroDivisionError:  # `1/0` is no number: the one before it may be
            continue
    return None


def matches_reference(prompt: Prompt, answer: str, row: dict[str, Any]) -> float:
    """A `rule` reward function (`function = "hpref.rl.environments.tool:matches_reference"`,
    `columns = ["reference"]`): 1.0 when the last number in the answer equals the row's `reference`
    exactly (`0.30` and `0.3` are equal, `0.333` and `1/3` are not), else 0.0. A reference that is
    not a number is a `DataError` naming the row's prompt."""
    reference = _reference(prompt, row)
    value = last_number(answer)
    return float(value is not None and value == reference)


def _reference(prompt: Prompt, row: dict[str, Any]) -> Fraction:
    from hpref.errors import DataError

    where = f"the prompt row {prompt[-1][:60]!r}" if prompt else "a prompt row"
    if "reference" not in row:
        raise DataError(f"{where} has no 'reference' column (matches_reference compares with it)")
    value = row["reference"]
    try:
        if isinstance(value, bool):
            raise ValueError
        return Fraction(str(value).strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        raise DataError(
            f"{where}: reference {value!r} is not a number (matches_reference compares numbers)"
        ) from None
