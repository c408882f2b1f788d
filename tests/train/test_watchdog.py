"""The step watchdog of multi-GPU graphed runs: a step past its timeout ends the process
(after the trainer's last words); a step that finishes in time disarms it."""

from __future__ import annotations

import threading
import time

from megacpp.train.guards import StepWatchdog


def test_a_hung_step_is_ended_after_its_last_words():
    events: list[str] = []
    done = threading.Event()

    def exit_process(code: int) -> None:
        events.append(f"exit {code}")
        done.set()

    dog = StepWatchdog(0.2, lambda s: events.append(f"expired after {s:.1f}"), exit_process,
                       poll_s=0.05)
    dog.arm()
    assert done.wait(5)
    assert events[0].startswith("expired after 0.") and events[1] == "exit 1"
    dog.close()


def test_a_step_in_time_is_not_ended():
    events: list[str] = []
    dog = StepWatchdog(0.3, lambda s: events.append("expired"), lambda c: events.append("exit"),
                       poll_s=0.05)
    for _ in range(3):
        dog.arm()
        time.sleep(0.1)
        dog.disarm()
    time.sleep(0.5)
    dog.close()
    assert events == []
