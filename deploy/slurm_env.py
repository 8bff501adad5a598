"""The Slurm allocation a launcher runs in: its nodes (from ``SLURM_JOB_NODELIST``) and ``srun``.

Slurm sets ``SLURM_JOB_NODELIST`` (and ``SLURM_JOB_ID``) in the environment of a batch script
(``sbatch``) and of the shell ``salloc`` starts, in its compressed host-list syntax
(``node[01-03,07],gpu5``). :func:`expand_hostlist` expands that syntax here;
:func:`expand_nodelist` asks ``scontrol show hostnames`` first where it is installed (Slurm's own
parser knows every site's variant) and falls back to :func:`expand_hostlist`.
"""

from __future__ import annotations

import itertools
import logging
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

_NUMBER = re.compile(r"[0-9]+")


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"host list {text!r}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {text!r}: ']' without '['")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"host list {text!r}: '[' without ']'")
    items.append(text[start:])
    return items


def _expand_ranges(text: str, spec: str) -> list[str]:
    """``01-03,7`` -> ``01 02 03 7``: a range keeps the width of its lower end (Slurm's rule)."""
    numbers = []
    for part in spec.split(","):
        low, dash, high = part.strip().partition("-")
        if not _NUMBER.fullmatch(low) or (dash and not _NUMBER.fullmatch(high)):
            raise ConfigError(f"host list {text!r}: [{spec}] is not a list of numbers and ranges")
        if not dash:
            numbers.append(low)
            continue
        if int(high) < int(low):
            raise ConfigError(f"host list {text!r}: range {part} runs backwards")
        numbers.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return numbers


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5.

    Names are comma-separated; a bracket holds numbers and ``LOW-HIGH`` ranges, zero-padded to
    the width of ``LOW``; several brackets in one name expand to every combination, the first
    bracket varying slowest (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2). Order and repeats are
    kept as written.

    Raises:
        ConfigError: an empty list or name, unbalanced or nested brackets, a bad range.
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        item = item.strip()
        if not item:
            raise ConfigError(f"host list {text!r} has an empty entry")
        hosts.extend(_expand_name(text, item))
    return hosts


def _expand_name(text: str, item: str) -> list[str]:
    pieces: list[list[str]] = []  # literal text and bracket expansions, in order
    pos = 0
    while pos < len(item):
        start = item.find("[", pos)
        if start < 0:
            pieces.append([item[pos:]])
            break
        end = item.index("]", start)  # there is one: _split_top_level checked the brackets
        pieces.append([item[pos:start]])
        pieces.append(_expand_ranges(text, item[start + 1 : end]))
        pos = end + 1
    return ["".join(combination) for combination in itertools.product(*pieces)]


def expand_nodelist(nodelist: str, path: str | None = None) -> list[str]:
    """The node names of ``nodelist``: by ``scontrol show hostnames`` where ``scontrol`` is on
    ``path`` (default: ``PATH``) and works, else by :func:`expand_hostlist`."""
    scontrol = shutil.which("scontrol", path=path)
    if scontrol is not None:
        try:
            result = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            hosts = result.stdout.split()
            if hosts:
                return hosts
        except (OSError, subprocess.SubprocessError) as exc:
            logger.debug("scontrol show hostnames %s failed (%s); expanding it here", nodelist, exc)
    return expand_hostlist(nodelist)


@dataclass(frozen=True)
class Allocation:
    """The part of a Slurm allocation the launcher uses.

    Attributes:
        job_id: ``SLURM_JOB_ID`` (None if unset: only used in messages).
        nodes: the allocation's node names, in Slurm's order.
        srun: the path of ``srun``.
    """

    job_id: str | None
    nodes: tuple[str, ...]
    srun: str


def allocation_from_env(env: Mapping[str, str]) -> Allocation:
    """Read the allocation this process runs in from Slurm's variables in ``env``.

    Raises:
        ConfigError: not inside an allocation (no ``SLURM_JOB_NODELIST``), no ``srun`` on
            ``PATH``, or a node list that cannot be expanded.
    """
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
    if not nodelist:
        raise ConfigError(
            "--launcher slurm runs inside a Slurm allocation (an sbatch script or an salloc "
            "shell), but SLURM_JOB_NODELIST is not set"
        )
    srun = shutil.which("srun", path=env.get("PATH"))
    if srun is None:
        raise ConfigError("--launcher slurm needs srun, which is not on PATH")
    nodes = expand_nodelist(nodelist, env.get("PATH"))
    return Allocation(job_id=env.get("SLURM_JOB_ID") or None, nodes=tuple(nodes), srun=srun)
