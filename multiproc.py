"""Start one training process per GPU on torch's elastic agent (what torchrun runs), with restarts.

Usage::

    python -m multiproc [--nproc-per-node N] [--max-restarts N] [--log-dir D] [--grace-period S]
                        [--nnodes N --node-rank R --master-addr A --master-port P]
                        [--nnodes MIN:MAX --rdzv-endpoint HOST:PORT [--rdzv-id ID]]
                        main.py [trainer flags]

Launcher flags come before the script path; everything after it goes to the script verbatim.
Each flag also accepts the underscore spelling torchrun accepts (``--nproc_per_node``).

The processes are started, watched and restarted by ``torch.distributed.elastic``'s agent, so
each gets torchrun's environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT`` and the rest.
``N`` defaults to the number of visible GPUs (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``).
``OMP_NUM_THREADS`` is 1 in each process when there are several and it is not set, as torchrun
does. How the nodes meet:

* one node, no flags: a c10d rendezvous whose store the agent opens on a port the OS picks at
  bind time (nothing can take the port between choosing and binding it);
* ``--nnodes N --node-rank R --master-addr A --master-port P``: torchrun's static rendezvous,
  every node given node 0's address and the same port;
* ``--nnodes MIN:MAX --rdzv-endpoint HOST:PORT``: c10d, the same endpoint on every node; ranks
  are assigned at each (re)start and MIN..MAX nodes may take part.

Restarts need c10d: each attempt gets a new store for the processes (torch's agent would keep the
failed attempt's, whose keys, the dead peers' addresses among them, mislead a new gloo or NCCL
group), which the static rendezvous cannot do.

The first process of this node writes to the terminal; the others write to
``LOG_DIR/GPU_<global rank>.log`` (appended to after a restart). If one process fails, the
others get SIGTERM, then SIGKILL after the grace period. With ``--max-restarts N`` the group is
then started again, up to N times (main.py resumes from its newest checkpoint). Not after a rank
that stopped with a user error (status 2: it would fail the same way), nor after one that a stop
signal ended (128 + SIGINT/SIGTERM/SIGHUP/SIGUSR1: SLURM signals every process). The launcher exits
with the failing process's status (128 + signal number for a death by signal), 0 when the
(restarted) group finished. SIGINT, SIGTERM, SIGHUP and SIGUSR1 sent to the launcher are
forwarded and end the run without a restart; a second one stops at once (SIGKILL).

CPU only (no GPUs): ``python -m multiproc --nproc-per-node 2 main.py --dist-backend gloo ...``.
Importing this module imports neither torch nor training code; the launch does (torch's agent).
"""
import argparse
import inspect
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

POLL_S = 0.1  # how often children are polled; short enough that a failure stops the rest at once
# SIGHUP is forwarded too: children run in their own sessions (torch's agent starts them so), so
# a closed terminal would otherwise leave them running with nowhere to write. SIGUSR1 is SLURM's
# advance warning (#SBATCH --signal=USR1@120): main.py checkpoints and exits on it.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
DEFAULT_RDZV_PORT = 29400  # torchrun's, for --rdzv-endpoint HOST without a port
USER_ERROR = 2  # main.py's exit status for a mistake a restart would only repeat
# A rank that ended with 128 + one of these stopped on request (main.py checkpoints first): SLURM
# signals every process of a job step, so the ranks may be done before the launcher's own copy
# of the signal arrives. Not a failure to restart from.
STOP_STATUSES = {128 + int(s): s for s in FORWARDED_SIGNALS}

# Each child starts as this shim, which points its output at the rank's log file (all but local
# rank 0) and then execs the script in its place: same pid, no process in between. torch's agent
# would open stdout and stderr as two files; one file with O_APPEND keeps both in order.
_CHILD = """\
import os, signal, sys
signal.pthread_sigmask(signal.SIG_UNBLOCK, [%s])  # blocked by the launcher while it spawns
log_dir, argv = sys.argv[1], sys.argv[2:]
if os.environ.get("LOCAL_RANK", "0") != "0":
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    fd = os.open(os.path.join(log_dir, "GPU_" + os.environ["RANK"] + ".log"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if restart else os.O_TRUNC), 0o666)
    if restart:
        os.write(fd, b"multiproc: restart %%d\\n" %% restart)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
os.execv(sys.executable, [sys.executable, "-u"] + argv)
""" % ", ".join(str(int(s)) for s in FORWARDED_SIGNALS)


