"""Tests of the launcher (multiproc.py), CPU only.

The launcher runs as a subprocess, as users run it, on small throwaway child scripts that report
what they saw (environment, argv, pid) as files in a directory named by TEST_OUT.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import multiproc  # noqa: E402
from multiproc import free_port  # noqa: E402

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
    start = time.monotonic()
    r = launch(tmp_path, "--nproc-per-node", 3, "--log-dir", tmp_path, script)
    assert r.returncode == 3, r.stderr
    assert time.monotonic() - start < 5
    assert "rank 1 exited with status 3" in r.stderr and "GPU_1.log" in r.stderr
    wait_for_files([tmp_path / "pid0"])
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
    start = time.monotonic()
    r = launch(tmp_path, "--nproc-per-node", 2, "--grace-period", 1, "--log-dir", tmp_path,
               script)
    elapsed = time.monotonic() - start
    assert r.returncode == 4, r.stderr
    assert 1 <= elapsed < 6
    assert "SIGKILL" in r.stderr
    assert_dead(int((tmp_path / "pid1").read_text()))


def test_sigterm_to_launcher_is_forwarded(tmp_path):
    script = write_child(tmp_path, """\
        def on_term(signum, frame):
            write(f"term{RANK}", "")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        write(f"pid{RANK}", str(os.getpid()))
        time.sleep(60)
    """)
    launcher = subprocess.Popen(
        launcher_cmd("--nproc-per-node", 2, "--log-dir", tmp_path, script), cwd=REPO,
        env=child_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files([tmp_path / "pid0", tmp_path / "pid1"])
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=10)
    finally:
        launcher.kill()
    # The children exited 0 after the signal, so the launcher reports the signal it got.
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists()
    for rank in (0, 1):
        assert_dead(int((tmp_path / f"pid{rank}").read_text()))


def test_two_nodes(tmp_path):
    script = write_child(tmp_path, REPORT_ENV)
    port = free_port()
    launchers = [
        subprocess.Popen(launcher_cmd("--nproc-per-node", 2, "--nnodes", 2, "--node-rank", node,
                                      "--master-port", port, "--log-dir", tmp_path / "logs",
                                      script),
                         cwd=REPO, env=child_env(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=30) for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs
    reports = read_reports(tmp_path)
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, rep in reports.items():
        assert rep["WORLD_SIZE"] == "4" and rep["LOCAL_WORLD_SIZE"] == "2"
        assert rep["LOCAL_RANK"] == str(rank % 2) and rep["GROUP_RANK"] == str(rank // 2)
        assert rep["MASTER_PORT"] == str(port)
    # On node 1 global rank 2 (its local rank 0) is the one on the terminal.
    assert "hello from rank 2" in outputs[1][0]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["GPU_1.log", "GPU_3.log"]


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
            "assert not {'torch', 'imagenet'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=30)


@pytest.mark.parametrize("value, count", [
    ("", 0), ("0", 1), ("0,1", 2), ("3, 5,7", 3), ("0,-1,2", 1), ("GPU-abc,GPU-def", 2),
])
def test_count_cuda_visible_devices(value, count):
    assert multiproc.count_cuda_visible_devices(value) == count


def test_visible_gpu_count_respects_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert multiproc.visible_gpu_count() == 2


def test_child_env_keeps_a_user_nvls_setting(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    args = multiproc.parse_args(["--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
                                 "--master-port", "1234", "x.py"])
    env = multiproc.child_env(args, 3)
    assert env["NCCL_NVLS_ENABLE"] == "1"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("7", "3", "8")
