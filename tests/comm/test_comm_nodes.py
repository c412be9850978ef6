"""Nodes and progress (ringnet.placement, ringnet.comm.stream), without a cluster.

* ranks are grouped by node from what MPI says: the shared-memory group or the processor
  name, either one (shared memory turned off makes every rank its own group);
* ``RINGNET_CPU_PROGRESS=auto`` (the default) polls when the ranks span nodes and stays
  driven on one node; a value given wins;
* a transfer that times out names each peer's node when the ranks span nodes;
* the MPI path is read from the settings MPICH reads.
The same across real namespaces is tests/hpc/test_cluster_runs.py.
"""
import pytest
from mpi4py import MPI

from ringnet import comm as ringcomm
from ringnet.comm.mpi_transport import MpiTransport
from ringnet.placement import group, layout, mpi_path, ranks_text, where
from ringnet.comm.stream import CpuStream, progress_mode, resolve_progress
from ringnet.comm.transport import CommTimeoutError

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("names, shared, nodes, index, local", [
    # block placement, shared memory on: both say the same
    (["a", "a", "b", "b"], [0, 0, 2, 2], ["a", "b"], [0, 0, 1, 1], [0, 1, 0, 1]),
    # cyclic placement
    (["a", "b", "a", "b"], [0, 1, 0, 1], ["a", "b"], [0, 1, 0, 1], [0, 0, 1, 1]),
    # MPIR_CVAR_NOLOCAL=1: every rank its own shared-memory group; the names group them
    (["a", "a", "b", "b"], [0, 1, 2, 3], ["a", "b"], [0, 0, 1, 1], [0, 1, 0, 1]),
    # one node whose ranks report two shared-memory groups
    (["h", "h", "h"], [0, 0, 2], ["h"], [0, 0, 0], [0, 1, 2]),
    # two processor names in one shared-memory group: one node, named by its first rank
    (["x", "y", "z"], [0, 0, 2], ["x", "z"], [0, 0, 1], [0, 1, 0]),
])
def test_ranks_are_grouped_by_either_shared_memory_or_name(names, shared, nodes, index, local):
    found = group(names, shared)
    assert found.node_names == nodes and found.nodes == len(nodes)
    assert found.rank_node_index == index and found.rank_local_ranks == local
    assert found.rank_nodes == [nodes[i] for i in index]


def test_layout_text_and_rank_names():
    block = group(["n1", "n1", "n2", "n2"], [0, 1, 2, 3], rank=3)
    assert block.describe() == "2 nodes x 2 ranks (n1: ranks 0-1; n2: ranks 2-3)"
    assert (block.node, block.local_rank, block.local_size) == ("n2", 1, 2)
    cyclic = group(["n1", "n2", "n1", "n2", "n1"], [0, 1, 2, 3, 4])
    assert cyclic.describe() == "2 nodes with 2-3 ranks each (n1: ranks 0, 2, 4; n2: ranks 1, 3)"
    assert ranks_text([2, 3], block) == "ranks 2, 3 (node n2)"
    assert ranks_text([1, 2], block) == "rank 1 (node n1), rank 2 (node n2)"
    # a whole node's ranks first (a lost node), then the others it names
    assert ranks_text([0, 2, 3], block) == "ranks 2, 3 (node n2), rank 0 (node n1)"
    assert ranks_text([0, 1, 3], block) == "ranks 0, 1 (node n1), rank 3 (node n2)"
    assert ranks_text([0, 2, 4], cyclic) == "ranks 0, 2, 4 (node n1)"
    assert ranks_text([1], block) == "rank 1 (node n1)"
    assert where(2, block) == "rank 2 on n2"
    one = group(["h", "h"], [0, 0])
    assert one.describe() == "1 node x 2 ranks (h: ranks 0-1)"
    assert ranks_text([1], one) == "rank 1" and where(1, one) == "rank 1"


@pytest.mark.mpi
def test_ranks_are_named_with_the_world_s_nodes_only_for_the_world_s_ranks(monkeypatch):
    import ringnet.placement as nodes
    monkeypatch.setattr(nodes, "_WORLD", group(["n1", "n2"] * WORLD.Get_size(),
                                               list(range(2 * WORLD.Get_size()))))
    assert ranks_text([1]) == "rank 1 (node n2)"
    assert ranks_text([1], comm=WORLD) == "rank 1 (node n2)"
    if WORLD.Get_size() == 1:       # COMM_SELF is the world's ranks in order only at N = 1
        return
    assert ranks_text([1], comm=MPI.COMM_SELF) == "rank 1"


def test_layout_of_this_machine():
    found = layout(MPI.COMM_SELF)
    assert (found.nodes, found.node, found.local_rank, found.local_size) == \
        (1, MPI.Get_processor_name(), 0, 1)


