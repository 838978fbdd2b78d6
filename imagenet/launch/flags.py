"""The launcher's command line: its flags (torchrun's, in both spellings), checked as a whole
before anything starts, with the rendezvous they choose; a mistake is a :class:`UsageError`,
one line and exit status 2."""

import argparse
import os
import uuid

from .gpus import visible_gpu_count

DEFAULT_RDZV_PORT = 29400  # torchrun's, for --rdzv-endpoint HOST without a port


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