class UsageError(Exception):
    """A bad command line or environment: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line instead of argparse's usage block, like every other error of the project.
        self.exit(2, f"multiproc: error: {message} (see python -m multiproc --help)\n")


def parse_args(argv):
    """Parse launcher flags; the script path and everything after it are kept apart."""
    p = _Parser(prog="python -m multiproc", allow_abbrev=False,
                description="Run SCRIPT once per GPU on torch's elastic agent, with torchrun's "
                            "environment contract.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None, metavar="N",
                   help="processes on this node (default: number of visible GPUs)")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="number of nodes, or a range with --rdzv-endpoint (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None, metavar="R",
                   help="rank of this node, 0..nnodes-1, with --master-port (default 0)")
    p.add_argument("--master-addr", "--master_addr", default=None, metavar="A",
                   help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=None, metavar="P",
                   help="port on node 0, the same on every node (static rendezvous)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT",
                   help=f"c10d rendezvous, the same on every node (port default {DEFAULT_RDZV_PORT})")
    p.add_argument("--rdzv-id", "--rdzv_id", default="none", metavar="ID",
                   help="job id shared by the nodes of one c10d rendezvous (default none)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="N",
                   help="restart the processes up to N times after a failure (default 0)")
    p.add_argument("--log-dir", "--log_dir", default=".", metavar="D",
                   help="where GPU_<rank>.log files of the non-terminal ranks go (default .)")
    p.add_argument("--grace-period", "--grace_period", type=float, default=60.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping (default 60: time for every rank to write its checkpoint)")
    p.add_argument("script", help="the training script, e.g. main.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script verbatim")
    return p.parse_args(argv)


def parse_nnodes(value):
    """``N`` or ``MIN:MAX`` -> (min, max)."""
    parts = value.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or not 1 <= lo <= hi:
        raise UsageError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value}")
    return lo, hi


def parse_endpoint(value):
    """``HOST[:PORT]`` -> (host, port), the port torchrun's default when left out."""
    host, sep, port = value.strip().rpartition(":")
    if not sep:
        host, port = value.strip(), str(DEFAULT_RDZV_PORT)
    host = host.strip("[]")  # [::1]:29400
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {value!r}")
    return host, int(port)


def validate(args):
    """Check the flags that argparse can't; fill in nproc_per_node and the rendezvous.

    Sets ``args.rdzv`` to (backend, endpoint, run_id, min_nodes, max_nodes, local_addr, config).
    """
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.grace_period < 0:
        raise UsageError(f"--grace-period must be >= 0 seconds, got {args.grace_period}")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UsageError(f"--master-port must be in 1..65535, got {args.master_port}")
    if args.rdzv_endpoint is not None:
        if args.master_port is not None or args.master_addr is not None or args.node_rank is not None:
            raise UsageError("--rdzv-endpoint (c10d: ranks assigned at each start) and --master-addr/"
                             "--master-port/--node-rank (static) are two ways for nodes to meet; give one")
        host, port = parse_endpoint(args.rdzv_endpoint)
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets
        args.rdzv = ("c10d", where, args.rdzv_id, min_nodes, max_nodes, None, {})
    else:
        if min_nodes != max_nodes:
            raise UsageError(f"--nnodes {args.nnodes} (a range of nodes) needs a c10d rendezvous: "
                             "add --rdzv-endpoint HOST:PORT, the same on every node")
        node_rank = 0 if args.node_rank is None else args.node_rank
        if not 0 <= node_rank < min_nodes:
            raise UsageError(f"--node-rank must be in 0..{min_nodes - 1}, got {node_rank}")
        if min_nodes > 1 and args.master_port is None:
            raise UsageError("--master-port is required with --nnodes > 1: every node must be given "
                             "the same port (and --master-addr of node 0), or use --rdzv-endpoint HOST:PORT")
        addr = args.master_addr or "127.0.0.1"
        if args.master_port is None:  # one node: the store binds port 0, the OS picks a free one
            args.rdzv = ("c10d", f"{addr}:0", str(uuid.uuid4()), 1, 1, addr, {})
        elif args.max_restarts:
            raise UsageError("--max-restarts needs the c10d rendezvous: the static one (--master-port) "
                             "keeps one store, whose keys from the failed attempt would mislead the "
                             "restarted processes; drop --master-port on one node, or give every node "
                             "--rdzv-endpoint HOST:PORT")
        else:
            args.rdzv = ("static", f"{addr}:{args.master_port}", "none", min_nodes, min_nodes, None,
                         {"rank": node_rank})
    if not os.path.exists(args.script):
        raise UsageError(f"script not found: {args.script}")
    if args.nproc_per_node is None:
        args.nproc_per_node = visible_gpu_count()
        if args.nproc_per_node == 0:
            raise UsageError("no GPUs are visible; to run CPU processes pass --nproc-per-node N "
                             "and give the script --dist-backend gloo")
    elif args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")


