"""The built-in `calculator` tool (`register_tools`): exact arithmetic on one expression.

The expression is parsed by `ast` and evaluated node by node, never by `eval`: numbers (integers,
decimals, `1e3`) become `fractions.Fraction`, so `0.1 + 0.2` is `0.3` and `1/3` stays a third; the
operators are `+ - * / // % **`, the unary signs and parentheses; anything else (a name, a call, a
comparison, `^`) is refused. The work is bounded here, because the `tool` environment's time limit
can only stop waiting for a tool, not stop it: a number past `MAX_DIGITS` digits (a literal or a
result), an exponent past `MAX_EXPONENT` and an expression past `MAX_NODES` nodes are refused before
anything large is computed. The result is printed exactly: an integer, a terminating decimal, else
`a/b`.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict

from hpref.hookspecs import hookimpl

#: the most digits a number may have, in the expression or in any result along the way
MAX_DIGITS = 1000
#: the largest exponent `**` takes (the digit limit then bounds its result)
MAX_EXPONENT = 10_000
#: the most syntax-tree nodes an expression may have (numbers and operators)
MAX_NODES = 2000

_MAX_BITS = math.ceil(MAX_DIGITS / math.log10(2))
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
}
_ALLOWED = "only numbers, + - * / // % ** and parentheses"
_SYMBOLS = {
    ast.BitXor: "'^' (a power is **)",
    ast.MatMult: "'@'",
    ast.BitAnd: "'&'",
    ast.BitOr: "'|'",
    ast.LShift: "'<<'",
    ast.RShift: "'>>'",
    ast.Invert: "'~'",
    ast.Not: "'not'",
}
# a decimal literal as the expression spells it (read exactly, not through a float)
_DECIMAL = re.compile(r"(?P<mantissa>[0-9_]*\.?[0-9_]*)(?:[eE](?P<exponent>[+-]?[0-9_]+))?")
# what a model writes for the operators (×, ÷, the minus sign) and a trailing "=" it asks with
_SPELLINGS = str.maketrans({"×": "*", "÷": "/", "−": "-"})


class CalculatorConfig(BaseModel):
    """No parameters: the limits are the calculator's own (`MAX_DIGITS`, `MAX_EXPONENT`, `MAX_NODES`)."""

    model_config = ConfigDict(extra="forbid")


class Calculator:
    """Exact arithmetic on one expression (`expression`): `12*(3+4)` -> `84`, `1/3 + 1/4` -> `7/12`."""

    name = "calculator"
    description = (
        "exact arithmetic on one expression: numbers, + - * / // % ** and parentheses; prints an integer, "
        "a decimal or a fraction a/b"
    )
    argument = "expression"

    def run(self, arguments: dict[str, Any]) -> str:
        """The exact value of `arguments["expression"]`; a `ValueError` saying what is refused."""
        if set(arguments) != {self.argument} or not isinstance(arguments[self.argument], str):
            got = ", ".join(f"{k}={v!r}" for k, v in arguments.items()) or "nothing"
            raise ValueError(f"calculator takes one argument, expression (a string); got {got}")
        return format_exact(calculate(arguments[self.argument]))


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; a `ValueError` for anything refused."""
    text = expression.translate(_SPELLINGS).strip().rstrip("=").strip()
    if not text:
        raise ValueError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {_shown(text)} ({exc.msg})") from None
    except (RecursionError, MemoryError, ValueError):  # nested past the parser's depth; a huge literal
        raise ValueError(f"expression too deeply nested or too large: {_shown(text)}") from None
    nodes = sum(isinstance(node, ast.expr) for node in ast.walk(tree.body))
    if nodes > MAX_NODES:
        raise ValueError(f"expression too long: {nodes} terms and operators (at most {MAX_NODES})")
    return _evaluate(tree.body, text)


def _evaluate(root: ast.expr, text: str) -> Fraction:
    """Post-order over the tree with an explicit stack: a long chain (`1+1+...+1`) is deep, and a
    recursive walk would hit Python's recursion limit."""
    pending: list[tuple[ast.expr, bool]] = [(root, False)]
    values: list[Fraction] = []
    while pending:
        node, operands_done = pending.pop()
        if isinstance(node, ast.Constant):
            values.append(_number(node, text))
        elif isinstance(node, ast.BinOp) and not operands_done:
            pending += [(node, True), (node.right, False), (node.left, False)]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub) and not operands_done:
            pending += [(node, True), (node.operand, False)]
        elif isinstance(node, ast.BinOp):
            right, left = values.pop(), values.pop()
            values.append(_bounded(_binary(node.op, left, right)))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
            value = values.pop()
            values.append(-value if isinstance(node.op, ast.USub) else value)
        else:
            raise ValueError(f"{_refused(node, text)} is not allowed: {_ALLOWED}")
    return values.pop()


