"""The links of the model: one latency alpha and bandwidth beta per hop, from spec sheets."""
import dataclasses

__all__ = ["Link", "LINKS", "SOFTWARE_ALPHA_S"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One hop: a message of ``n`` bytes takes ``alpha_s + n / beta_Bps`` seconds."""
    name: str
    alpha_s: float
    beta_Bps: float
    source: str = ""

    def time(self, nbytes):
        """Return the seconds one message of ``nbytes`` takes on this hop."""
        return self.alpha_s + nbytes / self.beta_Bps if nbytes else 0.0


# β: per direction, from the spec sheets named in ``source``. α is never on a spec sheet:
# it is the hardware latency named there plus SOFTWARE_ALPHA_S, the per-message cost of
# ringnet's Python-level isendrecv + wait (stated, not measured; ``local`` measures its own).
SOFTWARE_ALPHA_S = 15e-6
# name: (hardware latency s, beta B/s per direction, source of both)
_LINK_SPECS = {
    "pcie3": (5e-6, 15.75e9, "PCIe 3.0 x16: 8 GT/s x 16 lanes, 128b/130b = 15.75 GB/s per direction (PCI-SIG "
                             "PCIe Base Specification 3.0); GPU peer copy latency ~5 us"),
    "pcie5": (5e-6, 63.0e9, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b = 63.0 GB/s per direction (PCI-SIG PCIe "
                            "Base Specification 5.0)"),
    "nvlink4": (3e-6, 450e9, "NVLink 4 on H100 SXM: 900 GB/s total per GPU = 450 GB/s per direction (NVIDIA H100 "
                             "Tensor Core GPU datasheet)"),
    "ib-hdr": (0.6e-6, 25e9, "InfiniBand HDR: 200 Gb/s per port = 25 GB/s per direction, sub-0.6 us latency "
                             "(NVIDIA ConnectX-6 VPI adapter product brief)"),
    "eth-10g": (25e-6, 1.25e9, "10 Gigabit Ethernet: 10 Gb/s = 1.25 GB/s per direction (IEEE 802.3ae); ~25 us "
                               "TCP small-message latency through the kernel stack"),
}
LINKS = {name: Link(name, latency + SOFTWARE_ALPHA_S, beta, source)
         for name, (latency, beta, source) in _LINK_SPECS.items()}
