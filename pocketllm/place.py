"""A process's place in a run: which rank of which world, and how it meets the others, read from
the launcher's environment, torchrun's, or the command line; or None, when this process is the
launcher and starts the ranks itself. Torch-free: the launcher reads it before it starts a rank,
and imports torch only to ask a GPU build of it whether a device is visible (docs/tensor-parallel.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pocketllm.errors import UsageError
from pocketllm.launch import ENV_RANK, ENV_RDZV, ENV_WORLD


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int
    file_store: str | None = None  # the launcher's private FileStore
    id_path: str | None = None  # the hand-started rendezvous file


def rank_env(tp_world: int | None, tp_rank: int | None, id_path: str | None, env=os.environ, default_world: int = 1) -> RankEnv | None:
    """This process's place in the run, or None when it must start the ranks itself. tp_world None
    means --tp-world was not given: torchrun's WORLD_SIZE, else `default_world`."""
    if ENV_RANK in env:
        world = int(env[ENV_WORLD])
        return RankEnv(int(env[ENV_RANK]), world, int(env[ENV_RANK]), world, file_store=env[ENV_RDZV])
    if under_torchrun(env):
        if tp_rank is not None or id_path:
            given = " and ".join(f for f, v in (("--tp-rank", tp_rank is not None), ("--rendezvous-file", bool(id_path))) if v)
            raise UsageError(f"{given}: for ranks started by hand; under torchrun each rank is its RANK and meets the others at "
                             "MASTER_ADDR:MASTER_PORT: drop it")
        world = _torchrun_int(env, "WORLD_SIZE", 1)
        rank = _torchrun_int(env, "RANK", 0)
        if tp_world not in (None, world):
            raise UsageError(f"--tp-world {tp_world} disagrees with torchrun's WORLD_SIZE={world}")
        if rank >= world:
            raise UsageError(f"torchrun's RANK={rank} is outside its WORLD_SIZE={world} (ranks 0..{world - 1})")
        local_world = _torchrun_int(env, "LOCAL_WORLD_SIZE", 1, world)
        local_rank = _torchrun_int(env, "LOCAL_RANK", 0, 0)
        if local_rank >= local_world:
            raise UsageError(f"torchrun's LOCAL_RANK={local_rank} is outside its LOCAL_WORLD_SIZE={local_world}")
        if world > 1:
            missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name, "").strip()]
            if missing:
                raise UsageError(f"RANK and WORLD_SIZE are set (torchrun's variables) but {' and '.join(missing)} not: "
                                 "run under torchrun, which sets them all, or set them beside RANK and WORLD_SIZE")
        return RankEnv(rank, world, local_rank, local_world)
    if tp_world is None:
        tp_world = default_world
    if tp_rank is not None:
        if not 0 <= tp_rank < tp_world:
            raise UsageError(f"--tp-rank must be in 0..{tp_world - 1}, got {tp_rank}")
        if not id_path:
            raise UsageError("--tp-rank needs --rendezvous-file FILE, the rendezvous file every rank names")
        return RankEnv(tp_rank, tp_world, tp_rank, tp_world, id_path=os.path.abspath(id_path))
    if id_path:
        raise UsageError("--rendezvous-file is for ranks started by hand: give each one --tp-rank i too (--tp-world N alone starts "
                         "every rank here, with a rendezvous of its own)")
    if tp_world == 1:
        return RankEnv(0, 1, 0, 1)
    return None


def under_torchrun(env=os.environ) -> bool:
    """Whether torchrun (or a launcher like it) placed this process: its RANK and WORLD_SIZE."""
    return "RANK" in env and "WORLD_SIZE" in env


def _torchrun_int(env, name: str, least: int, default: int | None = None) -> int:
    """A torchrun variable that must be an integer >= least (`default` when unset, if given)."""
    raw = env.get(name)
    if raw is None and default is not None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise UsageError(f"torchrun's {name}={raw!r} is not an integer") from None
    if value < least:
        raise UsageError(f"torchrun's {name}={value} must be >= {least}")
    return value
