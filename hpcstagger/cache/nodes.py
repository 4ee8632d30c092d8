"""Which node each rank of a communicator runs on, for the partitioned cache.

The real nodes are found with ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``: the ranks that can
share memory form one node. Nodes are numbered in the order of (host name, lowest rank on the
node), so two jobs spread over the same hosts number them alike and agree on who owns a sample.

Nodes can be emulated on one machine in two ways:

- MPICH's own: ``MPIR_CVAR_NUM_CLIQUES=M MPIR_CVAR_CLIQUES_BY_BLOCK=1`` makes MPICH treat M
  blocks of ranks as M nodes. Discovery is the real one, and the traffic between the blocks goes
  through MPICH's network module, as between real nodes.
- hpcstagger's: the ``cache_nodes`` knob (``HPCSTAGGER_CACHE_NODES=M``) overrides discovery and
  makes blocks of consecutive ranks (rank ``r`` of ``n`` is on node ``r * M // n``) the nodes.
  The traffic goes through MPICH's shared-memory transport, whatever the MPI.

Either way several node groups then share one host name: the layout says so (``emulated``) and
the partitioned cache gives each node its own shm root, ``<root>/node<i>``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from hpcstagger import config
from hpcstagger.comm import UNSET, Comm, mpi_module
from hpcstagger.errors import ConfigError

__all__ = ["NodeLayout", "discover", "emulated_node", "layout_from"]


@dataclass(frozen=True)
class NodeLayout:
    """Where the ranks of one communicator run: ``nodes[i]`` are the ranks of node ``i`` (sorted),
    ``node`` is this rank's node, ``emulated`` is True when node groups share a host."""

    node: int
    nodes: tuple[tuple[int, ...], ...]
    emulated: bool = False

    @property
    def count(self) -> int:
        """The number of nodes."""
        return len(self.nodes)

    def local_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's node."""
        return self.nodes[self.node]


def emulated_node(rank: int, size: int, nodes: int) -> int:
    """The emulated node of ``rank`` of ``size`` among ``nodes``: blocks of consecutive ranks.

    Raises ConfigError for a node count that is not between 1 and ``size``.
    """
    if not 1 <= nodes <= size:
        raise ConfigError(f"cannot emulate {nodes} nodes with {size} rank(s): HPCSTAGGER_CACHE_NODES must be "
                          f"between 1 and the number of ranks (0 finds the real nodes)")
    return rank * nodes // size


def layout_from(entries: list[tuple[str, int]], rank: int) -> NodeLayout:
    """The layout from every rank's (host name, node key): ranks with equal pairs share a node.

    Nodes are numbered by (host, key). Pure: :func:`discover` gathers the pairs."""
    groups: dict[tuple[str, int], list[int]] = {}
    for r, pair in enumerate(entries):
        groups.setdefault((pair[0], int(pair[1])), []).append(r)
    order = sorted(groups)
    nodes = tuple(tuple(sorted(groups[g])) for g in order)
    hosts = [g[0] for g in order]
    return NodeLayout(order.index((entries[rank][0], int(entries[rank][1]))), nodes,
                      emulated=len(set(hosts)) < len(hosts))


def discover(comm: Comm, *, nodes: int | None = None, timeout: Any = UNSET) -> NodeLayout:
    """This communicator's nodes (collective). ``nodes`` (default: the ``cache_nodes`` knob) > 0
    emulates that many; 0 finds the real ones with ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``.

    Raises ConfigError for a bad emulated node count and CollectiveTimeout when a rank never arrives.
    """
    if not comm.is_mpi or comm.size == 1:
        return NodeLayout(0, ((0,),))
    count = int(config.get("cache_nodes") if nodes is None else nodes)
    host = socket.gethostname()
    if count > 0:
        key = emulated_node(comm.rank, comm.size, count)
    else:
        comm.barrier(timeout=timeout)  # every rank is here: the blocking split cannot hang
        MPI = mpi_module()
        local = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, comm.rank)
        try:
            key = local.bcast(comm.rank, root=0)  # the lowest rank on the node names it
        finally:
            local.Free()
    return layout_from(comm.allgather((host, key), timeout=timeout), comm.rank)
