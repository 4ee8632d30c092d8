"""``session.data_loader``: the loader a job's spec asks for, a shared one or a plain DataLoader.

With ``[loader] share = true`` (or a job's ``loader = "name"``) the jobs of a loader group get a
:class:`~hpcstagger.loader.SharedLoader` named ``<run>.<group>``: one producer on the node prepares
each batch once for all of them, and each rank of a data-parallel job takes its share. Otherwise
the job gets a plain ``torch.utils.data.DataLoader`` with the same arguments (shuffled unless
``shuffle=False``, and with a DistributedSampler for a job of several ranks), so the training script
is the same either way.
"""

from __future__ import annotations

from typing import Any, Protocol

from hpcstagger.comm import Comm
from hpcstagger.nodeload import usable_cores
from hpcstagger.spec.jobspec import Spec
from hpcstagger.loader import to_device

__all__ = ["LoaderOwner", "data_loader", "producer_workers"]


class LoaderOwner(Protocol):
    """What :func:`data_loader` needs of the job it builds a loader for (an :class:`hpcstagger.Session`)."""

    spec: Spec | None
    job: str
    comm: Comm

    def say(self, message: str) -> None:
        """Print one line about this job (on its leader)."""

_SHARED_ONLY = ("pace", "hold", "window", "segments", "slot_bytes", "timeout", "root", "private")


def data_loader(session: LoaderOwner, dataset: Any, batch_size: int = 1, *, share: bool | None = None,
                shuffle: bool = True, seed: int = 0, **kwargs: Any) -> Any:
    """The job's loader over ``dataset``: shared when the spec (or ``share=True``) says so.

    ``kwargs`` are DataLoader arguments (``num_workers``, ``collate_fn``, ``worker_init_fn``,
    ``prefetch_factor``, ``drop_last``); SharedLoader's own (``pace``, ``hold``, ...) override the
    spec's ``[loader]`` table and are ignored for a plain DataLoader. ``device="cuda:N"`` delivers
    batches on that GPU either way (a plain DataLoader pins memory and copies each batch)."""
    spec = session.spec
    group = spec.loader_group(session.job) if spec is not None else ""
    if share is None:
        share = bool(group)
    world, rank = session.comm.size, session.comm.rank
    if not share:
        plain = {k: v for k, v in kwargs.items() if k not in _SHARED_ONLY}
        device = plain.pop("device", None)
        if device is None:
            return _plain(dataset, batch_size, shuffle, seed, rank, world, plain)
        import torch

        if torch.device(device).type == "cuda":
            plain.setdefault("pin_memory", True)
        return _OnDevice(_plain(dataset, batch_size, shuffle, seed, rank, world, plain), device)
    from hpcstagger.loader import SharedLoader

    run = spec.run.name if spec is not None else "hpcstagger"
    opts: dict[str, Any] = {}
    if spec is not None:
        opts["pace"] = spec.loader.pace
        if spec.loader.window:
            opts["window"] = spec.loader.window
        if spec.loader.segments:
            opts["segments"] = spec.loader.segments
    opts.update(kwargs)
    asked = int(opts.get("num_workers", 0))
    sharing, fixed = 1, 0
    if spec is not None:
        sharing = sum(j.ranks for j in spec.jobs if spec.loader_group(j.name) == group) if group else 1
        fixed = spec.loader.workers
    opts["num_workers"] = producer_workers(asked, sharing, usable_cores(), fixed)
    name = f"{run}.{group or session.job}"
    loader = SharedLoader(dataset, batch_size, name=name, shuffle=shuffle, seed=seed, rank=rank, world=world,
                          group=f"{run}.{session.job}", **opts)
    workers = loader.producer_workers
    session.say(f"shared loader {name!r}: this job takes {'rank shares of ' if world > 1 else ''}"
                f"its batches from one producer per node, which runs {workers} DataLoader worker(s)"
                + (f" ({sharing} sharing rank(s) asked for {asked} each)" if sharing > 1 else ""))
    return loader


def producer_workers(asked: int, sharing: int, cpus: int, fixed: int = 0) -> int:
    """The DataLoader workers of a shared loader's producer.

    ``fixed`` (the spec's ``[loader] workers``) when it is set. Otherwise the workers the ``sharing``
    ranks would have run with loaders of their own (``asked`` each), added up, but no more than
    the node's ``cpus`` and never fewer than ``asked``: one producer prepares for every job, and on
    a node with idle cores it should prepare as fast as the separate loaders did, while on a full
    node more workers than cores would only take turns. ``asked = 0`` (loading in the main
    process) stays 0."""
    if fixed > 0:
        return fixed
    if asked <= 0:
        return 0
    return max(asked, min(asked * max(sharing, 1), cpus))


def _plain(dataset: Any, batch_size: int, shuffle: bool, seed: int, rank: int, world: int,
           kwargs: dict[str, Any]) -> Any:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    if world > 1:
        sampler: Any = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=bool(shuffle), seed=seed,
                                     drop_last=bool(kwargs.pop("drop_last", False)))
        return DataLoader(dataset, batch_size, sampler=sampler, **kwargs)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return DataLoader(dataset, batch_size, shuffle=bool(shuffle), generator=gen, **kwargs)


class _OnDevice:
    """A plain DataLoader whose batches are moved to ``device`` (asynchronously, from pinned memory)."""

    def __init__(self, loader: Any, device: Any):
        self.loader, self.device = loader, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            yield to_device(batch, self.device, non_blocking=True)

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, batch_size... of the DataLoader
        if name == "loader":  # not set yet (never recurse)
            raise AttributeError(name)
        return getattr(self.loader, name)

