"""Links (ringnet.perfmodel.links): the burst the model assumes for a shaped link is the one
hpc/cluster.sh gives tc."""
import os
import subprocess

import pytest

from tests.perfmodel.helpers import ROOT


@pytest.mark.parametrize("rate", ["1gbit", "10gbit", "100mbit", "2.5gbit", "500kbps", "fast"])
def test_tbf_burst_is_the_cluster_s(rate):
    """The burst the model assumes for a shaped link is the one hpc/cluster.sh gives tc."""
    from ringnet.perfmodel.links import tbf_burst_bytes
    script = os.path.join(ROOT, "hpc", "cluster.sh")
    shell = subprocess.run(["bash", "-c", f"eval \"$(sed -n '/^burst_of()/,/^}}/p' {script})\"; "
                           f"burst_of {rate}"], capture_output=True, text=True, check=True)
    assert tbf_burst_bytes(rate) == int(shell.stdout)


def test_the_spec_sheet_links_have_one_home_with_the_cost_model():
    """bench model's profiles and --topology auto's link between nodes come from the same
    constants (ringnet.comm.cost): 10 GbE as the model prices it is the cost model's INTER."""
    from ringnet.comm import cost
    from ringnet.perfmodel.links import LINKS
    assert set(LINKS) == set(cost.LINK_SPECS)
    for name, (latency, beta, source) in cost.LINK_SPECS.items():
        assert LINKS[name].alpha_s == latency + cost.SOFTWARE_ALPHA_S
        assert (LINKS[name].beta_Bps, LINKS[name].source) == (beta, source)
    eth = LINKS["eth-10g"]
    assert cost.INTER == (eth.alpha_s, 1 / eth.beta_Bps)
