"""The parker with real asyncio tasks: the leader acts only while every live follower is parked."""

from __future__ import annotations

import asyncio

import pytest

from hpref.rl.control.parking import Parker, ParkingTimeout, waiting_for


def run(coro, timeout=5.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_waiting_for_ignores_parked_and_gone():
    assert waiting_for({"b", "c", "d"}, {"c"}, {"d"}) == ["b"]
    assert waiting_for({"b"}, {"b"}, set()) == []


def test_park_is_a_no_op_when_nobody_holds():
    async def main():
        parker = Parker(["b"])
        assert await parker.park("b") is False
        with pytest.raises(ValueError, match="not a follower"):
            await parker.park("zz")

    run(main())


def test_leader_acts_only_when_every_follower_is_parked_then_releases_them():
    """Followers step at different speeds; while the leader's body runs, no follower may step."""

    async def main():
        parker = Parker(["b", "c"], name="save")
        steps = {"b": 0, "c": 0}
        stop = asyncio.Event()
        seen_during_hold = []

        async def follower(name, delay):
            while not stop.is_set():
                await parker.park(name)
                steps[name] += 1
                await asyncio.sleep(delay)
            parker.leave(name)

        tasks = [asyncio.create_task(follower("b", 0.001)), asyncio.create_task(follower("c", 0.02))]
        for _ in range(3):
            await asyncio.sleep(0.03)
            async with parker.hold(timeout=2) as parked:
                before = dict(steps)
                await asyncio.sleep(0.05)  # the "save": followers must stand still meanwhile
                seen_during_hold.append((parked, before == steps))
        after_release = dict(steps)
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*tasks)
        return seen_during_hold, after_release, steps, parker.rounds

    holds, after_release, final, rounds = run(main())
    assert rounds == 3
    assert all(parked == {"b", "c"} and still for parked, still in holds), holds
    # released followers run on (they would be stuck if release were missed)
    assert final["b"] > after_release["b"]


def test_follower_that_left_is_not_waited_for():
    async def main():
        parker = Parker(["b", "c"])
        parker.leave("c")
        park = asyncio.create_task(_later(parker))
        async with parker.hold(timeout=1) as parked:
            result = parked
        await park
        return result

    async def _later(parker):
        await asyncio.sleep(0.01)
        await parker.park("b")

    assert run(main()) == {"b"}


def test_timeout_names_the_missing_follower_and_releases_the_parked_ones():
    async def main():
        parker = Parker(["b", "c"])
        released = asyncio.Event()

        async def b():
            await asyncio.sleep(0.01)
            await parker.park("b")
            released.set()

        task = asyncio.create_task(b())
        with pytest.raises(ParkingTimeout, match=r"\['c'\] did not park within 0.1 s"):
            async with parker.hold(timeout=0.1):
                pytest.fail("the body must not run without every follower parked")
        await asyncio.wait_for(released.wait(), 1)  # b is not stranded by the failed hold
        await task
        assert not parker.requested

    run(main())


def test_a_failing_body_still_releases_followers():
    async def main():
        parker = Parker(["b"])
        task = asyncio.create_task(_park_after(parker, "b", 0.0))
        with pytest.raises(RuntimeError, match="save failed"):
            async with parker.hold(timeout=1):
                raise RuntimeError("save failed")
        assert await asyncio.wait_for(task, 1) is True

    run(main())


async def _park_after(parker, name, delay):
    await asyncio.sleep(delay)
    return await parker.park(name)


def test_a_follower_woken_late_does_not_count_as_parked_in_the_next_round():
    """Two holds back to back: the follower released from round 1 has not run yet when round 2
    starts, so round 2 must wait for it to park again rather than count its stale entry."""

    async def main():
        parker = Parker(["b"])
        order = []

        async def follower():
            for i in range(2):
                await parker.park("b")
                order.append(f"step{i}")

        async def leader():
            for i in range(2):
                async with parker.hold(timeout=1):
                    order.append(f"hold{i}")

        await asyncio.gather(leader(), follower())
        return order

    order = run(main())
    # in every hold the follower was parked at the top of a step: step0 runs between the holds
    assert order.index("hold0") < order.index("step0") < order.index("hold1") < order.index("step1")


def test_save_and_eval_parkers_are_independent():
    async def main():
        save, evaluate = Parker(["b"], "save"), Parker(["b"], "eval")
        task = asyncio.create_task(_park_after(save, "b", 0.0))
        async with save.hold(timeout=1):
            assert save.requested and not evaluate.requested
            assert await evaluate.park("b") is False  # an eval parker nobody holds never blocks
        await task

    run(main())