@pytest.mark.mpi
def test_layout_of_the_world_on_one_machine():
    found = layout(WORLD)
    size = WORLD.Get_size()
    assert found.nodes == 1 and found.rank_local_ranks == list(range(size))
    assert found.rank_nodes == WORLD.allgather(MPI.Get_processor_name())
    assert found.local_rank == WORLD.Get_rank() and found.local_size == size


@pytest.mark.parametrize("setting, nodes, mode", [
    ("auto", 1, "driven"), ("auto", 2, "poll"), ("auto", 16, "poll"),
    ("driven", 2, "driven"), ("poll", 1, "poll"), ("block", 2, "block"),
])
def test_progress_auto_polls_across_nodes_only(monkeypatch, setting, nodes, mode):
    assert resolve_progress(setting, nodes) == mode
    monkeypatch.setenv("RINGNET_CPU_PROGRESS", setting)
    assert progress_mode(nodes) == mode
    with CpuStream(tag=9, nodes=nodes) as stream:
        assert stream.mode == mode


def test_progress_default_is_auto(monkeypatch):
    monkeypatch.delenv("RINGNET_CPU_PROGRESS", raising=False)
    assert progress_mode() == "driven" and progress_mode(2) == "poll"
    monkeypatch.setenv("RINGNET_CPU_PROGRESS", "fast")
    with pytest.raises(ValueError, match="use one of driven, poll, block, auto"):
        progress_mode()


TWO_NODES = group(["here", "there"], [0, 1])


@pytest.mark.parametrize("setting, node_layout, mode", [
    ("", TWO_NODES, "poll"), ("", None, "driven"), ("driven", TWO_NODES, "driven"),
])
def test_an_mpi_transport_s_streams_progress_for_its_nodes(monkeypatch, setting, node_layout, mode):
    monkeypatch.setenv("RINGNET_CPU_PROGRESS", setting)
    transport = MpiTransport(MPI.COMM_SELF, device="cpu", layout=node_layout)
    try:
        assert transport.nodes == (2 if node_layout else 1)
        stream = transport.new_stream()
        assert stream.mode == mode and stream.tag == 1
        stream.close()
    finally:
        transport.close()


def test_a_timeout_names_the_peer_s_node():
    # rank 0 of COMM_SELF is placed on "here" of two nodes: a receive nobody answers
    import numpy as np
    transport = MpiTransport(MPI.COMM_SELF, device="cpu", timeout_s=0.2, layout=TWO_NODES)
    try:
        with pytest.raises(CommTimeoutError, match=r"^recv from rank 0 on here of 8 bytes "
                                                   r"did not complete within 0.2 s$"):
            transport.recv(np.zeros(2, np.float32), 0)
    finally:
        transport.close()
    alone = MpiTransport(MPI.COMM_SELF, device="cpu", timeout_s=0.2)
    try:
        with pytest.raises(CommTimeoutError, match=r"^recv from rank 0 of 8 bytes did not"):
            alone.recv(np.zeros(2, np.float32), 0)
    finally:
        alone.close()


def test_mpi_path_from_mpich_s_settings():
    version = MPI.Get_library_version()
    if "MPICH" not in version:
        pytest.skip("not MPICH: the path is the library's name")
    across = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "MPIR_CVAR_NOLOCAL": "1"}
    assert mpi_path(across) == "MPICH ofi (tcp), no shared memory within a node (MPIR_CVAR_NOLOCAL=1)"
    assert mpi_path({"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self"}) == \
        "MPICH ucx (UCX_TLS=tcp,self)"
    device = next(l for l in version.splitlines() if l.startswith("MPICH Device:"))
    first = device.split(":", 2)[2].split()[0]      # "MPICH Device: ch4:ucx ofi" -> ucx
    assert mpi_path({}).startswith(f"MPICH {first}")


def test_placement_names_the_nodes_only_when_there_are_several(monkeypatch):
    monkeypatch.delenv("RINGNET_CPU_PROGRESS", raising=False)
    transport = ringcomm.make_transport("mpi", MPI.COMM_SELF, device="cpu")
    try:
        placed = transport.placement
        assert placed.describe() == "CPU, transport mpi (device cpu)"
        assert (placed.nodes, placed.node, placed.local_rank, placed.local_size) == \
            (1, MPI.Get_processor_name(), 0, 1)
        assert placed.rank_nodes == [MPI.Get_processor_name()] and placed.rank_local_ranks == [0]
        assert placed.mpi_path is None
        assert placed.progress == "driven (RINGNET_CPU_PROGRESS=auto: the ranks share one node)"
    finally:
        transport.close()
    across = ringcomm.Placement("cpu", None, "mpi", "device cpu").locate(
        TWO_NODES, "poll (RINGNET_CPU_PROGRESS=auto: the ranks span 2 nodes)")
    text = across.describe()
    assert text.startswith("CPU, transport mpi (device cpu), 2 nodes x 1 rank (here: rank 0; "
                           "there: rank 1), MPI over MPICH"), text
    assert text.endswith(", CPU streams poll (RINGNET_CPU_PROGRESS=auto: the ranks span 2 nodes)")
