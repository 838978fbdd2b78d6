"""A training run: wiring, the loops, the state, and every output.

* ``runner`` -- :func:`run`: launch mode -> data -> training state -> resume -> epochs; the banner.
* ``defaults`` -- fast by default: what each ``auto`` setting resolves to on this machine, and why.
* ``engine`` -- the loops: :func:`train_one_epoch`, :func:`validate`.
* ``schedule`` -- the learning rate's shape per optimizer step (step, cosine, triangular, poly).
* ``cadence`` -- which epochs validate (``--eval-every``, ``--eval-start``), the run's clock, the stop
  at ``--target-acc``.
* ``state`` -- :class:`TrainState` (model, optimizer, schedule, precision, weight average) and
  :class:`Progress`; building and wrapping them.
* ``ema`` -- the weight average (``--model-ema``).
* ``resume`` -- loading a checkpoint into the state (``--resume``).
* ``savepolicy`` -- when a run saves, and what a checkpoint holds.
* ``runlog`` / ``tblog`` -- config.yaml, metrics.jsonl, TensorBoard, skipped images, the summary.

May import: every layer below it (``data``, ``parallel``, ``models``, ``precision``, ``kernels``,
``base``).
"""
