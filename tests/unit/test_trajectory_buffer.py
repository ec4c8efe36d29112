"""The trajectory buffer of asynchronous GRPO and its producer's schedule, without Ray: FIFO order,
the capacity bound, dropping (and counting) batches older than the staleness bound, closing, and the
versions that generate each step's batch; the side the producer names for the core lease."""

import threading
import time

import pytest

from posttrain.experience.async_rollouts import AsyncRolloutProducer, generating_version
from posttrain.experience.trajectory_buffer import BufferClosed, TrajectoryBatch, TrajectoryBuffer


def batch(index, version, size=4):
    return TrajectoryBatch({"message_log": [[]] * size}, {}, index, version, {"position": index})


def test_take_returns_batches_in_order_with_the_number_left():
    buffer = TrajectoryBuffer(capacity=3, max_age=1)
    for index in (1, 2, 3):
        buffer.put(batch(index, version=0, size=index))
    first = buffer.take(current_version=0)
    assert (first.batch.index, first.num_dropped, first.num_buffered) == (1, 0, 2 + 3)
    assert buffer.take(current_version=1).batch.index == 2
    assert len(buffer) == 1 and buffer.num_trajectories == 3


def test_batches_older_than_the_bound_are_dropped_and_counted():
    """Bound 1 at version 3: versions 0 and 1 are 3 and 2 steps old (dropped: 4 + 5 trajectories),
    version 2 is 1 step old (returned)."""
    buffer = TrajectoryBuffer(capacity=4, max_age=1)
    for index, (version, size) in enumerate([(0, 4), (1, 5), (2, 6)], start=1):
        buffer.put(batch(index, version, size))
    result = buffer.take(current_version=3)
    assert result.batch.policy_version == 2 and result.num_dropped == 9 and result.num_buffered == 0


def test_age_zero_accepts_only_the_current_version():
    buffer = TrajectoryBuffer(capacity=2, max_age=0)
    buffer.put(batch(1, version=4))
    buffer.put(batch(2, version=5))
    result = buffer.take(current_version=5)
    assert result.batch.policy_version == 5 and result.num_dropped == 4


def test_put_blocks_while_full_until_a_take():
    buffer = TrajectoryBuffer(capacity=1, max_age=0)
    buffer.put(batch(1, 0))
    waited, started = [], threading.Event()

    def produce():
        started.set()
        waited.append(buffer.put(batch(2, 0)))

    producer = threading.Thread(target=produce)
    producer.start()
    started.wait(5)  # on a loaded machine the thread may start late: time the block from its start
    time.sleep(0.3)
    assert len(buffer) == 1 and not waited  # still blocked
    assert buffer.take(0).batch.index == 1
    producer.join(5)
    assert waited and waited[0] >= 0.25 and buffer.take(0).batch.index == 2


def test_take_waits_and_reports_the_wait():
    buffer = TrajectoryBuffer(capacity=1, max_age=0)
    threading.Timer(0.3, lambda: buffer.put(batch(1, 0))).start()
    result = buffer.take(0, timeout=10)
    assert result.wait_s >= 0.25
    with pytest.raises(TimeoutError):
        buffer.take(0, timeout=0.05)


def test_close_wakes_the_taker_with_the_producers_error():
    buffer = TrajectoryBuffer(capacity=1, max_age=0)
    threading.Timer(0.1, lambda: buffer.close(cause=ValueError("env crashed"))).start()
    with pytest.raises(BufferClosed) as error:
        buffer.take(0, timeout=10)
    assert isinstance(error.value.__cause__, ValueError)
    with pytest.raises(BufferClosed):
        buffer.put(batch(1, 0))


@pytest.mark.parametrize(
    "max_age, expected", [(0, [0, 1, 2, 3, 4]), (1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2])]
)
def test_step_k_is_generated_by_version_k_minus_1_minus_the_bound(max_age, expected):
    assert [generating_version(k, 0, max_age) for k in range(1, 6)] == expected
    assert generating_version(11, 10, 2) == 10  # after a resume at step 10: never before the restored weights


def run_producer(max_age, num_steps, validate_at=()):
    """Drive a producer with plain functions: 'generation' records the version it holds and the weights
    the producer names as held (`generating_weights`, here the version number itself), 'training'
    publishes version + 1. Returns (index, generating version, trained-at version) per step."""
    held = {"version": 0}
    produced = []

    def produce(index):
        produced.append((index, held["version"], producer.generating_weights()))
        time.sleep(0.01)
        return {"message_log": [[]] * 2}, {"reward": float(index)}

    def refit(weights):
        held["version"] = weights

    producer = AsyncRolloutProducer(
        produce,
        refit,
        lambda: {"position": len(produced)},
        max_age=max_age,
        first_index=1,
        last_index=num_steps,
        start_version=0,
        generation_version=0,
    )
    producer.publish(0, 0)
    trained = []
    for version in range(num_steps):
        result, _ = producer.take(version)
        trained.append((result.batch.index, result.batch.policy_version, version, result.batch.loader_state))
        producer.publish(version + 1, version + 1)
        if version + 1 in validate_at:
            with producer.paused_at(version + 1):
                assert held["version"] == producer.generating_weights() == version + 1
    producer.stop()
    return produced, trained


