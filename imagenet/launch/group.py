"""One launch's process group: the shim each child starts as, the forwarded signals, stopping
every child when one fails or a signal arrives (SIGTERM, then SIGKILL after the grace period),
naming the rank that failed or stalled, and whether a failed attempt may be restarted."""

import os
import signal
import sys
import time

POLL_S = 0.1  # how often children are polled; short enough that a failure stops the rest at once
# SIGHUP is forwarded too: children run in their own sessions (torch's agent starts them so), so
# a closed terminal would otherwise leave them running with nowhere to write. SIGUSR1 is SLURM's
# advance warning (#SBATCH --signal=USR1@120): main.py checkpoints and exits on it.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
USER_ERROR = 2  # main.py's exit status for a mistake a restart would only repeat
# A rank that ended with 128 + one of these stopped on request (main.py checkpoints first): SLURM
# signals every process of a job step, so the ranks may be done before the launcher's own copy
# of the signal arrives. Not a failure to restart from.
STOP_STATUSES = {128 + int(s): s for s in FORWARDED_SIGNALS}

# Each child starts as this shim, which points its output at the rank's log file (all but local
# rank 0) and then execs the script in its place: same pid, no process in between. torch's agent
# would open stdout and stderr as two files; one file with O_APPEND keeps both in order.
CHILD = """\
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


def say(message):
    print(f"multiproc: {message}", file=sys.stderr, flush=True)


class Stop(Exception):
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
        self.idle_exception = Stop
        self.omp_default = False  # the launcher chose OMP_NUM_THREADS=1
        self.ignored = None  # signals ignored when the launcher started

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        self.received.append(signum)
        if not self.live and self.idle_exception is not None:
            raise self.idle_exception(signum)  # in a rendezvous or between attempts: stop here

    def install_handlers(self):
        """Our handler for the forwarded signals (again after torch's agent put its own)."""
        if self.ignored is None:  # `nohup` and background jobs rely on these staying ignored
            self.ignored = {s for s in FORWARDED_SIGNALS if signal.getsignal(s) == signal.SIG_IGN}
        for sig in FORWARDED_SIGNALS:
            if sig in self.ignored:
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
        say(f"{again}starting {n} process{'es' if n > 1 else ''} (node {group.group_rank} of "
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
            say(f"got {signal.Signals(sig).name}; forwarding it")
        else:
            status = exit_status(codes[failed])
            self.failure = (ranks[failed], status)
            where = "output: " + self._output(failed, ranks[failed])
            how = f", killed by {signal.Signals(-codes[failed]).name}" if codes[failed] < 0 else ""
            say(f"rank {ranks[failed]} exited with status {status} ({where}{how})")
            sig = signal.SIGTERM
            if any(code is None for code in codes):
                say("sending SIGTERM to the others")
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
                    say(f"sending SIGKILL to {who}")
                else:
                    # A rank that outlives the grace period is stuck (in a collective, or stopped):
                    # most likely the one the others timed out waiting for, so name it.
                    say(f"{who} stalled: still running {self.args.grace_period:g} s after "
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
            say(f"not restarting: rank {rank} stopped with a user error (status {USER_ERROR}), which a "
                 "restart would repeat; its message says what to change")
            return 0
        if restarts_left and status in STOP_STATUSES:
            say(f"not restarting: rank {rank} was stopped by {STOP_STATUSES[status].name} (status {status}), "
                 "a stop request rather than a failure")
            return 0
        if not restarts_left and max_restarts:
            say(f"no restarts left ({max_restarts} used); stopping")
        return restarts_left

    def status(self):
        """The launcher's exit status once the agent is done."""
        if self.failure is not None:
            return self.failure[1]
        return 128 + self.received[0] if self.received else 0
