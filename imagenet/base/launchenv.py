"""Which process of which job this is, read from the launch environment before torch is imported:
torchrun's and ``python -m multiproc``'s variables (RANK, WORLD_SIZE, LOCAL_RANK), SLURM's task
variables, or the classic ``--world-size/--rank/--dist-url`` flags; SLURM's node lists and the
rendezvous a job step derives from them; the elastic agent's restart count. Pure functions of the
environment, so that ``main.py`` names a wrong variable in a tenth of a second, not after the five
that importing torch takes (:mod:`imagenet.cli`); :mod:`imagenet.parallel.distributed` acts on them.
"""

from __future__ import annotations

import itertools
import os
import re
from typing import Optional

from .errors import UserError


def _env_int(env: dict, name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer")


def distributed_env(cfg, env: Optional[dict] = None) -> Optional[dict]:
    """Rank/world/local rank from torchrun-style, SLURM or the classic flags; None if not distributed."""
    env = dict(os.environ if env is None else env)
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise UserError("RANK and WORLD_SIZE must be set together (as torchrun and "
                            "python -m multiproc do); unset the stray one")
        local = _env_int(env, "LOCAL_RANK")
        return _checked(rank, world, rank if local is None else local, "RANK/WORLD_SIZE environment")
    s_world = _env_int(env, "SLURM_NTASKS")
    if s_world is not None and s_world > 1 and cfg.world_size == -1:
        rank = _env_int(env, "SLURM_PROCID") or 0
        local = _env_int(env, "SLURM_LOCALID") or 0
        return _checked(rank, s_world, local, SLURM_SOURCE)
    if cfg.world_size >= 1 and (cfg.world_size > 1 or cfg.dist_url != "env://"):
        if cfg.rank < 0:
            raise UserError(f"--world-size {cfg.world_size} needs --rank (this process's rank, "
                            f"0..{cfg.world_size - 1})")
        local = cfg.gpu if cfg.gpu is not None else 0
        return _checked(cfg.rank, cfg.world_size, local, "--world-size/--rank flags")
    return None


SLURM_SOURCE = "SLURM task environment"
SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 20000  # ports 10000-29999: below Linux's ephemeral range


def slurm_master(env: dict) -> tuple:
    """(MASTER_ADDR, MASTER_PORT) for a SLURM job step: the environment's when set, else the first
    host of the step's (or job's) node list, where task 0 runs, and a port from the job id."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr:
        name = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)), None)
        if name is None:
            raise UserError("SLURM_NTASKS > 1 but no SLURM_JOB_NODELIST to find the first node in; run under "
                            "srun, or set MASTER_ADDR and MASTER_PORT")
        try:
            addr = first_node(env[name])
        except ValueError as e:
            raise UserError(f"{name}={env[name]!r} is not a SLURM node list ({e}); set MASTER_ADDR to the "
                            "first node's address")
    if not port:
        job = _env_int(env, "SLURM_JOB_ID")
        if job is None:
            raise UserError("SLURM_NTASKS > 1 but no SLURM_JOB_ID to derive the rendezvous port from; "
                            "set MASTER_PORT")
        port = str(SLURM_PORT_BASE + job % SLURM_PORT_SPAN)
    return addr, str(port)


def expand_nodelist(nodelist: str) -> list:
    """Every host of a SLURM node list in its compressed form, in order, as ``scontrol show
    hostnames`` prints them: ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5."""
    return list(_hosts(nodelist))


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list (``gpu[01-04,07]`` -> ``gpu01``), without scontrol."""
    return next(_hosts(nodelist))


_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def _hosts(nodelist: str):
    """Hosts of ``nodelist``, lazily; ValueError for text SLURM would not write."""
    for entry in _split_top_level(nodelist.strip()):
        parts, pos = [], 0  # literal text and bracket groups, alternating
        for m in _BRACKETS.finditer(entry):
            parts += [[entry[pos:m.start()]], _expand_ranges(m.group(1))]
            pos = m.end()
        parts.append([entry[pos:]])
        if any(c in "".join(p[0] for p in parts[::2]) for c in "[]"):
            raise ValueError(f"unbalanced brackets in {entry!r}")
        for combo in itertools.product(*parts):
            yield "".join(combo)


def _split_top_level(text: str) -> list:
    """Split at the commas outside brackets."""
    entries, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets at character {i}")
        if c == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("unbalanced brackets")
    entries.append(text[start:])
    if any(not e.strip() for e in entries):
        raise ValueError("an empty host name")
    return [e.strip() for e in entries]


def _expand_ranges(spec: str) -> list:
    """``01-03,07`` -> ['01', '02', '03', '07']: zero padding as written."""
    values = []
    for item in spec.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"[{spec}] is not a list of numbers and ranges")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item} runs backwards")
        values += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return values


def restart_count(env: Optional[dict] = None) -> int:
    """How often an elastic launcher restarted this process group after a failure (0: first start)."""
    env = os.environ if env is None else env
    count = _env_int(dict(env), "TORCHELASTIC_RESTART_COUNT")
    return max(count or 0, 0)


def _checked(rank: int, world: int, local: int, source: str) -> dict:
    if world < 1:
        raise UserError(f"world size must be at least 1 ({source} says {world})")
    if not 0 <= rank < world:
        raise UserError(f"rank {rank} is outside 0..{world - 1} for world size {world} ({source}); "
                        "every process needs a distinct rank below the world size")
    if local < 0:
        raise UserError(f"local rank {local} is negative ({source})")
    return {"rank": rank, "world_size": world, "local_rank": local, "source": source}
