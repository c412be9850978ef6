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