def visible_gpu_count():
    """Number of GPUs CUDA would show a child, found without importing torch when possible."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return count_cuda_visible_devices(visible)
    count = _nvidia_smi_gpu_count()
    if count is not None:
        return count
    try:  # last resort: torch is slow to import
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


def launcher_env(environ, nproc_per_node):
    """Variables the launcher adds to its own environment, which every child inherits."""
    extra = {}
    # NVLink multicast (NVLS) stays off unless the user sets NCCL_NVLS_ENABLE: on shared hosts a program
    # using it can take the GPUs out of service for others; the all-reduces here do not need it.
    if "NCCL_NVLS_ENABLE" not in environ:
        extra["NCCL_NVLS_ENABLE"] = "0"
    if "OMP_NUM_THREADS" not in environ and nproc_per_node > 1:
        extra["OMP_NUM_THREADS"] = "1"  # torchrun's default: N processes would oversubscribe the cores
    return extra


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


def root_cause(codes):
    """Index of the child that failed first among ``codes`` (returncodes, None: running), else
    None. Of several found dead in one poll, one killed by a signal comes first: the others
    most likely failed because it was gone."""
    failed = [i for i, code in enumerate(codes) if code]
    if not failed:
        return None
    return min(failed, key=lambda i: (codes[i] > 0, i))


def _say(message):
    print(f"multiproc: {message}", file=sys.stderr, flush=True)


class _Stop(Exception):
    """A forwarded signal arrived while no child was running."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Launch:
    """One run of the launcher: its flags, the signals it got, and what the children did."""

    def __init__(self, args):
        self.args = args
        self.received = []  # forwarded signals, in order of arrival
        self.live = False  # children are running: signals are acted on by supervise()
        self.stop_requested = False  # a signal ended the run: no restart
        self.failure = None  # (global rank, exit status) that ended the current attempt
        self.idle_exception = _Stop
        self.omp_default = False  # the launcher chose OMP_NUM_THREADS=1
        self._ignored = None  # signals ignored when the launcher started

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        self.received.append(signum)
        if not self.live and self.idle_exception is not None:
            raise self.idle_exception(signum)  # in a rendezvous or between attempts: stop here

    def install_handlers(self):
        """Our handler for the forwarded signals (again after torch's agent put its own)."""
        if self._ignored is None:  # `nohup` and background jobs rely on these staying ignored
            self._ignored = {s for s in FORWARDED_SIGNALS if signal.getsignal(s) == signal.SIG_IGN}
        for sig in FORWARDED_SIGNALS:
            if sig in self._ignored:
                signal.signal(sig, signal.SIG_IGN)
                continue
            signal.signal(sig, self._on_signal)

    def finished(self):
        """The agent is done: a signal arriving now (SLURM sends one to every process of the
        step, the ranks may have stopped on theirs already) must not cut the exit short."""
        self.idle_exception = None

    # -- the children ------------------------------------------------------------------------
    def announce(self, group, restart, max_restarts):
        n, args = self.args.nproc_per_node, self.args
        ranks = [w.global_rank for w in group.workers]
        first = ranks[0]
        others = (f"rank {ranks[1]} logs" if n == 2 else f"ranks {ranks[1]}..{ranks[-1]} log") if n > 1 else ""
        logs = f"; {others} to {log_path(args.log_dir, '<rank>')}" if n > 1 else ""
        again = f"restart {restart} of {max_restarts}: " if restart else ""
        omp = ("; OMP_NUM_THREADS=1 in each (torchrun's default; set it to change)"
               if self.omp_default and not restart else "")
        _say(f"{again}starting {n} process{'es' if n > 1 else ''} (node {group.group_rank} of "
             f"{group.group_world_size}, world size {group.workers[0].world_size}, master "
             f"{group.master_addr}:{group.master_port}); rank {first} on this terminal{logs}{omp}")

    def supervise(self, procs, ranks):
        """Act on a failed child or a received signal: stop every child (SIGTERM or the signal,
        SIGKILL after the grace period or a further signal). Returns at once when neither."""
        codes = [p.poll() for p in procs]
        new_signal = len(self.received) > 0 and not self.stop_requested
        failed = root_cause(codes)
        if failed is None and not new_signal:
            return
        if new_signal:
            self.stop_requested = True
            sig = self.received[0]
            _say(f"got {signal.Signals(sig).name}; forwarding it")
        else:
            status = exit_status(codes[failed])
            self.failure = (ranks[failed], status)
            where = "output: " + self._output(failed, ranks[failed])
            how = f", killed by {signal.Signals(-codes[failed]).name}" if codes[failed] < 0 else ""
            _say(f"rank {ranks[failed]} exited with status {status} ({where}{how})")
            sig = signal.SIGTERM
            if any(code is None for code in codes):
                _say("sending SIGTERM to the others")
        self._stop(procs, ranks, sig)

    def _stop(self, procs, ranks, sig):
        signal_all(procs, sig)
        kill_at, seen = time.monotonic() + self.args.grace_period, len(self.received)
        while True:
            codes = [p.poll() for p in procs]
            if self.failure is None:  # a stop we asked for: report the first non-zero status
                first = next((i for i, code in enumerate(codes) if code), None)
                if first is not None:
                    self.failure = (ranks[first], exit_status(codes[first]))
            if all(code is not None for code in codes):
                return
            if kill_at is not None and (time.monotonic() >= kill_at or len(self.received) > seen):
                # Grace period over, or the user signalled again (a second Ctrl-C): stop waiting.
                running = [(rank, self._output(i, rank)) for i, (rank, code) in enumerate(zip(ranks, codes))
                           if code is None]
                who = ", ".join(f"rank {rank} (output: {where})" for rank, where in running)
                if len(self.received) > seen:
                    _say(f"sending SIGKILL to {who}")
                else:
                    # A rank that outlives the grace period is stuck (in a collective, or stopped):
                    # most likely the one the others timed out waiting for, so name it.
                    _say(f"{who} stalled: still running {self.args.grace_period:g} s after "
                         f"{signal.Signals(sig).name}; sending SIGKILL")
                signal_all(procs, signal.SIGKILL)
                kill_at = None
            time.sleep(POLL_S)

    def _output(self, index, rank):
        """Where the child at ``index`` (global rank ``rank``) writes."""
        return "this terminal" if index == 0 else log_path(self.args.log_dir, rank)

    def after_failure(self, restarts_left, max_restarts):
        """Say what happens after a failed attempt; returns the restarts still allowed."""
        if self.received:  # stopped on request (or signalled while stopping): no restart
            return 0
        rank, status = self.failure or ("?", 1)
        if restarts_left and status == USER_ERROR:
            _say(f"not restarting: rank {rank} stopped with a user error (status {USER_ERROR}), which a "
                 "restart would repeat; its message says what to change")
            return 0
        if restarts_left and status in STOP_STATUSES:
            _say(f"not restarting: rank {rank} was stopped by {STOP_STATUSES[status].name} (status {status}), "
                 "a stop request rather than a failure")
            return 0
        if not restarts_left and max_restarts:
            _say(f"no restarts left ({max_restarts} used); stopping")
        return restarts_left

    def status(self):
        """The launcher's exit status once the agent is done."""
        if self.failure is not None:
            return self.failure[1]
        return 128 + self.received[0] if self.received else 0


