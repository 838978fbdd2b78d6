"""Start one training process per GPU, the way torchrun does, without importing any training code.

Usage::

    python -m multiproc [--nproc-per-node N] [--nnodes N --node-rank R --master-addr A
                        --master-port P] [--log-dir D] [--grace-period S] main.py [trainer flags]

Launcher flags come before the script path; everything after it goes to the script verbatim.
Each flag also accepts the underscore spelling torchrun accepts (``--nproc_per_node``).

For local rank ``i`` of this node the launcher runs ``python -u SCRIPT ARGS`` with the environment
torchrun sets: ``RANK = node_rank * N + i``, ``LOCAL_RANK = i``, ``WORLD_SIZE = nnodes * N``,
``LOCAL_WORLD_SIZE = N``, ``GROUP_RANK = node_rank``, ``MASTER_ADDR`` and ``MASTER_PORT``.
``N`` defaults to the number of visible GPUs (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``).
On one node the master port defaults to a free one; with several nodes every node must be given
the same ``--master-port`` (and ``--master-addr`` of node 0).

The first process of this node writes to the terminal; the others write to
``LOG_DIR/GPU_<global rank>.log``. If one process fails, the others get SIGTERM, then SIGKILL
after the grace period, and the launcher exits with the failing process's status (128 + signal
number for a death by signal). SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded.

CPU only (no GPUs): ``python -m multiproc --nproc-per-node 2 main.py --dist-backend gloo ...``.
"""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

POLL_S = 0.1  # how often children are polled; short enough that a failure stops the rest at once
# SIGHUP is forwarded too: children run in their own sessions (see spawn), so a closed terminal
# would otherwise leave them running with nowhere to write.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class UsageError(Exception):
    """A bad command line or environment: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line instead of argparse's usage block, like every other error of the project.
        self.exit(2, f"multiproc: error: {message} (see python -m multiproc --help)\n")


def parse_args(argv):
    """Parse launcher flags; the script path and everything after it are kept apart."""
    p = _Parser(prog="python -m multiproc", allow_abbrev=False,
                description="Run SCRIPT once per GPU with torchrun's environment contract.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None, metavar="N",
                   help="processes on this node (default: number of visible GPUs)")
    p.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                   help="rank of this node, 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1", metavar="A",
                   help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=None, metavar="P",
                   help="port on node 0; required with --nnodes > 1 (default: a free port)")
    p.add_argument("--log-dir", "--log_dir", default=".", metavar="D",
                   help="where GPU_<rank>.log files of the non-terminal ranks go (default .)")
    p.add_argument("--grace-period", "--grace_period", type=float, default=60.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping (default 60: time for every rank to write its checkpoint)")
    p.add_argument("script", help="the training script, e.g. main.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script verbatim")
    return p.parse_args(argv)


def validate(args):
    """Check the flags that argparse can't, and fill in nproc_per_node and master_port."""
    if args.nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.grace_period < 0:
        raise UsageError(f"--grace-period must be >= 0 seconds, got {args.grace_period}")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UsageError(f"--master-port must be in 1..65535, got {args.master_port}")
    if args.nnodes > 1 and args.master_port is None:
        raise UsageError("--master-port is required with --nnodes > 1: every node must be given "
                         "the same port (and --master-addr of node 0)")
    if not os.path.exists(args.script):
        raise UsageError(f"script not found: {args.script}")
    if args.nproc_per_node is None:
        args.nproc_per_node = visible_gpu_count()
        if args.nproc_per_node == 0:
            raise UsageError("no GPUs are visible; to run CPU processes pass --nproc-per-node N "
                             "and give the script --dist-backend gloo")
    elif args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if args.master_port is None:
        args.master_port = free_port()


def visible_gpu_count():
    """Number of GPUs CUDA would show a child, found without importing torch when possible."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return count_cuda_visible_devices(visible)
    count = _nvidia_smi_gpu_count()
    if count is not None:
        return count
    try:  # last resort: torch is slow to import and the launcher doesn't otherwise need it
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def count_cuda_visible_devices(value):
    """Count the devices in CUDA_VISIBLE_DEVICES as CUDA does: up to the first invalid entry."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):  # "" hides all GPUs; "-1" ends the list
            break
        count += 1
    return count


