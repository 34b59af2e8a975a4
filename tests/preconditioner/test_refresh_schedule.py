"""U's RefreshSchedule: its three views of one rule agree with each other
and with the rule written out by hand, under gradient accumulation and
``refresh_until``; the host bounds never rule out a due step."""

import itertools

import keras
import numpy as np
import pytest

import keras_geosam as kg
from keras_geosam.preconditioner.schedule import RefreshSchedule


def by_hand(micro, every, until, k):
    """Due before optimizer step t = micro // k on its first micro-batch."""
    step, first = divmod(micro, k)
    return first == 0 and step % every == 0 and (until is None or step < until)


@pytest.mark.parametrize("every,until,k", list(itertools.product([1, 3, 5], [None, 7], [1, 2, 3])))
def test_device_rule_host_rule_and_bounds_agree_with_the_rule_by_hand(every, until, k):
    schedule = RefreshSchedule(every, until, accumulation=lambda: k)
    counts = np.arange(60)
    expected = [by_hand(int(m), every, until, k) for m in counts]
    device = keras.ops.convert_to_numpy(schedule.due(keras.ops.convert_to_tensor(counts, dtype="int64")))
    assert device.tolist() == expected
    assert [schedule.due_at(int(m)) for m in counts] == expected
    # The host bounds follow a counter that advances one per step: a due
    # step is never ruled out, and away from due steps the counter is
    # read rarely.
    reads = []

    def read(m):
        reads.append(m)
        return m

    allowed = [schedule.next_step(lambda m=m: read(m)) for m in counts]
    assert all(a for a, e in zip(allowed, expected) if e)
    if every * k > 2:
        assert sum(allowed) < len(counts) and len(reads) <= 2 * sum(expected) + 2


def test_the_schedule_follows_changes_between_fits_and_forgets_on_request():
    schedule = RefreshSchedule(4)
    assert [schedule.next_step(lambda m=m: m) for m in range(5)] == [True, False, False, False, True]
    schedule.every = 3  # changed between fits: read at every check
    assert [schedule.next_step(lambda m=m: m) for m in range(5, 10)] == [False, True, False, False, True]
    schedule.forget()  # e.g. the counter was reset to 0
    assert [schedule.next_step(lambda m=m: m) for m in range(4)] == [True, False, False, True]


def test_the_optimizer_and_its_U_share_one_schedule():
    opt = kg.optimizers.LLQR(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), refresh_every=3,
                             refresh_until=10)
    schedule = opt.preconditioner.schedule
    assert (schedule.every, schedule.until, schedule.in_micro_batches()) == (3, 10, (6, 20))
    opt.preconditioner.refresh_every = 5
    assert opt.refresh_every == 5 and schedule.in_micro_batches() == (10, 20)
    with pytest.raises(AttributeError, match="preconditioner.refresh_every"):
        opt.refresh_every = 2
    with pytest.raises(ValueError, match="refresh_every must be an integer >= 1"):
        opt.preconditioner.refresh_every = 0
