"""The round coordinator of the feed's --lockstep mode (pipeline/lockstep.py), with threads for tasks."""

from __future__ import annotations

import threading

import pytest

from pipeline.lockstep import RoundClient, RoundCoordinator


def run_tasks(coordinator: RoundCoordinator, chunks_per_task: list[int], log: list, fail_at: int | None = None):
    errors: list[BaseException] = []

    def task(index: int, chunks: int) -> None:
        client = RoundClient(coordinator.address, timeout=5)
        try:
            done = 0
            while True:
                if done < chunks:
                    if fail_at is not None and index == 0 and done == fail_at:
                        return  # this task dies mid-batch
                    log.append((index, done))
                    done += 1
                if not client.next_round(done < chunks):
                    return
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=task, args=(i, n)) for i, n in enumerate(chunks_per_task)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return errors


def test_no_task_starts_round_r_plus_1_before_all_finished_round_r():
    log: list[tuple[int, int]] = []
    with RoundCoordinator(3, timeout=5) as coordinator:
        errors = run_tasks(coordinator, [4, 1, 0], log)
    assert errors == []
    assert sorted(log) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    rounds = [r for _, r in log]
    assert rounds == sorted(rounds)  # the log is in round order, whatever the threads' speed


def test_a_task_that_goes_away_breaks_the_batch():
    log: list[tuple[int, int]] = []
    with RoundCoordinator(2, timeout=5) as coordinator:
        errors = run_tasks(coordinator, [3, 3], log, fail_at=1)
    assert len(errors) == 1 and isinstance(errors[0], ConnectionError)
    assert "broken" in str(errors[0])


def test_a_task_that_never_arrives_times_out():
    with RoundCoordinator(2, timeout=0.3) as coordinator:
        client = RoundClient(coordinator.address, timeout=5)
        with pytest.raises(ConnectionError, match="broken"):
            client.next_round(True)
        client.close()