def _nvidia_smi_gpu_count():
    """GPUs listed by ``nvidia-smi -L``, or None when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def free_port():
    """A TCP port nothing listens on now (another program may still take it before rank 0 does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def child_env(args, local_rank):
    """The environment of one child: ours plus torchrun's contract."""
    n = args.nproc_per_node
    env = dict(os.environ)
    env.update(RANK=str(args.node_rank * n + local_rank), LOCAL_RANK=str(local_rank),
               WORLD_SIZE=str(args.nnodes * n), LOCAL_WORLD_SIZE=str(n),
               GROUP_RANK=str(args.node_rank), MASTER_ADDR=args.master_addr,
               MASTER_PORT=str(args.master_port))
    # NVLink multicast (NVLS) must stay off on our machines unless the user asks otherwise.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def spawn(args, procs):
    """Start the children, appending each Popen to ``procs`` as it starts (so a failure midway
    still lets the caller stop the ones already running)."""
    cmd = [sys.executable, "-u", args.script] + args.script_args
    for local_rank in range(args.nproc_per_node):
        env = child_env(args, local_rank)
        if local_rank == 0:
            stdin = stdout = None  # inherit the terminal
        else:
            stdin = subprocess.DEVNULL
            stdout = open(log_path(args.log_dir, env["RANK"]), "w")
        try:
            # A session of its own per child: killpg then also reaches its DataLoader workers, and
            # a terminal Ctrl-C reaches only the launcher, which forwards it exactly once.
            procs.append(subprocess.Popen(cmd, env=env, stdin=stdin, stdout=stdout,
                                          stderr=subprocess.STDOUT if stdout else None,
                                          start_new_session=True))
        finally:
            if stdout is not None:
                stdout.close()  # the child holds its own copy


def log_path(log_dir, rank):
    """Where the output of global rank ``rank`` goes when it is not on the terminal."""
    return os.path.join(log_dir, f"GPU_{rank}.log")


def exit_status(returncode):
    """Popen's returncode as a shell reports it: 128 + signal number for a death by signal."""
    return 128 - returncode if returncode < 0 else returncode


def signal_all(procs, sig):
    """Send ``sig`` to every child still running: SIGKILL to its whole process group (its
    DataLoader workers too), any other signal to the child alone, which may stop gracefully
    (finish the step, write a checkpoint) and end its workers itself."""
    for p in procs:
        if p.poll() is None:
            try:
                if sig == signal.SIGKILL:
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)
            except ProcessLookupError:  # exited between poll() and the kill
                pass


def first_failure(codes):
    """(index, exit status) of the first child in ``codes`` that exited non-zero, else None."""
    for i, code in enumerate(codes):
        if code:  # None: still running; 0: success
            return i, exit_status(code)
    return None


def supervise(args, procs, received):
    """Wait for the children; stop them all on the first failure or on a signal we received.

    Returns the launcher's exit status: the first failing child's, else 128 + the received
    signal's number, else 0.
    """
    failed = None  # exit status of the first child that failed
    kill_at = None  # when SIGKILL follows the SIGTERM (or forwarded signal) already sent
    signals_seen = 0
    first_rank = args.node_rank * args.nproc_per_node
    while True:
        codes = [p.poll() for p in procs]
        failure = first_failure(codes) if failed is None else None
        if failure:
            i, failed = failure
            if kill_at is None:  # deaths we caused ourselves are not news
                where = "this terminal" if i == 0 else log_path(args.log_dir, first_rank + i)
                _say(f"rank {first_rank + i} exited with status {failed} (output: {where})")
        if all(code is not None for code in codes):
            break
        if kill_at is None and (failed is not None or received):
            sig = received[0] if received else signal.SIGTERM
            name = signal.Signals(sig).name
            _say(f"got {name}; forwarding it" if received else f"sending {name} to the others")
            signals_seen = len(received)
            signal_all(procs, sig)
            kill_at = time.monotonic() + args.grace_period
        elif kill_at is not None and (time.monotonic() >= kill_at or len(received) > signals_seen):
            # Grace period over, or the user signalled again (a second Ctrl-C): stop waiting.
            _say("sending SIGKILL to the processes still running")
            signal_all(procs, signal.SIGKILL)
            kill_at, signals_seen = float("inf"), float("inf")
        time.sleep(POLL_S)
    if failed is not None:
        return failed
    return 128 + received[0] if received else 0


def _say(message):
    print(f"multiproc: {message}", file=sys.stderr, flush=True)


def install_handlers(received):
    """Record forwarded signals in ``received``; returns the previous handlers, to restore."""
    previous = {}
    for sig in FORWARDED_SIGNALS:
        # An ignored signal stays ignored: `nohup` and background jobs rely on that.
        if signal.getsignal(sig) != signal.SIG_IGN:
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    return previous


def main(argv=None):
    """Run the launcher; returns its exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        validate(args)
        os.makedirs(args.log_dir, exist_ok=True)
    except (UsageError, OSError) as e:
        _say(f"error: {e}")
        return 2
    n, first = args.nproc_per_node, args.node_rank * args.nproc_per_node
    others = f"rank {first + 1} logs" if n == 2 else f"ranks {first + 1}..{first + n - 1} log"
    logs = f"; {others} to {log_path(args.log_dir, '<rank>')}" if n > 1 else ""
    _say(f"starting {n} process{'es' if n > 1 else ''} (node {args.node_rank} of {args.nnodes}, "
         f"world size {args.nnodes * n}, master {args.master_addr}:{args.master_port}); "
         f"rank {first} on this terminal{logs}")
    received = []
    previous = install_handlers(received)  # before spawning, so no signal slips between
    procs = []
    try:
        try:
            spawn(args, procs)
        except OSError as e:
            _say(f"error: could not start rank {first + len(procs)}: {e}")
            signal_all(procs, signal.SIGKILL)
            for p in procs:
                p.wait()
            return 2
        return supervise(args, procs, received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
