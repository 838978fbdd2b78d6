"""Tests of the launcher (multiproc.py), CPU only.

The launcher runs as a subprocess, as users run it, on small throwaway child scripts that report
what they saw (environment, argv, pid) as files in a directory named by TEST_OUT.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from imagenet.launch import gpus  # noqa: E402


def free_port():
    """A TCP port nothing listens on now (for the static rendezvous, given on every node)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]

# Shared by every child script: report files are written atomically so the test never reads half.
PREAMBLE = """\
import json, os, pathlib, signal, sys, time
OUT = pathlib.Path(os.environ["TEST_OUT"])
RANK = int(os.environ["RANK"])

def write(name, text):
    tmp = OUT / (name + ".tmp")
    tmp.write_text(text)
    tmp.rename(OUT / name)

def wait_for(name):
    while not (OUT / name).exists():
        time.sleep(0.02)

"""

REPORT_ENV = """\
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "MASTER_ADDR", "MASTER_PORT", "NCCL_NVLS_ENABLE"]
report = {k: os.environ.get(k) for k in keys}
report["argv"] = sys.argv[1:]
write(f"rank{RANK}.json", json.dumps(report))
print(f"hello from rank {RANK}")
"""


def write_child(tmp_path, body):
    path = tmp_path / "child.py"
    path.write_text(PREAMBLE + textwrap.dedent(body))
    return path


def child_env(out, **extra):
    env = dict(os.environ, TEST_OUT=str(out), CUDA_VISIBLE_DEVICES="", **extra)
    env.pop("NCCL_NVLS_ENABLE", None)
    return env


def launcher_cmd(*args):
    return [sys.executable, "-m", "multiproc", *map(str, args)]


