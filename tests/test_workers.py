"""ringnet.workers: jobs in order on one thread, idle between them, gone when idle long; a
job in flight at exit finished where asked; a job's failure shown, the worker going on."""
import subprocess
import sys
import threading
import time

from ringnet.workers import Worker


def test_jobs_run_in_order_on_one_thread_that_ends_when_idle():
    worker = Worker("w-test", idle_s=0.3)
    seen = []
    done = [worker.submit(lambda i=i: seen.append((i, threading.current_thread())))
            for i in range(20)]
    assert done[-1].wait(5)
    assert [i for i, _ in seen] == list(range(20))
    threads = {t for _, t in seen}
    assert len(threads) == 1
    (thread,) = threads
    assert thread.daemon and thread.name == "w-test (idle)"
    thread.join(5)
    assert not thread.is_alive()
    assert worker.submit(lambda: seen.append((20, threading.current_thread()))).wait(5)
    assert seen[-1][1] is not thread                 # a new thread for the next job
    assert worker.wait_idle(5)


def test_a_failing_job_is_shown_and_the_worker_goes_on(capfd):
    worker = Worker("w-fail", idle_s=0.3)

    def bad():
        raise ValueError("job broke")
    assert worker.submit(bad).wait(5)
    assert worker.submit(lambda: None).wait(5)
    assert "ValueError: job broke" in capfd.readouterr().err


SCRIPT = """
import sys, time
from ringnet.workers import Worker
worker = Worker("w-exit", finish_at_exit=sys.argv[2] == "finish")
def write():
    time.sleep(0.5)
    open(sys.argv[1], "w").write("done")
worker.submit(write)
"""


def test_a_job_in_flight_at_exit_is_finished_where_asked(tmp_path):
    for mode, kept in (("finish", True), ("leave", False)):
        out = tmp_path / f"{mode}.txt"
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", SCRIPT, str(out), mode], check=True, timeout=60)
        assert out.exists() == kept, mode
        if not kept:
            time.sleep(1.0)                  # not written later either: the job was stopped
            assert not out.exists()
        assert time.monotonic() - started < 30     # an idle worker does not hold the exit