def _agent_class():
    """torch's LocalElasticAgent, with this launcher's failure, signal and log handling."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        launch: Launch

        def _rendezvous(self, worker_group):
            handler = worker_group.spec.rdzv_handler
            if getattr(handler, "_bootstrap_store_info", None) is not None:
                # A restart. The processes' store (MASTER_ADDR:MASTER_PORT) still holds the keys
                # of the attempt that failed, and a restarted gloo or NCCL group would read the
                # dead peers' addresses from it: drop it, so the rendezvous round opens a new
                # one (on a port the OS picks) and tells every node where.
                handler._bootstrap_store_info = None
                handler._shared_tcp_store_server = None
            try:
                return super()._rendezvous(worker_group)
            except Exception as e:
                if type(e).__name__ == "SignalException":
                    raise
                raise _RendezvousFailed(e) from e

        def _start_workers(self, worker_group):
            spec = worker_group.spec
            restart = spec.max_restarts - self._remaining_restarts
            self.launch.announce(worker_group, restart, spec.max_restarts)
            self.launch.failure = None
            # The agent installs its own handlers while it spawns: block ours until the children
            # exist and our handlers are back (the shim unblocks them in each child).
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
            try:
                ids = super()._start_workers(worker_group)
                self.launch.install_handlers()
                self.launch.live = True
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            return ids

        def _monitor_workers(self, worker_group):
            handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
            if handlers:
                local = sorted(handlers)
                self.launch.supervise([handlers[i].proc for i in local],
                                      [worker_group.workers[i].global_rank for i in local])
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.UNHEALTHY):
                self.launch.live = False
                if result.is_failed():
                    if self.launch.failure is None and result.failures:
                        rank, f = min(result.failures.items(), key=lambda kv: kv[1].timestamp)
                        self.launch.failure = (rank, exit_status(f.exitcode))
                    self._remaining_restarts = self.launch.after_failure(
                        self._remaining_restarts, worker_group.spec.max_restarts)
            return result

    return Agent


class _RendezvousFailed(Exception):
    """The nodes could not meet (address, port, other nodes): a user-fixable error."""


def _quiet_torch_logs():
    """torch's agent logs every step at WARNING and above; this launcher says what matters in
    one line each. LOGLEVEL=INFO (as for torchrun) shows torch's own lines again."""
    if not os.environ.get("LOGLEVEL"):  # call after importing torch, which sets its loggers up
        log = logging.getLogger("torch.distributed.elastic")
        log.addHandler(logging.NullHandler())
        log.propagate = False


