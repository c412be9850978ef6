"""Sharded loading across real MPI ranks, checked against a single-process loader."""
import numpy as np
import pytest

from ringnet.data import ShardedLoader, iterate_eval, open_dataset

MPI = pytest.importorskip("mpi4py.MPI")

GLOBAL_BATCH = 24  # divisible by every world size 1..4


@pytest.mark.mpi
def test_rank_parts_match_single_process():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    with open_dataset("digits") as ds:
        kwargs = dict(seed=7, mean=ds.mean, std=ds.std, prefetch=2)
        mine = ShardedLoader(ds.train, GLOBAL_BATCH, rank=rank, size=size, **kwargs)
        single = ShardedLoader(ds.train, GLOBAL_BATCH, **kwargs)
        steps = 6
        gen = mine.epoch(1)
        local = [next(gen) for _ in range(steps)]
        gen.close()  # abandon the epoch midway: the prefetch thread must stop
        local_idx = [mine.local_indices(1, s) for s in range(steps)]
        # Collective work first, asserts after: a failure on one rank cannot hang the others.
        gathered_idx = comm.allgather(local_idx)
        gathered_x = comm.allgather([x for x, _ in local])
        gathered_y = comm.allgather([y for _, y in local])
        reference = list(zip(range(steps), single.epoch(1)))
    for step, (x_ref, y_ref) in reference:
        idx = np.concatenate([gathered_idx[r][step] for r in range(size)])
        assert len(np.unique(idx)) == GLOBAL_BATCH, f"step {step}: rank parts overlap"
        assert np.array_equal(idx, single.batch_indices(1, step)), f"step {step}: indices"
        assert np.array_equal(np.concatenate([gathered_x[r][step] for r in range(size)]),
                              x_ref), f"step {step}: images differ from the single run"
        assert np.array_equal(np.concatenate([gathered_y[r][step] for r in range(size)]),
                              y_ref), f"step {step}: labels differ from the single run"


@pytest.mark.mpi
def test_eval_parts_cover_test_set():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    with open_dataset("digits") as ds:
        labels = [y for _, y in iterate_eval(ds.test, 50, rank, size,
                                             mean=ds.mean, std=ds.std)]
        counts = np.bincount(np.concatenate(labels), minlength=10)
        total = np.empty_like(counts)
        comm.Allreduce(counts, total)  # what a trainer does with per-rank correct counts
        expected = np.bincount(ds.test.labels, minlength=10)
        parts = comm.allgather(np.concatenate(labels))
    assert np.array_equal(total, expected)
    assert np.array_equal(np.concatenate(parts), ds.test.labels)
