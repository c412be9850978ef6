"""Data sets in the ringnet HDF5 layout and per-rank sharded mini-batch loading."""
from ringnet.data.catalog import (DOWNLOADABLE, NAMED, Dataset, Split, channel_stats,
                                   check_compatible, data_dirs, default_data_dir,
                                   find_dataset, open_dataset)
from ringnet.data.hdf5 import SPLITS, atomic_output, validate_file, write_dataset
from ringnet.data.loader import ShardedLoader, iterate_eval, normalize
from ringnet.data.synthetic import make_synthetic

__all__ = ["NAMED", "DOWNLOADABLE", "SPLITS", "Dataset", "Split", "open_dataset",
           "check_compatible", "find_dataset", "data_dirs", "default_data_dir",
           "channel_stats", "ShardedLoader", "iterate_eval", "normalize",
           "make_synthetic", "write_dataset", "validate_file", "atomic_output"]
