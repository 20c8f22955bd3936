"""Self-tests: what every inner pytest session they start inherits."""

import os

# An inner session is a pytest parent that computes next to nothing itself; with one intra-op
# thread, torch starts no thread pool in it, so the session stays single-threaded and its zygote is
# forked from it instead of importing torch again (~2 s of CPU per session; see
# harness.process.zygote_fork). Ranks get OMP_NUM_THREADS=1 anyway (harness.process.launcher). A user's own
# setting is kept: its sessions then start their zygotes cold.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The self-tests the torch legs of CI leave out (.ci/torch-leg runs `-m "not torch_independent"`):
# those whose subject is the session's own logic, which reads what ranks report and never what
# torch did. The rule: a module here drives no torch.distributed machinery below the harness's
# own API (no tracer, dispatcher hooks, faults, replicas, torchrun or trace_script, no backend):
# its ranks at most block in a plain collective to be stopped. Everything else, and the whole
# conformance suite, runs on every torch CI proves (docs/ci.md). tests/test_torch_legs.py holds a
# module here to the rule.
TORCH_INDEPENDENT = {
    "tests/harness_tests/test_preflight.py": "usage errors decided before any rank starts",
    "tests/harness_tests/test_pytest_timeout.py": "pytest-timeout's limits as the deadlines of distributed tests",
    "tests/harness_tests/test_reports.py": "the per-rank report files' contents",
    "tests/harness_tests/test_repro.py": "the REPRO line and the options it carries",
    "tests/harness_tests/test_session_ends.py": "what an interrupted or stopped session reports",
    "tests/harness_tests/test_shared_helpers.py": "helpers of the self-tests",
    "tests/harness_tests/test_world_sizes.py": "which world sizes a session runs",
    "tests/harness_tests/test_warm_pytest.py": "the self-tests' forked inner sessions",
}


def pytest_configure(config) -> None:
    from tests.support import cuda_runtime_guard

    cuda_runtime_guard.install()
    config.addinivalue_line(
        "markers", "torch_independent: a self-test of the session's own logic; CI's torch legs leave it out"
    )


def pytest_collection_modifyitems(config, items) -> None:
    import pytest

    for item in items:
        path = item.path.relative_to(config.rootpath).as_posix() if item.path.is_relative_to(config.rootpath) else ""
        if path in TORCH_INDEPENDENT:
            item.add_marker(pytest.mark.torch_independent)


# Every phase of a self-test is held to not asking the CUDA runtime in pytest's own process
# (tests/support/cuda_runtime_guard.py says why: it would make the zygote's forks unable to use CUDA).
def _guarded(phase: str):
    import pytest

    @pytest.hookimpl(wrapper=True)
    def hook(item):
        from tests.support import cuda_runtime_guard

        cuda_runtime_guard.forget()
        result = yield
        cuda_runtime_guard.check(phase)
        return result

    return hook


pytest_runtest_setup = _guarded("setup")
pytest_runtest_call = _guarded("call")
pytest_runtest_teardown = _guarded("teardown")
