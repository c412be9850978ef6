"""The links of the model: one latency alpha and bandwidth beta per hop, from spec sheets."""
import dataclasses
import re

from ringnet.comm.cost import LINK_SPECS, SOFTWARE_ALPHA_S

__all__ = ["Link", "LINKS", "SOFTWARE_ALPHA_S", "tbf_burst_bytes"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One hop: a message of ``n`` bytes takes ``alpha_s + n / beta_Bps`` seconds.

    ``burst_bytes``: a link shaped by a token bucket (tc tbf) passes that many bytes at the
    wire's speed after it has been idle long enough to refill (burst / beta: the bucket
    refills at the rate while the link sends nothing); the collectives that follow compute
    meet it full (0: no bucket)."""
    name: str
    alpha_s: float
    beta_Bps: float
    source: str = ""
    burst_bytes: float = 0.0

    def time(self, nbytes):
        """Return the seconds one message of ``nbytes`` takes on this hop."""
        return self.alpha_s + nbytes / self.beta_Bps if nbytes else 0.0


# β per direction from the spec sheets, α their latency plus ringnet's per-message cost:
# the constants live with the rest of the cost model (ringnet.comm.cost).
LINKS = {name: Link(name, latency + SOFTWARE_ALPHA_S, beta, source)
         for name, (latency, beta, source) in LINK_SPECS.items()}


_RATE_UNITS = {"bit": 1 / 8, "": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
               "tbit": 1e12 / 8, "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
               "kibit": 1024 / 8, "mibit": 2 ** 20 / 8, "gibit": 2 ** 30 / 8,
               "tibit": 2 ** 40 / 8, "kibps": 1024, "mibps": 2 ** 20, "gibps": 2 ** 30,
               "tibps": 2 ** 40}


def tbf_burst_bytes(rate):
    """Return the burst ``hpc/cluster.sh`` gives a tbf of ``rate`` (tc's notation, e.g.
    "1gbit"): 1 ms of the rate, at least 64 KiB; 64 KiB for a rate it cannot read."""
    match = re.match(r"^(\d+(?:\.\d+)?)(.*)$", str(rate).strip())
    unit = match.group(2).lower() if match else None
    if unit not in _RATE_UNITS:
        return 65536
    return max(65536, int(float(match.group(1)) * _RATE_UNITS[unit] / 1000))
