"""The fault matrix (issue #16): every kind of fault a test can cause inside its ranks, in one session.

One inner pytest session (world size 2) runs each fault followed by a healthy test. The outer tests
check, from the files a CI reads: every test pytest reported is in both per-rank JUnit files with
pytest's verdict and its cause on each rank; each verdict came within its bound (pytest's own
--junitxml times each test); the healthy test after each fault passes (state the fault changed was
put back, or the ranks were replaced); and no process is left once the session is over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Case, InnerSession, leftover_processes, read_cases, wait_for_no_leftovers

COLLECTIVE_TIMEOUT = 3
TEST_TIMEOUT = 6
GRACE = 2
PYTEST_TIMEOUT = 3
FLOOD = 50 * 2**20  # bytes a rank writes to stdout in test_g
FLOOD_TAIL = b"\nlast line of the flood\n"
CAPTURE = 256 * 1024  # bytes of each stream the parent keeps (harness.session.pool_session)

MATRIX = rf"""
import faulthandler, os, signal, subprocess, sys, threading, time
import pytest, torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

HERE = os.path.dirname(os.path.abspath(__file__))
W = pytest.mark.world_size(2)


def healthy(rank, world_size):
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    assert t.tolist() == [float(sum(range(world_size)))] * 4
    for module in (dist, c10d):  # still the harness's traced entry point, not a test's patch
        assert hasattr(module.all_reduce, "__trace_original__"), module.all_reduce


def note_pid(name, rank):
    with open(os.path.join(HERE, f"pid-{{name}}-{{rank}}"), "w") as handle:
        handle.write(str(os.getpid()))


def pid_of(name, rank):
    with open(os.path.join(HERE, f"pid-{{name}}-{{rank}}")) as handle:
        return int(handle.read())


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("__str__ itself fails")


@W
def test_0_first_pool_starts(rank, world_size): healthy(rank, world_size)

@W
def test_a_raise(rank):
    note_pid("a", rank)
    print(f"rank {{rank}} about to fail")
    if rank == 1:
        raise ValueError("boom on rank 1")

@W
def test_a_ok(rank, world_size): healthy(rank, world_size)

@W
def test_b_sys_exit(rank):
    if rank == 1:
        sys.exit(3)

@W
def test_b_ok(rank, world_size): healthy(rank, world_size)

@W
def test_c_keyboard_interrupt_in_a_rank(rank):
    if rank == 1:
        raise KeyboardInterrupt

@W
def test_c_ok(rank, world_size): healthy(rank, world_size)

@W
def test_d_exceptions_of_any_shape(rank):
    if rank == 0:
        raise ExceptionGroup("two at once", [ValueError("first"), TypeError("second")])
    raise BadStr()

@W
def test_d_ok(rank, world_size):
    healthy(rank, world_size)
    assert pid_of("a", rank) == os.getpid(), "a clean failure must keep the warm ranks"

@W
@pytest.mark.parametrize("lock", [threading.Lock()], ids=["lock"])
def test_e_unpicklable_parameter(rank, lock):
    pass

@pytest.fixture
def parent_lock():
    return threading.Lock()

@W
def test_e_unpicklable_fixture(rank, parent_lock):
    pass

@W
def test_e_ok(rank, world_size): healthy(rank, world_size)

@W
def test_f_invalid_xml_characters(rank):
    os.write(1, b"control \x00\x01\x08\x0b\x1b[31m and invalid utf-8 \xff\xfe\n")
    if rank == 1:
        raise ValueError("message with \x00 and \x0b and \ud800")

@W
def test_f_ok(rank, world_size): healthy(rank, world_size)

@W
def test_g_50_mb_of_output(rank):
    if rank == 1:
        os.write(1, b"x" * {FLOOD})
        os.write(1, {FLOOD_TAIL!r})
        raise ValueError("after the flood")

@W
def test_g_ok(rank, world_size): healthy(rank, world_size)

@W
def test_h_monkeypatched_dist_all_reduce(rank):
    dist.all_reduce = lambda *args, **kwargs: None

