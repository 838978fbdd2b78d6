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
The launcher's code is ``imagenet.launch``; importing it imports neither torch nor training code.
"""
import sys

from imagenet.launch.agent import main

if __name__ == "__main__":
    sys.exit(main())
