"""Launch modes and everything that crosses processes or GPUs.

* ``distributed`` -- :class:`DistContext` (mode, rank, world size, device) from the flags and the
  launcher's environment (multiproc, torchrun, SLURM); DDP wrapping; reductions over ranks.
* ``dataparallel`` -- DataParallel whose replicas live in long-lived threads.
* ``spawn`` -- ``--multiprocessing-distributed``: one process per GPU from the training command.
* ``preemption`` -- SIGTERM / SIGINT / SIGUSR1: finish the step, save, exit with a status that
  says so; ranks agree on when to stop.

May import: ``imagenet.base``.
"""