@pytest.mark.parametrize("max_age", [0, 1, 2])
def test_every_batch_is_generated_by_the_scheduled_version_and_never_older_than_the_bound(max_age):
    produced, trained = run_producer(max_age, num_steps=6, validate_at=(2, 4))
    assert [index for index, *_ in trained] == [1, 2, 3, 4, 5, 6]
    for index, version, trained_at, loader_state in trained:
        assert version == generating_version(index, 0, max_age)
        assert 0 <= trained_at - version <= max_age
        assert loader_state == {"position": index}  # the loader position right after that batch's prompts
    # the generation workers really held that version while producing (validation moved them in between),
    # and the weights a replacement worker would load are that version's, not the trainer's newer ones
    expected = [generating_version(index, 0, max_age) for index in range(1, 7)]
    assert produced == [(index, version, version) for index, version in zip(range(1, 7), expected)]


def bound_1_producer(produce, lease=None):
    """A producer of steps 1..3 with age bound 1, starting at version 0, whose refit does nothing."""
    return AsyncRolloutProducer(
        produce,
        lambda weights: None,
        dict,
        max_age=1,
        first_index=1,
        last_index=3,
        start_version=0,
        generation_version=0,
        lease=lease,
    )


def test_a_failing_produce_reaches_the_trainer():
    def produce(index):
        raise RuntimeError("generation worker died")

    producer = bound_1_producer(produce)
    producer.publish(0, 0)
    with pytest.raises(BufferClosed) as error:
        producer.take(0)
    assert "generation worker died" in str(error.value.__cause__)
    producer.stop()


def test_the_core_lease_names_the_side_that_waits():
    """Bound 1, 3 steps. Nobody holds the lease while a batch is generated; once the generator has made
    step 2's batch and waits for version 1, the trainer holds it; publishing version 1 takes it back
    before `publish` returns (the trainer's next step starts with its own threads); validation gives it
    to the generator; after the last batch the trainer keeps it."""
    holders = []
    seen_while_producing = []
    step_3_may_finish = threading.Event()  # holds step 3's batch until the test has looked

    def produce(index):
        seen_while_producing.append(holders[-1] if holders else None)
        if index == 3:
            step_3_may_finish.wait(30)
        return {"message_log": [[]] * 2}, {}

    producer = bound_1_producer(produce, lease=holders.append)
    producer.publish(0, 0)
    assert holders == []  # step 1's turn has come: nobody, as at the start
    assert producer.take(0)[0].batch.index == 1
    deadline = time.monotonic() + 30
    while holders[-1:] != ["trainer"] and time.monotonic() < deadline:  # step 2's batch made with version 0
        time.sleep(0.01)
    assert holders == ["trainer"]
    producer.publish(1, 1)
    assert holders == ["trainer", None]
    step_3_may_finish.set()
    assert producer.take(1)[0].batch.index == 2
    with producer.paused_at(1):
        assert holders[-1] == "generator"
    assert producer.take(2)[0].batch.index == 3
    deadline = time.monotonic() + 30
    while holders[-1] != "trainer" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holders[-1] == "trainer"  # no batch is left to generate
    producer.stop()
    assert seen_while_producing == [None, None, None]


def test_weights_published_with_a_pause_start_no_batch_until_the_validation_ends():
    """Bound 1: step 3's batch waits for version 1. Published with `pause`, version 1 starts nothing;
    `paused_at` holds the workers at version 1 at once (no batch to wait for) and, on leaving, lets the
    producer generate step 3's batch with it."""
    produced = []
    producer = bound_1_producer(lambda index: (produced.append(index), ({"message_log": [[]] * 2}, {}))[1])
    producer.publish(0, 0)
    producer.take(0)
    assert producer.take(1)[0].batch.index == 2  # step 2's batch (version 0) is made while step 1 trains
    producer.publish(1, 1, pause=True)
    time.sleep(0.2)
    assert produced == [1, 2]  # paused: step 3's batch has not started
    with producer.paused_at(1):
        assert produced == [1, 2] and producer.generation_version == 1
    assert producer.take(2)[0].batch.index == 3 and produced == [1, 2, 3]
    producer.stop()