def launch(tmp_path, *args, env=None, timeout=30):
    return subprocess.run(launcher_cmd(*args), cwd=REPO, env=env or child_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def start(tmp_path, *args):
    return subprocess.Popen(launcher_cmd(*args), cwd=REPO, env=child_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def read_reports(out):
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def wait_for_files(paths, timeout=10):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"children never wrote {paths}"
        time.sleep(0.02)


def assert_dead(pid):
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_env_contract_two_processes(tmp_path):
    script = write_child(tmp_path, REPORT_ENV)
    logs = tmp_path / "logs"  # does not exist yet: the launcher creates it
    # Script args that look like launcher flags must reach the script untouched.
    script_args = ["--nproc-per-node", "7", "-b", "3", "--", "x"]
    r = launch(tmp_path, "--nproc-per-node", 2, "--log-dir", logs, script, *script_args)
    assert r.returncode == 0, r.stderr
    reports = read_reports(tmp_path)
    assert sorted(reports) == [0, 1]
    port = reports[0]["MASTER_PORT"]
    assert 1 <= int(port) <= 65535
    for rank, rep in reports.items():
        assert rep == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "NCCL_NVLS_ENABLE": "0", "argv": script_args}
    # Rank 0 talks on the terminal, rank 1 into its log file.
    assert "hello from rank 0" in r.stdout and "hello from rank 1" not in r.stdout
    assert sorted(p.name for p in logs.iterdir()) == ["GPU_1.log"]
    assert "hello from rank 1" in (logs / "GPU_1.log").read_text()
    assert "multiproc: starting 2 processes" in r.stderr and f"127.0.0.1:{port}" in r.stderr


def test_underscore_spellings_and_default_log_dir(tmp_path):
    script = write_child(tmp_path, REPORT_ENV)
    r = subprocess.run(launcher_cmd("--nproc_per_node", 2, "--master_addr", "localhost",
                                    "--master_port", 29999, script),
                       cwd=tmp_path, env=dict(child_env(tmp_path), PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    reports = read_reports(tmp_path)
    assert [reports[i]["MASTER_ADDR"] for i in (0, 1)] == ["localhost"] * 2
    assert [reports[i]["MASTER_PORT"] for i in (0, 1)] == ["29999"] * 2
    assert (tmp_path / "GPU_1.log").exists()  # default log dir: the working directory


def test_failing_child_stops_the_others(tmp_path):
    script = write_child(tmp_path, """\
        if RANK == 1:
            wait_for("pid0")
            sys.exit(3)
        write(f"pid{RANK}", str(os.getpid()))
        time.sleep(60)
    """)
    launcher = start(tmp_path, "--nproc-per-node", 3, "--log-dir", tmp_path, script)
    wait_for_files([tmp_path / "pid0"], timeout=30)  # the children run (torch's agent is up)
    began = time.monotonic()
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 3, err
    assert time.monotonic() - began < 5
    assert "rank 1 exited with status 3" in err and "GPU_1.log" in err
    assert_dead(int((tmp_path / "pid0").read_text()))


def test_death_by_signal_is_128_plus_signum(tmp_path):
    script = write_child(tmp_path, """\
        if RANK == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    r = launch(tmp_path, "--nproc-per-node", 2, "--log-dir", tmp_path, script)
    assert r.returncode == 128 + signal.SIGKILL, r.stderr


def test_child_ignoring_sigterm_is_killed_after_grace_period(tmp_path):
    script = write_child(tmp_path, """\
        if RANK == 0:
            wait_for("pid1")
            sys.exit(4)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        write("pid1", str(os.getpid()))
        time.sleep(60)
    """)
    launcher = start(tmp_path, "--nproc-per-node", 2, "--grace-period", 1, "--log-dir", tmp_path, script)
    wait_for_files([tmp_path / "pid1"], timeout=30)
    began = time.monotonic()
    _, err = launcher.communicate(timeout=30)
    elapsed = time.monotonic() - began
    assert launcher.returncode == 4, err
    assert 1 <= elapsed < 6
    assert "rank 1 (output: " in err and "stalled: still running 1 s after SIGTERM; sending SIGKILL" in err, err
    assert_dead(int((tmp_path / "pid1").read_text()))


@pytest.mark.parametrize("sig, extra", [(signal.SIGTERM, []), (signal.SIGUSR1, ["--max-restarts", 2])])
def test_signal_to_launcher_is_forwarded(tmp_path, sig, extra):
    # SIGUSR1 is SLURM's advance warning (--signal=USR1@120); a stop on request is not a failure
    # to restart from, even with --max-restarts.
    script = write_child(tmp_path, f"""\
        def on_term(signum, frame):
            write(f"term{{RANK}}", os.environ["TORCHELASTIC_RESTART_COUNT"])
            sys.exit(0)
        signal.signal({int(sig)}, on_term)
        write(f"pid{{RANK}}", str(os.getpid()))
        time.sleep(60)
    """)
    launcher = subprocess.Popen(
        launcher_cmd("--nproc-per-node", 2, *extra, "--log-dir", tmp_path, script), cwd=REPO,
        env=child_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files([tmp_path / "pid0", tmp_path / "pid1"])
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=10)
    finally:
        launcher.kill()
    # The children exited 0 after the signal, so the launcher reports the signal it got.
    assert launcher.returncode == 128 + sig, err
    assert (tmp_path / "term0").read_text() == "0" and (tmp_path / "term1").read_text() == "0"
    assert "restart 1" not in err
    for rank in (0, 1):
        assert_dead(int((tmp_path / f"pid{rank}").read_text()))


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes(tmp_path, rendezvous):
    script = write_child(tmp_path, REPORT_ENV)
    port = free_port()
    if rendezvous == "static":  # torchrun's --node-rank/--master-port way
        meet = lambda node: ["--nnodes", 2, "--node-rank", node, "--master-port", port]  # noqa: E731
    else:  # c10d: one endpoint for all, node ranks assigned by the rendezvous; 1..2 nodes may join
        meet = lambda node: ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}"]  # noqa: E731
    launchers = [
        subprocess.Popen(launcher_cmd("--nproc-per-node", 2, *meet(node), "--log-dir", tmp_path / "logs",
                                      script),
                         cwd=REPO, env=child_env(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=60) for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs
    reports = read_reports(tmp_path)
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, rep in reports.items():
        assert rep["WORLD_SIZE"] == "4" and rep["LOCAL_WORLD_SIZE"] == "2"
        assert rep["LOCAL_RANK"] == str(rank % 2) and rep["GROUP_RANK"] == str(rank // 2)
        if rendezvous == "static":
            assert rep["MASTER_PORT"] == str(port)
    assert len({rep["MASTER_PORT"] for rep in reports.values()}) == 1
    # On node 1 global rank 2 (its local rank 0) is the one on the terminal.
    node1 = next(out for out in outputs if "hello from rank 2" in out[0])
    assert "hello from rank 0" not in node1[0]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["GPU_1.log", "GPU_3.log"]


def test_max_restarts_restarts_the_group_until_it_gives_up(tmp_path):
    # Rank 1 dies by SIGKILL in every attempt: one start and two restarts, then the launcher gives
    # up with that rank's status. Each attempt's output is kept, the restarts marked in the log.
    # Rank 0 looks in its attempt's store for the key the attempt before left there, then leaves it;
    # rank 1 dies only after that.
    script = write_child(tmp_path, """\
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        print(f"rank {RANK} attempt {attempt}", flush=True)
        if RANK == 0:
            import datetime
            import torch.distributed as dist
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=20))
            stale = store.check(["left-by-an-earlier-attempt"])
            store.set("left-by-an-earlier-attempt", attempt)
            write(f"rank0-stale{attempt}", json.dumps(stale))
        write(f"rank{RANK}-attempt{attempt}", os.environ["MASTER_PORT"])
        if RANK == 1:
            wait_for(f"rank0-stale{attempt}")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    start = time.monotonic()
    r = launch(tmp_path, "--nproc-per-node", 2, "--max-restarts", 2, "--log-dir", tmp_path, script,
               timeout=60)
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    assert time.monotonic() - start < 30
    assert {p.name for p in tmp_path.glob("rank*-attempt*")} == {
        f"rank{rank}-attempt{a}" for a in range(3) for rank in (0, 1)}
    # Each attempt gets a store of its own, shared by its ranks: the failed one's keys would mislead
    # the new processes. (Not told by the port: the OS may hand a closed store's port out again.)
    assert [json.loads((tmp_path / f"rank0-stale{a}").read_text()) for a in range(3)] == [False] * 3
    assert all((tmp_path / f"rank1-attempt{a}").read_text() == (tmp_path / f"rank0-attempt{a}").read_text()
               for a in range(3))
    assert r.stderr.count("rank 1 exited with status 137 (output: ") == 3, r.stderr
    assert r.stderr.count("GPU_1.log, killed by SIGKILL)") == 3, r.stderr
    assert "restart 1 of 2: starting 2 processes" in r.stderr and "restart 2 of 2" in r.stderr
    assert "no restarts left (2 used)" in r.stderr
    assert [f"rank 0 attempt {a}" in r.stdout for a in range(3)] == [True] * 3
    log = (tmp_path / "GPU_1.log").read_text()
    assert log.splitlines() == ["rank 1 attempt 0", "multiproc: restart 1", "rank 1 attempt 1",
                                "multiproc: restart 2", "rank 1 attempt 2"]


def test_a_child_that_dies_between_our_poll_and_torchs_is_still_named_and_the_others_stopped(monkeypatch, capsys):
    """The launcher polls the children, then torch's agent does: a child that dies between the
    two is found by torch's poll. The attempt must still end as when the launcher finds it first,
    with the line that names the rank and SIGTERM to the others (once it was missing)."""
    import types
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from imagenet.launch import agent
    from imagenet.launch.group import Launch

    class Child:
        def __init__(self, pid):
            self.pid, self.returncode, self.signals = pid, None, []

        def poll(self):
            return self.returncode

        def send_signal(self, sig):
            self.signals.append(sig)
            self.returncode = -sig

    children = [Child(101), Child(102)]

    def torchs_poll(self, worker_group):
        children[1].returncode = -signal.SIGKILL  # dies after the launcher's poll, before torch's
        failure = types.SimpleNamespace(exitcode=-signal.SIGKILL, timestamp=1)
        return RunResult(state=WorkerState.FAILED, failures={1: failure})

    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", torchs_poll)
    Agent = agent._agent_class()
    a = Agent.__new__(Agent)
    a._pcontext = types.SimpleNamespace(subprocess_handlers={i: types.SimpleNamespace(proc=c)
                                                             for i, c in enumerate(children)})
    a._remaining_restarts = 2
    a.launch = Launch(types.SimpleNamespace(grace_period=5, log_dir="/logs", nproc_per_node=2))
    a.launch.live = True
    group = types.SimpleNamespace(workers=[types.SimpleNamespace(global_rank=r) for r in (0, 1)],
                                  spec=types.SimpleNamespace(max_restarts=2))
    assert a._monitor_workers(group).is_failed()
    err = capsys.readouterr().err
    assert "rank 1 exited with status 137 (output: /logs/GPU_1.log, killed by SIGKILL)" in err, err
    assert "sending SIGTERM to the others" in err and children[0].signals == [signal.SIGTERM], err
    assert a.launch.failure == (1, 137) and a._remaining_restarts == 2 and not a.launch.live


def test_a_user_error_is_not_restarted(tmp_path):
    script = write_child(tmp_path, """\
        write(f"rank{RANK}-attempt" + os.environ["TORCHELASTIC_RESTART_COUNT"], "")
        if RANK == 1:
            print("error: --lr must be positive", file=sys.stderr)
            sys.exit(2)
        time.sleep(60)
    """)
    r = launch(tmp_path, "--nproc-per-node", 2, "--max-restarts", 3, "--log-dir", tmp_path, script)
    assert r.returncode == 2, r.stderr
    assert "not restarting: rank 1 stopped with a user error (status 2)" in r.stderr
    assert not list(tmp_path.glob("rank*-attempt1"))
    assert "error: --lr must be positive" in (tmp_path / "GPU_1.log").read_text()


def test_ranks_stopped_by_a_signal_of_their_own_are_not_restarted(tmp_path):
    # SLURM signals every process of the step: the ranks may checkpoint and exit 138 before the
    # launcher's own SIGUSR1 arrives. That is a stop request, not a failure to restart from.
    script = write_child(tmp_path, """\
        signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(128 + signum))
        write(f"pid{RANK}-attempt" + os.environ["TORCHELASTIC_RESTART_COUNT"], str(os.getpid()))
        time.sleep(60)
    """)
    launcher = start(tmp_path, "--nproc-per-node", 2, "--max-restarts", 2, "--log-dir", tmp_path, script)
    try:
        pids = [tmp_path / "pid0-attempt0", tmp_path / "pid1-attempt0"]
        wait_for_files(pids, timeout=30)
        for pid in pids:
            os.kill(int(pid.read_text()), signal.SIGUSR1)
        _, err = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGUSR1, err
    assert "not restarting: rank" in err and "stopped by SIGUSR1 (status 138)" in err, err
    assert not list(tmp_path.glob("pid*-attempt1"))


def test_a_taken_master_port_is_one_line_exit_2(tmp_path):
    script = write_child(tmp_path, "write('ran', '')\n")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        r = launch(tmp_path, "--nproc-per-node", 2, "--master-port", taken.getsockname()[1], script)
    assert r.returncode == 2, r.stderr
    assert "EADDRINUSE" in r.stderr or "address already in use" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("args, message", [
    (["SCRIPT"], "no GPUs are visible"),  # CUDA_VISIBLE_DEVICES="" and no --nproc-per-node
    (["--nproc-per-node", 2, "missing.py"], "script not found"),
    (["--nproc-per-node", 2, "--nnodes", 2, "SCRIPT"], "--master-port is required"),
    (["--nproc-per-node", 0, "SCRIPT"], "--nproc-per-node must be at least 1"),
    (["--nproc-per-node", 1, "--nnodes", 2, "--node-rank", 2, "--master-port", 2, "SCRIPT"],
     "--node-rank must be in 0..1"),
    (["--nproc-per-node", "two", "SCRIPT"], "invalid int value"),
    (["--bogus", "SCRIPT"], "unrecognized arguments"),
    ([], "required: script"),
    (["--nproc-per-node", 2, "--max-restarts", -1, "SCRIPT"], "--max-restarts must be >= 0"),
    (["--nproc-per-node", 2, "--nnodes", "2:1", "SCRIPT"], "--nnodes must be N or MIN:MAX"),
    (["--nproc-per-node", 2, "--nnodes", "1:4", "SCRIPT"], "needs a c10d rendezvous: add --rdzv-endpoint"),
    (["--nproc-per-node", 2, "--rdzv-endpoint", "node0:http", "SCRIPT"], "--rdzv-endpoint must be HOST:PORT"),
    (["--nproc-per-node", 2, "--rdzv-endpoint", "node0:29400", "--master-port", 5, "SCRIPT"],
     "two ways for nodes to meet"),
    (["--nproc-per-node", 2, "--master-port", 5, "--max-restarts", 1, "SCRIPT"],
     "--max-restarts needs the c10d rendezvous"),
])
def test_errors_are_one_line_exit_2(tmp_path, args, message):
    script = write_child(tmp_path, "write('ran', '')\n")
    r = launch(tmp_path, *[script if a == "SCRIPT" else a for a in args])
    assert r.returncode == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not (tmp_path / "ran").exists()


def test_no_gpu_message_suggests_cpu_processes(tmp_path):
    r = launch(tmp_path, write_child(tmp_path, ""))
    assert "--nproc-per-node N" in r.stderr and "--dist-backend gloo" in r.stderr


def test_imports_no_training_code_nor_torch():
    code = ("import sys, multiproc; "
            "mods = {m for m in sys.modules if m in ('torch', 'imagenet') or m.startswith(('torch.', 'imagenet.'))}; "
            "assert mods <= {'imagenet', 'imagenet.launch', 'imagenet.launch.agent', 'imagenet.launch.flags', "
            "'imagenet.launch.gpus', 'imagenet.launch.group'}, sorted(mods)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=30)


@pytest.mark.parametrize("value, count", [
    ("", 0), ("0", 1), ("0,1", 2), ("3, 5,7", 3), ("0,-1,2", 1), ("GPU-abc,GPU-def", 2),
])
def test_count_cuda_visible_devices(value, count):
    assert gpus.count_cuda_visible_devices(value) == count


def test_visible_gpu_count_respects_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpus.visible_gpu_count() == 2


def test_launcher_env_keeps_a_user_nvls_setting_and_sets_omp_threads_as_torchrun():
    assert gpus.launcher_env({"NCCL_NVLS_ENABLE": "1"}, 4) == {"OMP_NUM_THREADS": "1"}
    assert gpus.launcher_env({"OMP_NUM_THREADS": "3"}, 4) == {"NCCL_NVLS_ENABLE": "0"}
    assert gpus.launcher_env({}, 1) == {"NCCL_NVLS_ENABLE": "0"}  # one process: all its threads


def rank_pid(launcher_pid, rank):
    """The pid of the launcher's child that runs global rank ``rank`` (read from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes through /proc")
def test_a_stalled_rank_is_named_and_the_timeout_is_one_line(tmp_path):
    """Rank 1 stopped (SIGSTOP) in the middle of an epoch: rank 0's next collective times out
    after --dist-timeout and says so in one line, not gloo's traceback; the launcher has to
    SIGKILL rank 1 and says which rank that was."""
    from tests.helpers import make_digits
    make_digits(tmp_path / "data", train_per_class=4, val_per_class=1)  # 5 steps of 2 x 4 images
    cmd = launcher_cmd("--nproc-per-node", 2, "--grace-period", 1, "--log-dir", tmp_path, "main.py",
                       tmp_path / "data", "-a", "resnet18", "-b", 8, "-j", 0, "--image-size", 16, "--val-resize", 16,
                       "-p", 1, "--epochs", 1, "--dist-backend", "gloo", "--dist-timeout", 5,
                       "--output-dir", tmp_path / "out")
    env = dict(child_env(tmp_path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        for line in launcher.stdout:
            if line.startswith("Epoch: [0]["):  # rank 0 is past its first step
                stopped = rank_pid(launcher.pid, 1)
                os.kill(stopped, signal.SIGSTOP)
                break
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        if stopped is not None and launcher.returncode is None:
            os.kill(stopped, signal.SIGKILL)
    assert stopped is not None, err
    assert launcher.returncode == 1, err
    assert "Traceback" not in err, err
    timeouts = [ln for ln in err.splitlines() if "timed out" in ln]
    assert timeouts == ["error: a collective operation timed out after 5 s waiting for a peer (--dist-timeout 5); "
                        "another rank has stalled or died (python -m multiproc names it)"], err
    assert f"rank 1 (output: {tmp_path}/GPU_1.log) stalled: still running 1 s after SIGTERM; sending SIGKILL" in err
    assert_dead(stopped)