def _refused(node: ast.expr, text: str) -> str:
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return _SYMBOLS.get(type(node.op), f"'{type(node.op).__name__}'")
    return _shown(ast.get_source_segment(text, node) or type(node).__name__)


def _shown(text: str) -> str:
    """`text` quoted for a message, its first 40 characters."""
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _number(node: ast.Constant, text: str) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{_shown(ast.get_source_segment(text, node) or '')} is not a number")
    if isinstance(value, int):
        return _bounded(Fraction(value))
    spelt = ast.get_source_segment(text, node) or ""
    match = _DECIMAL.fullmatch(spelt)
    if match is None:  # not reachable from a float literal Python parses; refused rather than guessed
        raise ValueError(f"{_shown(spelt)} is not a decimal number")
    digits = len(match["mantissa"].replace("_", "").replace(".", ""))
    exponent = int(match["exponent"] or 0)
    if digits > MAX_DIGITS or abs(exponent) > MAX_DIGITS:
        raise ValueError(f"{_shown(spelt)}: a number past {MAX_DIGITS} digits")
    return _bounded(Fraction(spelt))


def _binary(op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    if isinstance(op, ast.Pow):
        return _power(left, right)
    function = _BINARY.get(type(op))
    if function is None:
        raise ValueError(f"{_SYMBOLS.get(type(op), repr(type(op).__name__))} is not allowed: {_ALLOWED}")
    if right == 0 and isinstance(op, ast.Div | ast.FloorDiv | ast.Mod):
        raise ValueError("division by zero")
    return function(left, right)


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError(
            f"exponent {format_exact(exponent)} is not an integer (the result may be irrational)"
        )
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is past the limit of {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ValueError("division by zero (0 to a negative power)")
    # estimated before computing (the result's size is the base's times the exponent); `_bounded`
    # then checks the exact result, a few bits past the estimate at most
    size = max(math.log2(abs(base.numerator)) if base else 0.0, math.log2(base.denominator))
    if size * abs(int(exponent)) > _MAX_BITS + 1:
        raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
    return base ** int(exponent)


def _bounded(value: Fraction) -> Fraction:
    if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise ValueError(f"a number past {MAX_DIGITS} digits")
    return value


def format_exact(value: Fraction) -> str:
    """`value` exactly: `84`, `-3.5`, `0.125` (a denominator of only 2s and 5s), else `1/3`."""
    if value.denominator == 1:
        return str(value.numerator)
    twos = fives = 0
    rest = value.denominator
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    whole, fraction = divmod(scaled, 10**places)
    sign = "-" if value < 0 else ""
    return f"{sign}{whole}.{str(fraction).rjust(places, '0').rstrip('0')}"


def build_calculator(config: CalculatorConfig) -> Calculator:
    """Exact arithmetic on one expression: numbers, + - * / // % ** and parentheses."""
    return Calculator()


@hookimpl
def register_tools(register):
    register(name="calculator", config=CalculatorConfig, build=build_calculator)
