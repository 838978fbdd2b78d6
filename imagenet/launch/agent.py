"""The launch itself on torch's elastic agent (``LocalElasticAgent``, what torchrun runs): the
rendezvous the flags chose, the children started as :data:`.group.CHILD`, their monitoring and
restarts through :class:`.group.Launch`; and ``main``, ``python -m multiproc``'s entry. torch is
imported here only when a launch starts."""

import inspect
import logging
import os
import shutil
import signal
import sys
import tempfile

from .flags import UsageError, parse_args, validate
from .gpus import launcher_env
from .group import FORWARDED_SIGNALS, POLL_S, CHILD, Launch, Stop, exit_status, say


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
            local = sorted(handlers)
            procs = [handlers[i].proc for i in local]
            ranks = [worker_group.workers[i].global_rank for i in local]
            if procs:
                self.launch.supervise(procs, ranks)
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.UNHEALTHY):
                if result.is_failed() and procs and self.launch.failure is None and not self.launch.stop_requested:
                    # The child died between our poll and torch's: say which, and stop the others
                    # ourselves, as when we see it first.
                    self.launch.supervise(procs, ranks)
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
        handled = [s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if s not in run.ignored]
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
                          args=("-S", "-c", CHILD, args.log_dir, args.script, *args.script_args),
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
    except Stop:
        return run.status()
    except _RendezvousFailed as e:
        cause = e.__cause__ or e
        text = str(cause).strip().splitlines()
        where = args.rdzv[1]
        say(f"error: the rendezvous at {where} failed ({type(cause).__name__}: {text[0] if text else ''}); "
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
        say(f"error: {e}")
        return 2
    return launch(args)
