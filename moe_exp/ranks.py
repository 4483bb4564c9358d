"""This process's place among the ranks that torchrun, the elastic agent or SLURM started.

Read from torch's environment variables, in one place."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int  # ranks in the whole job (every node)
    local_world: int | None  # ranks on this node (torchrun's LOCAL_WORLD_SIZE)


def rank_env() -> RankEnv | None:
    """This process's RankEnv, read from torch's env; None unless RANK and WORLD_SIZE are set.

    None means a process that launches its own ranks."""
    try:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        return RankEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                       int(local) if local is not None else None)
    except (KeyError, ValueError):
        return None


def world_size(devices: int) -> int:
    """Ranks in the whole job: the larger of torchrun's WORLD_SIZE and this machine's devices."""
    env = rank_env()
    return max(devices, env.world) if env else devices