@W
def test_h_ok(rank, world_size): healthy(rank, world_size)

@W
def test_i_monkeypatched_c10d_all_reduce(rank):
    c10d.all_reduce = lambda *args, **kwargs: None
    c10d.broadcast = lambda *args, **kwargs: None

@W
def test_i_ok(rank, world_size): healthy(rank, world_size)

@W
def test_j_dup2_over_stdout(rank):
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    print("into the void", flush=True)

@W
def test_j_ok(rank, world_size):
    healthy(rank, world_size)
    print(f"rank {{rank}} is visible again")

@W
def test_k_own_signal_handlers_and_timers(rank):
    signal.signal(signal.SIGUSR1, lambda *args: None)  # would silence the parent's stack dumps
    signal.signal(signal.SIGTERM, lambda *args: None)
    signal.setitimer(signal.ITIMER_REAL, 30)  # SIGALRM in a later test would kill the rank
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR2}})
    faulthandler.disable()

@W
def test_k_ok(rank, world_size):
    healthy(rank, world_size)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert faulthandler.is_enabled()

@W
def test_l_children_left_running(rank):
    pids = [subprocess.Popen(["sleep", "300"], start_new_session=True).pid]
    child = os.fork()
    if child == 0:
        time.sleep(300)
        os._exit(0)
    pids.append(child)
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:  # a daemon: new session, double fork, its parent exits at once
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            time.sleep(300)
            os._exit(0)
        os.write(write, str(daemon).encode())
        os._exit(0)
    os.waitpid(middle, 0)
    pids.append(int(os.read(read, 32)))
    with open(os.path.join(HERE, f"children-{{rank}}"), "w") as handle:
        handle.write(" ".join(map(str, pids)))

@W
def test_l_ok(rank, world_size):
    healthy(rank, world_size)
    with open(os.path.join(HERE, f"children-{{rank}}")) as handle:
        pids = [int(pid) for pid in handle.read().split()]
    assert [pid for pid in pids if os.path.exists(f"/proc/{{pid}}")] == []

@W
def test_m_destroyed_default_group(rank):
    note_pid("m", rank)
    dist.destroy_process_group()

@W
def test_m_ok(rank, world_size):
    healthy(rank, world_size)
    assert pid_of("m", rank) != os.getpid(), "a rank without its world must be replaced"

@W
def test_n_os_exit(rank):
    if rank == 1:
        os._exit(7)
    dist.barrier()

@W
def test_n_ok(rank, world_size): healthy(rank, world_size)

