"""The environment the trainer sets for itself before torch starts (imagenet/base/processenv.py):
CUDA's hardware queue count, read when the CUDA context is created, and Inductor's cache folder,
which importing torchvision would otherwise fill with torch's default."""

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from imagenet.base.processenv import INDUCTOR_CACHE, MAX_CONNECTIONS, ProcessEnv, set_process_env
from imagenet.training.defaults import SpeedPlan, with_environment

REPO = Path(__file__).resolve().parents[1]


def test_unset_variables_are_set_and_the_users_are_kept(tmp_path):
    env = {}
    got = set_process_env(env, cache_root=str(tmp_path))
    assert env == {MAX_CONNECTIONS: "32", INDUCTOR_CACHE: str(tmp_path / "inductor")}
    assert got.ours == env and got.users == {} and got.connections() == "32"
    env = {MAX_CONNECTIONS: "8", INDUCTOR_CACHE: "/mine"}
    got = set_process_env(env, cache_root=str(tmp_path))
    assert env == {MAX_CONNECTIONS: "8", INDUCTOR_CACHE: "/mine"}
    assert got.ours == {} and got.connections() == "8"


# Runs main.py with an import hook that, at the first `import torch`, writes what the environment
# holds then and stops the process: nothing can create a CUDA context before torch is imported.
_PROBE = textwrap.dedent("""
    import json, os, runpy, sys
    class Probe:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                keys = ("CUDA_DEVICE_MAX_CONNECTIONS", "TORCHINDUCTOR_CACHE_DIR")
                print("AT-TORCH-IMPORT " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
                os._exit(0)
    sys.meta_path.insert(0, Probe())
    sys.argv = ["main.py"] + sys.argv[1:]
    runpy.run_path("main.py", run_name="__main__")
""")


def _environment_at_torch_import(tmp_path, extra_env, *args):
    env = {k: v for k, v in os.environ.items() if k not in (MAX_CONNECTIONS, INDUCTOR_CACHE)}
    env.update(extra_env)
    r = subprocess.run([sys.executable, "-c", _PROBE, "--dummy", "--output-dir", str(tmp_path), *args],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("AT-TORCH-IMPORT ")]
    assert lines, r.stdout[-2000:] + r.stderr[-2000:]
    import json
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.mark.parametrize("launch", [
    {},  # main.py alone
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},  # multiproc's or torchrun's rank 1
    {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"},  # an srun task
], ids=["main", "multiproc-rank1", "slurm-task1"])
def test_main_sets_both_before_torch_is_imported(tmp_path, launch):
    got = _environment_at_torch_import(tmp_path, launch, "--cache-dir", str(tmp_path / "c"))
    assert got == {MAX_CONNECTIONS: "32", INDUCTOR_CACHE: str(tmp_path / "c" / "inductor")}


def test_main_keeps_what_the_user_set(tmp_path):
    got = _environment_at_torch_import(tmp_path, {MAX_CONNECTIONS: "4", INDUCTOR_CACHE: str(tmp_path / "ic")})
    assert got == {MAX_CONNECTIONS: "4", INDUCTOR_CACHE: str(tmp_path / "ic")}


def _plan(compile_mode="reduce-overhead"):
    return SpeedPlan(True, "triton", "triton", compile_mode, False)


def test_a_gpu_run_says_what_it_set_and_records_it():
    env = ProcessEnv(ours={MAX_CONNECTIONS: "32", INDUCTOR_CACHE: "/c/inductor"})
    plan = with_environment(_plan(), env, "cuda")
    assert plan.choices[0].line().startswith("CUDA_DEVICE_MAX_CONNECTIONS=32: a hardware queue for every CUDA "
                                             "stream")
    assert "set CUDA_DEVICE_MAX_CONNECTIONS in the environment" in plan.choices[0].line()
    assert plan.environment == ((MAX_CONNECTIONS, "32"), (INDUCTOR_CACHE, "/c/inductor"))
    assert plan.notes == ()
    # not compiled: Inductor's folder is no decision of this run
    assert with_environment(_plan("off"), env, "cuda").environment == ((MAX_CONNECTIONS, "32"),)


def test_a_cpu_run_says_nothing_of_it():
    env = ProcessEnv(ours={MAX_CONNECTIONS: "32", INDUCTOR_CACHE: "/c/inductor"})
    plan = with_environment(_plan("off"), env, "cpu")
    assert plan.choices == () and plan.notes == () and plan.environment == ()


@pytest.mark.parametrize("value, noted", [("8", True), ("1", True), ("32", False)])
def test_a_users_smaller_queue_count_gets_a_note(value, noted):
    plan = with_environment(_plan(), ProcessEnv(users={MAX_CONNECTIONS: value}), "cuda")
    assert plan.choices == ()
    assert bool(plan.notes) == noted
    if noted:
        assert plan.notes[0].startswith(f"CUDA_DEVICE_MAX_CONNECTIONS={value} from the environment")


def test_config_yaml_records_what_the_trainer_set(tmp_path):
    from imagenet.base.config import Config
    from imagenet.training.runlog import RunLog
    ctx = types.SimpleNamespace(is_main=True)
    with RunLog(Config(output_dir=str(tmp_path)), ctx, environment=((MAX_CONNECTIONS, "32"),)):
        pass
    text = (tmp_path / "config.yaml").read_text()
    assert "# environment the trainer set for itself" in text and "CUDA_DEVICE_MAX_CONNECTIONS=32" in text


_CONTEXT = textwrap.dedent("""
    import ctypes, sys
    sys.path.insert(0, ".")
    from imagenet.base.config import parse_config
    from imagenet.cli import prepare_process
    prepare_process(parse_config(["--dummy"]))
    import torch
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    assert not torch.cuda.is_initialized()
    before = libc.getenv(b"CUDA_DEVICE_MAX_CONNECTIONS")  # what the driver reads as it makes the context
    torch.zeros(1, device="cuda")
    assert torch.cuda.is_initialized()
    print("AT-CONTEXT", (before or b"unset").decode(), flush=True)
""")


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("user_value, seen", [(None, "32"), ("8", "8")])
def test_the_cuda_context_is_created_with_the_queues(user_value, seen):
    """The process environment the CUDA driver reads (libc's, which ``os.environ`` writes through)
    holds the trainer's value when the context is created, or the user's own. (A probe of the
    queues' behaviour, a stream behind 16 busy ones, did not tell 8 queues from 32 on an H200;
    the input path's measurements do: docs/BENCHMARKS.md.)"""
    env = {k: v for k, v in os.environ.items() if k != MAX_CONNECTIONS}
    if user_value:
        env[MAX_CONNECTIONS] = user_value
    r = subprocess.run([sys.executable, "-c", _CONTEXT], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"AT-CONTEXT {seen}" in r.stdout, r.stdout
