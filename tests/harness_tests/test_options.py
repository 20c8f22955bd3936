"""Bad input fails at once with an error that names the fix; devices are chosen as documented."""

from __future__ import annotations

import re

import pytest

from conftest import InnerSession, leftover_processes
from harness.config.devices import DevicePlan, DeviceTally, plan_devices

BAD_MARKERS = {
    "world_size(0)": "world_size must be >= 1, got 0",
    "world_size('two')": "world_size must be an int or a list of ints, got 'two'",
    "world_size([])": "world_size list is empty",
    "world_size(2, 4)": "use @pytest.mark.world_size(N)",
}
_COLLECTION_ERROR = re.compile(r"\n_+ ERROR collecting (\S+) _+\n")


@pytest.fixture(scope="module")
def bad_marker_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One session collecting a module per bad marker (pytest reports every collection error
    before it stops): each module's error text, by marker. One session rather than one each
    (~1 s of CPU apiece); that no rank reported anything is checked here, for all of them."""
    inner = InnerSession(tmp_path_factory.mktemp("bad_markers"))
    modules = {}
    for index, marker in enumerate(BAD_MARKERS):
        modules[f"test_bad_{index}.py"] = marker
        inner.write(f"test_bad_{index}.py", f"import pytest\n@pytest.mark.{marker}\ndef test_x(rank):\n    pass\n")
    result = inner.run("-q")
    assert result.returncode != 0, result.stdout
    assert inner.rank_files() == []  # collection errors: no test ran, so no rank reports one
    assert leftover_processes(inner.marker) == []
    # Each section ends where the next starts; the last one at the summary, which names them all.
    parts = _COLLECTION_ERROR.split(result.stdout.split("short test summary info")[0])
    errors = {modules[name]: text for name, text in zip(parts[1::2], parts[2::2]) if name in modules}
    assert sorted(errors) == sorted(BAD_MARKERS), result.stdout
    return errors


@pytest.mark.parametrize("marker", BAD_MARKERS)
def test_bad_world_size_marker(bad_marker_errors: dict[str, str], marker: str) -> None:
    assert BAD_MARKERS[marker] in bad_marker_errors[marker], bad_marker_errors[marker]


def test_unknown_device(inner: InnerSession) -> None:
    result = inner.run("--device", "tpu")
    assert result.returncode == 4
    assert "invalid choice: 'tpu'" in result.stderr and "'cpu'" in result.stderr


def test_unwritable_reports_dir(inner: InnerSession) -> None:
    blocker = inner.write("a_file", "")
    result = inner.run("--reports-dir", str(blocker / "sub"))
    assert result.returncode == 4
    assert "is not writable" in result.stderr and "--reports-dir" in result.stderr


def test_non_positive_timeout(inner: InnerSession) -> None:
    result = inner.run("--collective-timeout", "0")
    assert result.returncode == 4
    assert "--collective-timeout must be a positive number" in result.stderr


def test_unpicklable_argument_is_explained(inner: InnerSession) -> None:
    inner.write(
        "test_lock.py",
        "import threading, pytest\n"
        "@pytest.mark.world_size(1)\n@pytest.mark.parametrize('lock', [threading.Lock()])\n"
        "def test_x(rank, lock):\n    pass\n",
    )
    result = inner.run("-q")
    assert "argument 'lock' of test_lock.py::test_x" in result.stdout and "cannot be sent to the ranks" in result.stdout


def test_cuda_demanded_without_gpus_is_a_skip_with_reason_and_a_red_run(inner: InnerSession) -> None:
    """Each test is skipped with its reason; a session where no distributed test got its GPUs
    (a GPU runner that lost them) is red, the reason on its last line, even with other tests passing."""
    inner.write(
        "test_gpu.py",
        "import pytest\n@pytest.mark.world_size(4)\ndef test_x(rank):\n    pass\ndef test_plain():\n    pass\n",
    )
    result = inner.run("--device", "cuda", "-rs")
    if plan_devices("cuda", 4).kind is not None:
        pytest.skip("this machine has 4 GPUs: the skip path cannot be observed here")
    assert "1 passed, 1 skipped" in result.stdout
    assert "needs 4 GPUs, found" in result.stdout
    assert result.returncode == 1, result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert "no distributed test got its devices (1 needs 4 GPUs, found" in last, last
    assert "pass --device cpu" in last


def test_device_tally_fails_a_session_only_when_no_test_got_its_devices() -> None:
    tally = DeviceTally("cuda")
    assert tally.nothing_ran() is None  # nothing distributed at all: nothing to say
    tally.note(DevicePlan(None, "needs 4 GPUs, found 1"))
    assert "1 needs 4 GPUs, found 1" in (tally.nothing_ran() or "")
    tally.note(DevicePlan("cuda"))  # one world of 1 had its GPU: the run ran something
    assert tally.nothing_ran() is None


def test_rank_fixture_without_world_size_marker_errors_with_the_fix(inner: InnerSession) -> None:
    """Without a marker the test would run in the parent with placeholder strings and could pass."""
    inner.write("test_unmarked.py", "def test_x(rank, device):\n    assert rank is not None\n")
    result = inner.run("-q")
    assert result.returncode == 1, result.stdout
    assert "1 error" in result.stdout
    assert "asks for the rank-side fixture 'rank' but has no world_size marker" in result.stdout
    assert "@pytest.mark.world_size(N)" in result.stdout


def test_device_plan() -> None:
    assert plan_devices("cpu", 8).kind == "cpu"
    assert plan_devices("cpu", 8).comm_backend == "gloo"
    auto = plan_devices("auto", 1)
    assert auto.kind in ("cpu", "cuda")
    with pytest.raises(ValueError, match="use one of auto, cpu, cuda"):
        plan_devices("gpu", 2)


def test_non_distributed_tests_and_junitxml_are_untouched(inner: InnerSession) -> None:
    inner.write("test_plain.py", "def test_plain():\n    assert True\n")
    result = inner.run("-q", "--junitxml", "parent.xml")
    assert "1 passed" in result.stdout
    assert (inner.directory / "parent.xml").exists()
    assert not inner.junit(0).exists()


def test_modules_every_rank_imports_are_imported_once_by_the_zygote(inner: InnerSession) -> None:
    """Rank fixture and label provider modules, and those of `rank_preload_modules`, are imported
    before the ranks are forked; one that cannot be imported there (here: it needs a rank's
    environment) is imported by each rank. Collectives such a module bound early, under any
    name, are still the traced ones."""
    inner.write(
        "preloaded_fixtures.py",
        "import os\nimport torch.distributed as dist\nIMPORTED_BY = os.getpid()\n_all_reduce = dist.all_reduce\n",
    )
    inner.write("preloaded_extra.py", "import os\nIMPORTED_BY = os.getpid()\n")
    inner.write("preloaded_labels.py", "import os\nIMPORTED_BY = os.getpid()\n\ndef label():\n    return None\n")
    inner.write(
        "rank_only_labels.py",
        "import os\nIMPORTED_BY = os.getpid()\nRANK = int(os.environ['RANK'])\n\ndef label():\n    return None\n",
    )
    inner.write(
        "test_preload.py",
        "import os\n"
        "import pytest\n"
        "import torch.distributed\n"
        "@pytest.mark.world_size(2)\n"
        "def test_where_imported(rank):\n"
        "    import preloaded_extra, preloaded_fixtures, preloaded_labels, rank_only_labels\n"
        "    zygote = os.getppid()\n"
        "    assert preloaded_fixtures.IMPORTED_BY == preloaded_labels.IMPORTED_BY == zygote\n"
        "    assert preloaded_extra.IMPORTED_BY == zygote\n"
        "    assert rank_only_labels.IMPORTED_BY == os.getpid() and rank_only_labels.RANK == rank\n"
        "    # bound before the rank wrapped the collectives, under a private name: traced all the same\n"
        "    assert preloaded_fixtures._all_reduce is torch.distributed.all_reduce\n"
        "    assert hasattr(preloaded_fixtures._all_reduce, '__trace_original__')\n",
    )
    inner.write(
        "pytest.ini",
        "[pytest]\n"
        "collective_label_providers =\n    preloaded_labels:label\n    rank_only_labels:label\n"
        "rank_preload_modules = preloaded_extra\n",
    )
    result = inner.run("-q", "-o", "rank_fixture_modules=preloaded_fixtures")
    assert "1 passed" in result.stdout, result.stdout[-3000:]
    assert "spawned, not forked" not in result.stdout


def test_the_zygote_refuses_to_fork_with_threads_or_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preloaded module that started a thread or initialised CUDA makes forks unsafe: the
    zygote refuses (the launcher then spawns workers and the summary says why)."""
    import torch

    from harness.rank import zygote

    monkeypatch.setattr(zygote, "_threads", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert zygote._unsafe_to_fork() == ""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "initialised CUDA" in zygote._unsafe_to_fork()
    monkeypatch.setattr(zygote, "_threads", lambda: 3)
    assert zygote._unsafe_to_fork() == "the zygote has 3 threads"