@W
def test_o_sigkill(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()

@W
def test_o_ok(rank, world_size): healthy(rank, world_size)

@W
def test_p_segfault(rank):
    if rank == 0:
        import ctypes
        ctypes.string_at(0)
    dist.barrier()

@W
def test_p_ok(rank, world_size): healthy(rank, world_size)

@W
def test_q_abort(rank):
    if rank == 1:
        os.abort()
    dist.barrier()

@W
def test_q_ok(rank, world_size): healthy(rank, world_size)

@W
def test_r_mismatched_collective(rank):
    dist.all_reduce(torch.ones(4 if rank == 0 else 8))

@W
def test_r_ok(rank, world_size): healthy(rank, world_size)

@W
def test_s_exception_then_abort(rank, mismatch_in_teardown):
    if rank == 1:
        raise ValueError("the Python error comes first")

@W
def test_s_ok(rank, world_size): healthy(rank, world_size)

@W
def test_t_forked_child_holds_the_pipe(rank):
    if rank == 1:
        if os.fork() == 0:
            time.sleep(300)
            os._exit(0)
        os._exit(3)
    dist.barrier()

@W
def test_t_ok(rank, world_size): healthy(rank, world_size)

@W
def test_u_hang_in_collective(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(2))

@W
def test_u_ok(rank, world_size): healthy(rank, world_size)

@W
def test_v_hang_in_python(rank):
    if rank == 1:
        while True:
            time.sleep(0.05)
    dist.barrier()

@W
def test_v_ok(rank, world_size): healthy(rank, world_size)

@W
def test_w_every_rank_hangs(rank):
    while True:
        time.sleep(0.05)

@W
def test_w_ok(rank, world_size): healthy(rank, world_size)

@W
@pytest.mark.timeout({PYTEST_TIMEOUT})
def test_x_pytest_timeout(rank):
    if rank == 1:
        time.sleep(3600)

@W
def test_x_ok(rank, world_size): healthy(rank, world_size)
"""

FIXTURES = """
import torch, torch.distributed as dist
from harness import rank_fixture

@rank_fixture
def mismatch_in_teardown(ctx):
    yield
    # gloo aborts the rank that receives more than it expects: rank 1, the one whose test raised
    dist.all_reduce(torch.ones(8 if ctx.rank == 0 else 4))
"""


@dataclass(frozen=True)
class Expect:
    """A fault's verdict, what each rank's file must say (regex on message + text) and its time bound."""

    verdict: str
    rank0: str
    rank1: str
    seconds: float


DEATH_S = 3 + GRACE  # a dead rank is seen at once; its peer fails on the closed connection or after the grace
ONE_SIDED_S = 3 + 2  # the traces are polled every 0.25 s, then stacks (up to 2 s)
CLEAN_S = 3
ELSEWHERE = r"failed on another rank \(this rank: (passed|failed)\)"
EXPECTED = {
    "test_a_raise": Expect("failed", ELSEWHERE, r"ValueError: boom on rank 1", CLEAN_S),
    "test_b_sys_exit": Expect("failed", ELSEWHERE, r"SystemExit: 3", CLEAN_S),
    "test_c_keyboard_interrupt_in_a_rank": Expect("failed", ELSEWHERE, r"^KeyboardInterrupt", CLEAN_S),
    "test_d_exceptions_of_any_shape": Expect(
        "failed",
        r"ExceptionGroup: two at once.*ValueError: first.*TypeError: second",
        r"BadStr: <str\(\) of the exception raised RuntimeError>",
        CLEAN_S,
    ),
    "test_e_unpicklable_parameter[lock]": Expect(
        "failed", r"argument 'lock' of .* cannot be sent to the ranks", r"argument 'lock' .* cannot be sent", CLEAN_S
    ),
    "test_e_unpicklable_fixture": Expect(
        "failed", r"argument 'parent_lock' .* cannot be sent to the ranks", r"'parent_lock' .* cannot be sent", CLEAN_S
    ),
    "test_f_invalid_xml_characters": Expect("failed", ELSEWHERE, "ValueError: message with \ufffd and \ufffd", CLEAN_S),
    "test_g_50_mb_of_output": Expect("failed", ELSEWHERE, r"ValueError: after the flood", 15),
    "test_l_children_left_running": Expect("passed", "", "", CLEAN_S),
    "test_m_destroyed_default_group": Expect("passed", "", "", CLEAN_S),
    "test_n_os_exit": Expect("failed", r".", r"^rank 1 exited with code 7", DEATH_S),
    "test_o_sigkill": Expect("failed", r".", r"^rank 1 was killed by SIGKILL", DEATH_S),
    "test_p_segfault": Expect("failed", r"rank 0 was killed by SIGSEGV.*Segmentation fault", r".", DEATH_S),
    "test_q_abort": Expect("failed", r".", r"^rank 1 was killed by SIGABRT", DEATH_S),
    "test_r_mismatched_collective": Expect("failed", r".", r".", DEATH_S),
    "test_s_exception_then_abort": Expect(
        "failed", r".", r"^rank 1 was killed by SIGABRT \(6\), after raising ValueError: the Python error", DEATH_S
    ),
    "test_t_forked_child_holds_the_pipe": Expect("failed", r".", r"^rank 1 exited with code 3", DEATH_S),
    "test_u_hang_in_collective": Expect(  # no collective timeout: its peer finished (harness.trace.one_sided)
        "failed",
        r"stopped by the harness [\d.]+ s into the test: waited alone in collective #1 on group \[0, 1\]",
        r"ranks issued divergent collectives: collective #1 on group \[0, 1\]: rank 1 issued none",
        ONE_SIDED_S,
    ),
    "test_v_hang_in_python": Expect(
        "failed",
        r".",
        r"rank 1 hung: still running .* after another rank failed.*in test_v_hang_in_python",
        COLLECTIVE_TIMEOUT + GRACE + 5,
    ),
    "test_w_every_rank_hangs": Expect(
        "failed",
        rf"rank 0 hung: no result within the {TEST_TIMEOUT} s test deadline.*in test_w_every_rank_hangs",
        r"rank 1 hung.*in test_w_every_rank_hangs",
        TEST_TIMEOUT + 5,
    ),
    "test_x_pytest_timeout": Expect(  # its limit is the ranks' deadline (harness.config.deadlines)
        "failed",
        ELSEWHERE,
        rf"rank 1 hung: no result within the {PYTEST_TIMEOUT} s test deadline "
        rf"\(pytest-timeout @pytest.mark.timeout\({PYTEST_TIMEOUT}\)\).*in test_x_pytest_timeout",
        PYTEST_TIMEOUT + 5,
    ),
}
PASSING = {"test_h_monkeypatched_dist_all_reduce", "test_i_monkeypatched_c10d_all_reduce", "test_j_dup2_over_stdout"}
PASSING |= {"test_k_own_signal_handlers_and_timers"}
HEALTHY_S = 5  # the test after a fault starts the next pool: forks from the zygote and a rendezvous
FIRST_S = 90  # the session's first pool: the zygote imports torch (seconds; a loaded machine is slower)


@dataclass
class MatrixRun:
    inner: InnerSession
    output: str
    returncode: int
    pytest_cases: dict[str, Case]
    ranks: dict[int, dict[str, Case]]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> MatrixRun:
    inner = InnerSession(tmp_path_factory.mktemp("matrix"))
    inner.write("test_matrix.py", MATRIX)
    inner.write("matrix_fixtures.py", FIXTURES)
    result = inner.run(
        "-o",
        "rank_fixture_modules=matrix_fixtures",
        f"--collective-timeout={COLLECTIVE_TIMEOUT}",
        f"--test-timeout={TEST_TIMEOUT}",
        f"--straggler-grace={GRACE}",
        "--junitxml=pytest.xml",
        "-q",
    )
    return MatrixRun(
        inner,
        result.stdout + result.stderr,
        result.returncode,
        read_cases(inner.directory / "pytest.xml"),
        {rank: read_cases(inner.junit(rank)) for rank in (0, 1)},
    )


def test_every_reported_test_is_in_every_rank_file_with_pytest_verdict(matrix: MatrixRun) -> None:
    assert matrix.returncode == 1, matrix.output
    healthy = {n for n in matrix.pytest_cases if n.endswith("_ok") or n.startswith("test_0")}
    assert set(matrix.pytest_cases) == set(EXPECTED) | PASSING | healthy
    assert (
        len([n for n in matrix.pytest_cases if n.endswith("_ok")]) == 24
        and "test_0_first_pool_starts" in matrix.pytest_cases
    )
    for rank in (0, 1):
        assert set(matrix.ranks[rank]) == set(matrix.pytest_cases), rank
        for name, case in matrix.pytest_cases.items():
            assert matrix.ranks[rank][name].status == case.status, (rank, name, matrix.ranks[rank][name])


def test_each_fault_fails_only_its_test_with_its_cause_on_each_rank(matrix: MatrixRun) -> None:
    for name, case in matrix.pytest_cases.items():
        expected = EXPECTED.get(name)
        if expected is None:
            assert case.status == "passed", (name, case.message, case.text[-3000:])
            continue
        assert case.status == expected.verdict, (name, case)
        for rank, pattern in ((0, expected.rank0), (1, expected.rank1)):
            got = matrix.ranks[rank][name]
            assert re.search(pattern, f"{got.message}\n{got.text}", re.S), (name, rank, got.message, got.text[:3000])


def test_a_hang_names_the_collective_each_rank_was_stuck_in(matrix: MatrixRun) -> None:
    text = matrix.pytest_cases["test_u_hang_in_collective"].text
    assert "unfinished collectives: rank 0 in collective #1 on group [0, 1]: all_reduce 2 float32" in text, text


def test_each_verdict_comes_within_its_bound(matrix: MatrixRun) -> None:
    slow = {
        name: round(case.time_s, 1)
        for name, case in matrix.pytest_cases.items()
        if case.time_s
        > (EXPECTED[name].seconds if name in EXPECTED else FIRST_S if name.startswith("test_0") else HEALTHY_S)
    }
    assert slow == {}, slow


# A lost rank's time in its file: what the parent measured from sending the task until it found
# the rank dead or gave up on it. Lower bounds where the harness waited on purpose.
LOST_AT_LEAST = {
    ("test_v_hang_in_python", 1): COLLECTIVE_TIMEOUT + GRACE,  # rank 0 times out, then the grace
    ("test_w_every_rank_hangs", 0): TEST_TIMEOUT,
    ("test_w_every_rank_hangs", 1): TEST_TIMEOUT,
    ("test_x_pytest_timeout", 1): PYTEST_TIMEOUT,  # from the dispatch, as --test-timeout
}
LOST = re.compile(r"^rank \d (was killed by|exited with code|hung|was still running|closed its pipe)")


def test_each_rank_file_has_the_rank_s_own_duration_lost_ranks_included(matrix: MatrixRun) -> None:
    lost = set()
    for name, case in matrix.pytest_cases.items():
        for rank in (0, 1):
            got = matrix.ranks[rank][name]
            # A rank's part of a test lies within pytest's time for the whole test (ms rounding).
            assert got.time_s <= case.time_s + 0.002, (name, rank, got.time_s, case.time_s)
            if LOST.match(got.message):
                lost.add((name, rank))
                assert got.time_s >= LOST_AT_LEAST.get((name, rank), 0.001), (name, rank, got.time_s, got.message)
    assert set(LOST_AT_LEAST) <= lost
    assert len(lost) >= 11, sorted(lost)  # every death and hang of the matrix has a lost rank


def test_what_each_rank_printed_survives_with_exact_cut_notices(matrix: MatrixRun) -> None:
    rank1 = matrix.ranks[1]
    assert rank1["test_a_raise"].stdout.strip() == "rank 1 about to fail"
    assert matrix.ranks[0]["test_a_raise"].stdout.strip() == "rank 0 about to fail"
    flood = rank1["test_g_50_mb_of_output"].stdout
    dropped = FLOOD + len(FLOOD_TAIL) - CAPTURE
    assert flood.startswith(f"[... {dropped} bytes cut ...]\n") and flood.endswith(FLOOD_TAIL.decode()), flood[:80]
    assert "\ufffd" in rank1["test_f_invalid_xml_characters"].stdout
    assert rank1["test_j_ok"].stdout.strip() == "rank 1 is visible again"
    assert "fd 1 was redirected by the test; restored" in rank1["test_j_dup2_over_stdout"].stderr
    ended = rank1["test_l_children_left_running"].stderr
    assert re.search(r"ended 3 process\(es\) the test left running: \d+ \(sleep\), \d+ \(python\S*\)", ended), ended


def test_the_session_leaves_no_process_and_no_run_directory(matrix: MatrixRun) -> None:
    assert wait_for_no_leftovers(matrix.inner.marker) == []
    assert leftover_processes(matrix.inner.marker) == []
    assert list(Path(matrix.inner.directory).glob("fsdp-harness-*")) == []


def test_state_isolation_needs_no_restart_but_deaths_and_hangs_do(matrix: MatrixRun) -> None:
    summary = re.search(r"(\d+) distributed tests, (\d+) pool starts, (\d+) rank processes;", matrix.output)
    assert summary is not None, matrix.output[-2000:]  # no "(spawned, not forked: ...)": the zygote forked them all
    tests, starts, launched = map(int, summary.groups())
    assert tests == len(matrix.pytest_cases)
    assert starts == 1 + 12, summary.group(0)  # the first pool, then one after each of m and n to x
    assert launched == 2 * starts, summary.group(0)
