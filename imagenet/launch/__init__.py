"""The launcher behind ``python -m multiproc`` (multiproc.py's docstring is its user guide): one
training process per GPU on torch's elastic agent, torchrun's environment in each, restarts.

* ``flags`` -- the command line and its checks; the rendezvous the flags choose.
* ``gpus`` -- the GPUs a child would see, the variables every child inherits.
* ``group`` -- the child shim, forwarded signals, stopping the group, restart decisions.
* ``agent`` -- torch's agent with the group's handling; ``launch`` and ``main``.

Importing it imports neither torch nor training code (the children run main.py; torch is
imported when a launch starts), so a bad flag is reported at once.

May import: nothing of ``imagenet`` outside this package.
"""
