"""A System by name: a profile of spec-sheet links (``INTRA[/INTER]``), or ``local``, the
links and cores a calibration measured."""
from ringnet.errors import UsageError
from ringnet.perfmodel.calibration import calibration_record
from ringnet.perfmodel.links import LINKS
from ringnet.perfmodel.system import System

__all__ = ["make_system"]


def make_system(spec, compute, ranks_per_node, calibration=None):
    """Return the System for a profile string ``INTRA[/INTER]`` or ``local``."""
    if spec == "local":
        if calibration is None:
            raise UsageError("profile 'local' needs a calibration (--calibrate or --calibration FILE)")
        # from the raw timings when present, so a saved calibration follows this code
        records = {int(k): (calibration_record(int(k), v["raw"], compute.add_s_per_elem)
                            if "raw" in v and compute is not None else v)
                   for k, v in calibration["by_np"].items()}
        # calibrated on a cluster (its ranks placed so many to a node): the same placement
        placed = next((v["raw"]["placement"]["per_node"] for v in calibration["by_np"].values()
                       if (v.get("raw", {}).get("placement") or {}).get("per_node")), None)
        system = System("local", None, None, 1 << 30, compute, calibrated=records,
                        placed_per_node=placed)
        return system.at(min(records))
    names = spec.split("/")
    if len(names) > 2 or any(n not in LINKS for n in names):
        raise UsageError(f"unknown profile {spec!r}: use INTRA[/INTER] with names from "
                         f"{', '.join(LINKS)}, or local")
    return System(spec, LINKS[names[0]], LINKS[names[-1]], ranks_per_node, compute)