def launch(args):
    """Run the agent until the group finished, failed past its restarts, or was stopped."""
    run = Launch(args)
    run.install_handlers()  # before anything starts, so no signal slips between
    tmp = None
    try:
        extra = launcher_env(os.environ, args.nproc_per_node)
        run.omp_default = "OMP_NUM_THREADS" in extra
        os.environ.update(extra)
        # torch's handlers go on these signals while the agent spawns; ignored ones stay ignored.
        handled = [s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if s not in run._ignored]
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(handled + ["SIGQUIT"])
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous import registry
        _quiet_torch_logs()
        run.idle_exception = lambda signum: SignalException(signal.Signals(signum).name,
                                                            sigval=signal.Signals(signum))
        backend, endpoint, run_id, min_nodes, max_nodes, local_addr, config = args.rdzv
        params = RendezvousParameters(backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=min_nodes,
                                      max_nodes=max_nodes, local_addr=local_addr, **config)
        try:
            handler = registry.get_rendezvous_handler(params)
        except Exception as e:
            raise _RendezvousFailed(e) from e
        spec = WorkerSpec(role="trainer", local_world_size=args.nproc_per_node, entrypoint=sys.executable,
                          args=("-S", "-c", _CHILD, args.log_dir, args.script, *args.script_args),
                          rdzv_handler=handler, max_restarts=args.max_restarts, monitor_interval=POLL_S,
                          local_addr=local_addr)
        # torch's per-attempt folders for the error files it gives each child: ours to delete
        tmp = tempfile.mkdtemp(prefix="multiproc-")
        Agent = _agent_class()
        options = {"shutdown_timeout": max(1, int(round(args.grace_period)))}
        accepted = inspect.signature(Agent.__init__).parameters
        agent = Agent(spec, DefaultLogsSpecs(log_dir=tmp),
                      **{k: v for k, v in options.items() if k in accepted})
        agent.launch = run
        shutdown = True
        try:
            agent.run()
        except SignalException:
            shutdown = False  # as torchrun: a signalled agent leaves the rendezvous open
            raise
        finally:
            if shutdown:
                handler.shutdown()
        return run.status()
    except _Stop:
        return run.status()
    except _RendezvousFailed as e:
        cause = e.__cause__ or e
        text = str(cause).strip().splitlines()
        where = args.rdzv[1]
        _say(f"error: the rendezvous at {where} failed ({type(cause).__name__}: {text[0] if text else ''}); "
             "check that the address is this or a reachable host, the port is free (or the same on every "
             "node) and every node gives the same --nnodes")
        return 2
    except Exception as e:
        if type(e).__name__ == "SignalException":
            return run.status()
        raise
    finally:
        run.finished()  # the handlers stay until the process exits
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    """Run the launcher; returns its exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        validate(args)
        os.makedirs(args.log_dir, exist_ok=True)
    except (UsageError, OSError) as e:
        _say(f"error: {e}")
        return 2
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
