"""The pluggy registry: built-ins, entry points, HPREF_PLUGINS, conflicts and broken plugins."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from hpref import hookspecs
from hpref.errors import ComponentError
from hpref.hookspecs import hookimpl
from hpref.plugins import load_plugins
from tests.conftest import REPO, fake_plugin_site, run_hpref


@pytest.fixture(autouse=True)
def _fresh_registry(fresh_registry):
    """Every test here registers plugins of its own: each starts and ends with none loaded."""


class _Empty(BaseModel):
    pass


class ThrowawayPlugin:
    """A plugin object registered in-process, then forgotten (see `_fresh_registry`)."""

    __name__ = "throwaway"

    @hookimpl
    def register_rewards(self, register):
        register(name="always-a", config=_Empty, build=lambda config: "reward", description="A always wins")

    @hookimpl
    def register_formatters(self, register):
        register(name="echo", config=_Empty, build=lambda config, tokenizer, max_length: None)


def test_builtins_register_through_the_hooks():
    # Wrong if a built-in bypassed the hooks (then a third-party plugin could not do the same).
    registry = load_plugins()
    assert set(registry.components["scheduler"]) >= {"constant", "linear", "cosine", "composite"}
    builtin = {"constant", "linear", "cosine", "composite"}
    assert {c.plugin for n, c in registry.components["scheduler"].items() if n in builtin} == {
        "hpref.builtin.schedulers"
    }


def test_throwaway_plugin_components_are_registered():
    registry = load_plugins(extra=[ThrowawayPlugin()])
    reward = registry.get("reward", "always-a")
    assert reward.plugin == "throwaway" and reward.description == "A always wins"
    assert registry.get("formatter", "echo").plugin == "throwaway"


def test_duplicate_component_names_both_plugins():
    class Clash:
        __name__ = "clash"

        @hookimpl
        def register_schedulers(self, register):
            register(name="cosine", config=_Empty, build=lambda config, total_steps: None)

    with pytest.raises(
        ComponentError, match=r"scheduler 'cosine' is registered twice.*hpref\.builtin\.schedulers.*clash"
    ):
        load_plugins(extra=[Clash()])


def test_misspelt_hook_is_an_error():
    # pluggy's check_pending: a typo in a hook name must not be silently ignored.
    class Typo:
        __name__ = "typo"

        @hookimpl
        def register_schedulerz(self, register):
            pass

    with pytest.raises(Exception, match="register_schedulerz"):
        load_plugins(extra=[Typo()])


def test_unknown_component_suggests_nearest():
    registry = load_plugins()
    with pytest.raises(ComponentError, match=r"unknown scheduler 'cosin' \(did you mean 'cosine'\?\)"):
        registry.get("scheduler", "cosin")


def test_every_hook_has_a_test():
    # Meta-test: a hook spec that no test names is a contract nobody checks.
    specs = [n for n in dir(hookspecs) if n.startswith("register_")]
    corpus = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    untested = [s for s in specs if not re.search(rf"\b{s}\b", corpus)]
    assert not untested, f"hooks that no test names: {untested}"


# -- the example plugin, installed as its own distribution ------------------------------------------


def test_example_plugin_is_discovered_and_listed():
    result = run_hpref("plugins", "--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    example = plugins["example"]
    assert example["distribution"] == "hpref-example" and example["version"] == "0.1.0"
    assert set(example["hooks"]) == {
        "register_datasets",
        "register_schedulers",
        "register_commands",
        "register_algorithms",
        "register_environments",
    }
    assert set(example["components"]) == {
        "dataset:tsv-pairs",
        "scheduler:step-decay",
        "algorithm:best-of-n",
        "environment:guess-number",
        "environment:guess-number-duel",
    }


def test_a_plugin_algorithm_trains_an_rl_policy_without_touching_hpref():
    """The example plugin's `best-of-n` (rejection-sampling fine-tuning), named in a policy's
    `algorithm`, is built by the trainer from the registry and steps the policy: the best answer of
    each group gets likelier, the one it dropped is not trained on. Wrong if a plugin could not add
    an RL algorithm through `register_algorithms` (issue #38), or the trainer still assumed GRPO."""
    pytest.importorskip("torch")
    import torch

    from hpref.errors import RecipeError
    from hpref.recipe.rl import parse_rl_section
    from hpref.rl.algorithms.registry import check_algorithms
    from hpref.rl.policy import completion_logprobs, pad_batch
    from hpref.rl.rollout_types import rollout_of_tokens
    from hpref.rl.trainer.actor import TrainerActor
    from tests.rl.tiny import TINY

    data = {
        "rollout": {"group_size": 2},
        "defaults": {"model": TINY, "lr": 3e-2, "algorithm": {"name": "best-of-n", "top": 1}},
        "policies": {"a": {}},
    }
    config = parse_rl_section(data, "test")
    check_algorithms(config, ["a"], "test")
    prompts, answers = [[1, 5, 6, 3]] * 2, [[20, 21, 22], [30, 31, 32]]
    rollout = rollout_of_tokens(0, prompts, answers, [[-1.0] * 3] * 2, [0.2, 0.9], 2)
    trainer = TrainerActor("a", config.policies["a"], 1)

    def logps():
        with torch.no_grad():
            return completion_logprobs(trainer.model, pad_batch(prompts, answers, 0), 1.0).sum(-1).tolist()

    before = logps()
    stats = trainer.train(rollout)
    after = logps()
    assert stats["kept_answers"] == 1.0 and stats["loss"] == pytest.approx(-before[1] / 3, rel=1e-4)
    assert after[1] > before[1] + 0.1  # the best answer (reward 0.9) was trained on
    with pytest.raises(RecipeError, match="algorithm.top: 2 of a group of 2 keeps every answer"):
        check_algorithms(
            parse_rl_section(
                {**data, "defaults": {**data["defaults"], "algorithm": {"name": "best-of-n", "top": 2}}},
                "test",
            ),
            ["a"],
            "test",
        )


def test_a_plugin_algorithm_trains_an_episode_on_the_policys_own_tokens_only():
    """`best-of-n` on a two-turn episode row (the policy's 3 tokens, an observation of 2, its 2 more):
    its loss is the negative log-likelihood of the policy's 5 tokens over 5, the observation's
    tokens in neither the sum nor the count, and `train_tokens` says 5. Wrong if the example
    algorithm plugin authors copy trained on what the environment said, or divided by it."""
    pytest.importorskip("torch")
    import torch

    from hpref.recipe.rl import parse_rl_section
    from hpref.rl.policy import completion_logprobs, pad_batch
    from hpref.rl.rollout_types import rollout_of_tokens
    from hpref.rl.trainer.actor import TrainerActor
    from tests.rl.tiny import TINY

    data = {
        "rollout": {"group_size": 2},
        "defaults": {"model": TINY, "lr": 3e-2, "algorithm": {"name": "best-of-n", "top": 1}},
        "policies": {"a": {}},
    }
    config = parse_rl_section(data, "test")
    prompts = [[1, 5, 6, 3]] * 2
    answers = [[20, 21, 22, 40, 41, 23, 24], [30, 31, 32, 40, 41, 33, 34]]
    masks = [[1, 1, 1, 0, 0, 1, 1]] * 2
    rollout = rollout_of_tokens(0, prompts, answers, [[-1.0] * 5] * 2, [0.2, 0.9], 2, masks=masks)
    trainer = TrainerActor("a", config.policies["a"], 1)
    with torch.no_grad():  # the best episode's (reward 0.9) log-likelihood: its own tokens, every token
        own = float(completion_logprobs(trainer.model, pad_batch(prompts, answers, 0, masks), 1.0)[1].sum())
        every = float(completion_logprobs(trainer.model, pad_batch(prompts, answers, 0), 1.0)[1].sum())
    stats = trainer.train(rollout)
    assert stats["kept_answers"] == 1.0 and stats["train_tokens"] == 5.0
    assert stats["loss"] == pytest.approx(-own / 5, rel=1e-4)
    assert abs(-every / 7 - stats["loss"]) > 1e-3  # what counting the observation would have given


def test_the_plugin_environment_plays_guess_number_from_its_seed():
    """`guess-number` (the example plugin's environment): the secret comes from the episode's seed
    alone, each wrong guess is answered "higher" / "lower" as a user message (a turn without a whole
    number is asked for one), the secret ends the episode with reward 1 and success, and running out
    of guesses ends it with the closeness of the last guess. Wrong if a regenerated rollout could
    replay an episode differently, or the reward did not say how the episode went."""
    from hpref.rl.protocols import Environment, Episode
    from hpref.rl.rollout_types import Turn

    registry = load_plugins()
    component = registry.get("environment", "guess-number")
    assert component.plugin == "example"
    environment = component.build(component.config(low=1, high=9, max_guesses=3))
    assert isinstance(environment, Environment) and environment.roles == ("policy",)
    episode = environment.start(("Guess my number.",), {}, seed=7)
    assert isinstance(episode, Episode) and episode.actor() == "policy"
    secret = episode.secret
    assert environment.start(("another prompt",), {}, seed=7).secret == secret
    assert {environment.start((), {}, seed=s).secret for s in range(40)} == set(range(1, 10))

    def turn(text):
        return Turn("policy", text, (1, 2), True)

    low = 1 if secret > 1 else 2
    step = episode.step(turn(f"I guess {low}"))
    assert (step.done, step.role, step.observation) == (False, "user", "higher" if low < secret else "lower")
    step = episode.step(turn("no idea"))
    assert step.observation == "Guess a whole number from 1 to 9." and not step.done
    assert episode.step(turn(f"It is {secret}.")).done
    assert episode.rewards() == {"policy": 1.0} and episode.success() is True

    missed = environment.start((), {}, seed=7)
    wrong = 9 if secret < 9 else 1
    for _ in range(2):
        assert not missed.step(turn(str(wrong))).done
    assert missed.step(turn("still thinking")).done  # the third guess: the last allowed
    assert missed.success() is False
    assert missed.rewards() == {"policy": pytest.approx(0.5 * (1 - abs(wrong - secret) / 8))}


def test_the_plugin_two_role_environment_is_zero_sum_between_keeper_and_guesser():
    """`guess-number-duel` (the example plugin's two-role environment): the keeper acts first, from an
    opening of its own, and its number is the secret the guesser then plays guess-number against
    (told only that a number was picked: the keeper's text stays hidden); the keeper gets minus the
    guesser's reward; a keeper that writes no whole number in range forfeits (-1) and the secret is
    the one the seed draws. Wrong if the roles acted out of turn, the pick leaked to the guesser,
    the rewards were not zero-sum, or a replayed episode could draw another fallback secret."""
    from hpref.rl.protocols import Environment, Episode, OpensPerRole
    from hpref.rl.rollout_types import Turn

    component = load_plugins().get("environment", "guess-number-duel")
    assert component.plugin == "example"
    environment = component.build(component.config(low=1, high=9, max_guesses=3))
    assert isinstance(environment, Environment) and environment.roles == ("guesser", "keeper")
    episode = environment.start(("Guess my number.",), {}, seed=7)
    assert isinstance(episode, Episode) and isinstance(episode, OpensPerRole)
    assert episode.actor() == "keeper" and "from 1 to 9" in episode.opening("keeper")[0]
    assert episode.opening("guesser") == ("Guess my number.",)

    def turn(role, text):
        return Turn(role, text, (1, 2), True)

    told = episode.step(turn("keeper", "I pick 6"))
    assert (told.done, told.role) == (False, "user") and "6" not in told.observation
    assert episode.actor() == "guesser"
    assert episode.step(turn("guesser", "3")).observation == "higher"
    assert episode.step(turn("guesser", "It is 6")).done
    assert episode.rewards() == {"guesser": 1.0, "keeper": -1.0} and episode.success() is True

    hidden = environment.start((), {}, seed=7)  # a hard pick: the guesser ends two away
    hidden.step(turn("keeper", "9"))
    for guess in ("5", "6", "7"):
        hidden.step(turn("guesser", guess))
    assert hidden.success() is False
    closeness = 0.5 * (1 - 2 / 8)
    assert hidden.rewards() == pytest.approx({"guesser": closeness, "keeper": -closeness})

    drawn = component.build(component.config(low=1, high=9)).start((), {}, seed=7)
    one_role = load_plugins().get("environment", "guess-number")
    secret = one_role.build(one_role.config(low=1, high=9)).start((), {}, seed=7).secret
    for pick in ("no idea", "12", "2.5"):  # no number, out of range, not whole: forfeits
        forfeit = environment.start((), {}, seed=7)
        forfeit.step(turn("keeper", pick))
        assert forfeit.game.secret == secret == drawn.drawn
        assert forfeit.step(turn("guesser", str(secret))).done
        assert forfeit.rewards() == {"guesser": 1.0, "keeper": -1.0}


def test_the_two_role_environment_plays_through_the_joint_runner():
    """`guess-number-duel` played by hpref's joint runner (`rollout.joint.play_together`, scripted
    engines): round 1 is one request to the keeper's policy (b) with every episode, its row its own
    opening and its pick; the guesser's (a) row starts from the prompt with "your partner picked"
    added to it (never the pick itself), then its guesses with the hint between them masked; rows
    grouped per start and role; the keeper's reward is minus the guesser's. Wrong if the plugin's
    environment did not fit hpref's seams for two roles (opening, addressed observations, per-role
    rewards)."""
    import asyncio

    pytest.importorskip("torch")
    from hpref.models.causal_lm import encode_prompt, observation_ids, policy_tokenizer
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.rl.rollout.episodes import Bounds, TurnCodec
    from hpref.rl.rollout.joint import Seating, play_together
    from hpref.rl.rollout_types import Generation
    from tests.rl.tiny import TINY

    tokenizer = policy_tokenizer(PolicyModelConfig(**TINY))
    eos = tokenizer.eos_token_id
    calls = []

    async def sample(policy, prompts, contexts, seed):
        calls.append((policy, len(contexts)))
        texts = ["4" if policy == "b" else "2"] * len(contexts)  # the keeper picks 4, the guesser says 2
        completions = [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in texts]
        logprobs = [[-0.5] * len(c) for c in completions]
        return Generation([list(c) for c in contexts], completions, logprobs, texts, 1, 0, 0.0)

    component = load_plugins().get("environment", "guess-number-duel")
    environment = component.build(component.config(low=1, high=8, max_guesses=2))
    codec = TurnCodec(lambda: tokenizer)
    bounds = Bounds("", max_turns=2, max_context_tokens=256, max_new_tokens=8)
    seating = Seating({"guesser": "a", "keeper": "b"}, {"a": codec, "b": codec}, {"a": bounds, "b": bounds})
    played = asyncio.run(play_together(environment, seating, sample, [("p0",), ("p1",)], [{}, {}], 2, 5))
    assert calls == [("b", 4), ("a", 4), ("a", 4)]  # the keeper's round, then two guesses
    a, b = played["a"], played["b"]
    assert a.row_roles == ["guesser"] * 4 and b.row_roles == ["keeper"] * 4
    assert [t for t in b.transcripts] == [[("keeper", "4")]] * 4
    told = "Your partner picked a whole number from 1 to 8. Guess it."
    higher = observation_ids(tokenizer, "user", "higher")
    two = tokenizer.encode("2", add_special_tokens=False) + [eos]
    for row in range(4):  # the prompt row's message with the keeper's news added to it
        assert a.prompt_ids[row] == encode_prompt(tokenizer, (f"p{row // 2}\n\n{told}",))
        assert a.completions[row] == two + higher + two
        assert a.masks[row] == [1] * len(two) + [0] * len(higher) + [1] * len(two)
    guesser = 0.5 * (1 - 2 / 7)  # the last guess, 2, two away from 4 over the span 1..8
    assert [r["guesser"] for r in a.rewards] == pytest.approx([guesser] * 4)
    assert [r["keeper"] for r in b.rewards] == pytest.approx([-guesser] * 4)


def test_the_plugin_environment_is_listed_and_checked_as_a_component(tmp_path):
    """`hpref components environment` lists `guess-number` with plugin `example` and its parameters,
    and a recipe that names it with a parameter it does not have, or an empty range, is refused in
    one line naming the key (exit 2) before anything runs. Wrong if a plugin environment were not
    a component like hpref's own (unlisted, or its parameters unchecked)."""
    result = run_hpref("components", "environment", "--json")
    assert result.returncode == 0, result.stderr
    listed = {c["name"]: c for c in json.loads(result.stdout)}
    guess = listed["guess-number"]
    assert guess["plugin"] == "example" and listed["tool"]["plugin"] == "hpref.rl.environments.builtin"
    assert [(p["name"], p["default"]) for p in guess["parameters"]] == [
        ("low", 1),
        ("high", 16),
        ("max_guesses", 4),
    ]
    from hpref.errors import RecipeError
    from hpref.recipe.rl import parse_rl_section
    from hpref.rl.environments.registry import check_environment

    def check(environment):
        section = {"environment": environment, "policies": {"a": {}}, "reward": {"name": "rule"}}
        check_environment(parse_rl_section(section, "r.toml"), ["a"], "r.toml")

    with pytest.raises(RecipeError, match=r"^r.toml: rl.environment.colour: unknown key; valid keys: low"):
        check({"name": "guess-number", "colour": 1})
    with pytest.raises(RecipeError, match=r"^r.toml: rl.environment: high \(3\) must be above low \(5\)"):
        check({"name": "guess-number", "low": 5, "high": 3})


def test_example_components_listed_with_parameters():
    result = run_hpref("components", "scheduler", "--json")
    step = next(c for c in json.loads(result.stdout) if c["name"] == "step-decay")
    assert [(p["name"], p["type"], p["default"]) for p in step["parameters"]] == [
        ("gamma", "float", 0.5),
        ("every_fraction", "float", 0.25),
    ]


def _example_recipe(tmp_path: Path) -> Path:
    data = tmp_path / "pairs.tsv"
    data.write_text("prompt\tchosen\trejected\nhi\thello!\tgo away\n2+2?\t4\t5\nsky?\tblue\tgreen\n")
    recipe = tmp_path / "example.toml"
    recipe.write_text(
        textwrap.dedent(
            f"""
            [model]
            name = "tiny-llama"
            hidden_size = 64
            [dataset.train]
            name = "tsv-pairs"
            path = "{data}"
            [scheduler]
            name = "step-decay"
            gamma = 0.1
            """
        )
    )
    return recipe


def test_example_plugin_usable_by_name_in_a_recipe(tmp_path):
    recipe = _example_recipe(tmp_path)
    result = run_hpref("recipes", "check", str(recipe))
    assert result.returncode == 0, result.stderr
    assert "dataset.train=tsv-pairs" in result.stdout and "scheduler=step-decay" in result.stdout

    # ... and the components really build and run from the resolved recipe.
    from hpref.recipe import load_recipe

    resolved = load_recipe(recipe)
    registry = load_plugins()
    source = registry.get("dataset", "tsv-pairs").build(resolved.dataset.train.config, seed=0)
    battles = list(source.battles())
    assert len(battles) == 3 and source.summary.rows_used == 3
    assert all(sorted(b.label) == [0.0, 0.0, 1.0] for b in battles)
    multiplier = registry.get("scheduler", "step-decay").build(resolved.scheduler.config, 8)
    assert [multiplier(s) for s in (0, 1, 2, 7)] == pytest.approx([1.0, 1.0, 0.1, 0.001])


def test_example_plugin_adds_a_command():
    result = run_hpref("lr-curve", "composite", "--steps", "10", "--every", "9")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0.001000", "9", "0.001000"]


def test_empty_hpref_plugins_hides_third_party(tmp_path):
    hidden = run_hpref("plugins", "--json", env={"HPREF_PLUGINS": ""})
    names = {p["name"] for p in json.loads(hidden.stdout)["plugins"]}
    assert "example" not in names and "hpref.builtin.schedulers" in names
    result = run_hpref("recipes", "check", str(_example_recipe(tmp_path)), env={"HPREF_PLUGINS": ""})
    assert result.returncode == 2
    assert "dataset.train.name: unknown dataset 'tsv-pairs'" in result.stderr
    only = run_hpref("plugins", "--json", env={"HPREF_PLUGINS": "example"})
    assert "example" in {p["name"] for p in json.loads(only.stdout)["plugins"]}


def test_misspelt_hpref_plugins_name_is_reported(tmp_path):
    """HPREF_PLUGINS naming a plugin that is not installed is reported (with the nearest installed
    name), and a recipe needing the hidden component points at it. Wrong if the typo silently
    loaded nothing and the user saw only 'unknown scheduler'."""
    env = {"HPREF_PLUGINS": "exampel"}
    listing = json.loads(run_hpref("plugins", "--json", env=env).stdout)
    assert "example" not in {p["name"] for p in listing["plugins"]}
    assert listing["failed"] == [
        {
            "name": "exampel",
            "distribution": "-",
            "error": "named in HPREF_PLUGINS but not installed (did you mean 'example'?)",
        }
    ]
    check = run_hpref("recipes", "check", str(_example_recipe(tmp_path)), env=env)
    assert check.returncode == 2 and "'exampel' (named in HPREF_PLUGINS but not installed" in check.stderr
    # A comma list with spaces and an empty item is read as the set of names it spells.
    both = json.loads(run_hpref("plugins", "--json", env={"HPREF_PLUGINS": " example , ,"}).stdout)
    assert "example" in {p["name"] for p in both["plugins"]} and both["failed"] == []


def test_plugin_whose_hooks_raise_is_dropped_not_fatal(tmp_path):
    """A third-party plugin that imports but raises inside a hook (here `register_commands`, after it
    registered a scheduler and a first command): `--help` and every other command still work, the
    plugin is listed as failed with the hook and reason, and none of its components or commands
    remain. If this fails, one broken plugin takes the whole CLI down (exit 1, even for --help) or
    leaves half of itself registered."""
    env = fake_plugin_site(
        tmp_path,
        "raising",
        textwrap.dedent(
            """
            from pydantic import BaseModel
            from hpref.hookspecs import hookimpl

            class Config(BaseModel):
                pass

            @hookimpl
            def register_schedulers(register):
                register(name="half-registered", config=Config, build=lambda c, total_steps: None)

            @hookimpl
            def register_commands(app):
                app.command("half-command")(lambda: None)
                raise RuntimeError("needs a licence server")
            """
        ),
    )
    helped = run_hpref("--help", env=env)
    assert helped.returncode == 0, helped.stderr
    assert "half-command" not in helped.stdout and "recipes" in helped.stdout
    listing = run_hpref("plugins", "--json", env=env)
    assert listing.returncode == 0, listing.stderr
    failed = json.loads(listing.stdout)["failed"]
    assert failed == [
        {
            "name": "raising",
            "distribution": "raising-plugin",
            "error": "register_commands raised RuntimeError: needs a licence server",
        }
    ]
    assert "raising" not in {p["name"] for p in json.loads(listing.stdout)["plugins"]}
    schedulers = run_hpref("components", "scheduler", "--json", env=env)
    assert schedulers.returncode == 0 and "half-registered" not in schedulers.stdout
    assert "cosine" in schedulers.stdout


def test_broken_plugin_is_reported_not_fatal(tmp_path):
    # A third-party plugin whose import fails: the CLI still works, `plugins` names it with the
    # reason, and a recipe needing a component nobody provides points at it.
    env = fake_plugin_site(tmp_path, "broken", "raise ImportError('needs libfoo')\n")
    listing = run_hpref("plugins", "--json", env=env)
    assert listing.returncode == 0, listing.stderr
    failed = json.loads(listing.stdout)["failed"]
    assert failed == [
        {"name": "broken", "distribution": "broken-plugin", "error": "ImportError: needs libfoo"}
    ]
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\nname = "zzz-model"\n')
    check = run_hpref("recipes", "check", str(recipe), env=env)
    assert check.returncode == 2
    assert (
        "plugins that failed to load and may provide it: 'broken' (ImportError: needs libfoo)" in check.stderr
    )
