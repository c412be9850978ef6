"""``python -m ringnet.bench model`` (ringnet.perfmodel.cli): --json has exactly the documented
keys, --plot writes a PNG, --save-compute saves a profile of training steps, --validate
writes its record and prints the README's table, --launcher places the calibration's ranks,
and bad input ends with one ``ringnet: error:`` line and exit 2."""
import json

import pytest

from ringnet import perfmodel as pm
from ringnet.errors import UsageError
from ringnet.perfmodel import cli

from tests.perfmodel.helpers import run_model_cli, validation_record, waits_raw


@pytest.fixture(scope="module")
def gpu_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "k40.json"
    path.write_text(json.dumps(pm.roofline_compute("k40", ("lenet", "cifar10_quick")).to_json()))
    return str(path)


def test_cli_json_has_the_documented_shape(gpu_profile):
    proc = run_model_cli("--compute", gpu_profile, "--profile", "pcie3", "--profile", "nvlink4/ib-hdr",
                         "--np", "1", "2", "4", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"predictions", "validation", "paper"}
    keys = {"model", "mode", "delay", "np", "profile", "topology", "between", "step_ms", "speedup",
            "efficiency", "floor_ms", "residual_ms"}
    assert all(set(r) == keys for r in out["predictions"])
    assert {r["topology"] for r in out["predictions"]} == {"flat"}     # no N spans nodes here
    # 2 models x 2 profiles x (single + 5 modes x 4 N)
    assert len(out["predictions"]) == 2 * 2 * (1 + 5 * 4)
    assert out["validation"] == []
    assert {(r["model"], r["np"], r["reported_speedup"]) for r in out["paper"]} == \
        {("lenet", 4, 3.77), ("cifar10_quick", 4, 3.79)}
    assert all(set(r) == {"model", "np", "predicted_speedup", "reported_speedup"} for r in out["paper"])


def test_cli_plot_writes_a_png(gpu_profile, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "scaling.png"
    proc = run_model_cli("--compute", gpu_profile, "--models", "lenet", "--profile", "pcie3",
                         "--np", "1", "2", "4", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert f"plot written to {png}" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, words", [
    (("--profile", "pcie9"), "unknown profile 'pcie9'"),
    (("--models", "resnet"), "unknown model"),
    (("--compute", "/nonexistent/profile.json"), "cannot read compute profile"),
    (("--np", "0"), "must be >= 1"),
])
def test_cli_bad_input_is_one_line(args, words):
    _one_error_line(run_model_cli(*args), words)


def _one_error_line(proc, words):
    """``proc`` ended with exit 2 and one ``ringnet: error:`` line that says ``words``."""
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("ringnet: error: ") and words in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("option, text, words", [
    ("--calibration", "", "cannot read calibration"),
    ("--calibration", "{}", "is not a calibration of bench model: it lacks by_np"),
    ("--calibration", '{"by_np": [1]}', "it lacks by_np"),
    ("--validation", "{not json", "cannot read validation record"),
    ("--validation", "[]", "it lacks batch_size, steps, rounds"),
    ("--validation", '{"batch_size": 64, "steps": 40, "rounds": [{"compute": {}}]}',
     "rounds lack compute, calibration or measured"),
])
def test_cli_a_bad_record_file_is_one_line_naming_it(tmp_path, option, text, words):
    path = tmp_path / "record.json"
    path.write_text(text)
    profile = ("--profile", "local") if option == "--calibration" else ()
    proc = run_model_cli("--compute", "k40", "--np", "1", "2", *profile, option, str(path))
    _one_error_line(proc, words)
    assert str(path) in proc.stderr


def test_compute_profile_cli_saves_a_training_steps_profile(tmp_path):
    # the command as a user runs it: the profile it saves says how it was measured and has
    # the median step of every batch size it ran (the times themselves are checked against
    # a clock the test controls, below: a second timed run on a shared machine is noise)
    path = tmp_path / "here.json"
    proc = run_model_cli("--compute", "here", "--models", "lenet", "--profile", "pcie3", "--np", "1",
                         "--paper-compute", "k40", "--save-compute", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    compute = pm.load_compute(str(path))
    assert compute.method == pm.TRAINING_STEPS and set(compute.steps_ms["lenet"]) == {16, 32, 64}
    assert all(ms > 0 for ms in compute.steps_ms["lenet"].values())
    assert pm.profile_method({"device": "cpu"}) == pm.ISOLATED_LAYERS


def test_validate_writes_the_record_and_prints_its_readme_table(tmp_path, monkeypatch, capsys):
    # the measuring runs stood in for by a record with the new timings at N = 4 (2 cores):
    # the command writes it to the file given and ends with the table the reprint prints
    rows = [{"model": "lenet", "mode": "ring", "delay": 0, "np": n, "step_ms": 20.0,
             "compute_ms": 15.0, "exposed_ms": 4.0, "update_ms": 1.0, "data_ms": 0.0}
            for n in (1, 4)]
    record = validation_record(rows)
    raw4 = waits_raw(4, 6e-3, 2e-4)
    raw4["models"] = {"lenet": {"batch": 16, "solo_s": 0.004, "together_s": 0.010}}
    record["rounds"][0]["calibration"]["by_np"]["4"] = {"raw": raw4}
    seen = {}

    def fake_validate(models, batch, steps, repeats, mpirun, iters, nps):
        seen.update(models=models, batch=batch, steps=steps, repeats=repeats, nps=nps)
        return record
    monkeypatch.setattr(cli, "validate", fake_validate)
    path = tmp_path / "docs-record.json"
    args = ["--compute", "k40", "--models", "lenet", "--profile", "pcie3", "--np", "1", "4",
            "--validate", "--validate-repeats", "2", "--validate-steps", "20", "--validation", str(path)]
    assert pm.main(args) == 0
    out = capsys.readouterr().out
    assert seen == {"models": ["lenet"], "batch": 64, "steps": 20, "repeats": 2, "nps": (1, 4)}
    assert json.loads(path.read_text()) == record
    assert "N=4: lenet step (batch 16) with all ranks busy 2.50x alone; wait for descheduled " \
           "peers 6.00 ms per step, 200 us per message" in out
    table = out[out.index("# the README's validation table"):].split("\n", 1)[1].strip()
    assert pm.main(["--compute", "k40", "--np", "1", "4", "--models", "lenet", "--profile", "pcie3",
                    "--validation", str(path), "--table", "validation", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == table
    assert table.splitlines()[0] == "| model | mode | N=1 predicted / measured ms | N=4 |"
    assert [line.split(" | ")[:2] for line in table.splitlines()[2:]] == [["| lenet", "ring d0"]]


def test_bench_model_places_its_ranks_with_the_launcher(monkeypatch, tmp_path):
    from types import SimpleNamespace
    from ringnet.perfmodel import calibration, cli
    seen = {}

    def fake_validate(models, batch, steps, repeats, mpirun, iters, nps, **kw):
        seen.update(mpirun=mpirun, **kw)
        raise UsageError("stop here")
    monkeypatch.setattr(cli, "validate", fake_validate)
    with pytest.raises(UsageError, match="stop here"):
        cli.main(["--compute", "k40", "--np", "1", "2", "--profile", "pcie3", "--validate",
                  "--launcher", "srun --mpi=pmi2", "--ranks-per-node", "1"])
    assert seen == {"mpirun": "srun --mpi=pmi2", "per_node": 1}
    commands = []

    def fake_run(cmd, *a, **kw):
        commands.append(cmd)
        raise UsageError("launched")
    monkeypatch.setattr(calibration, "run_json", fake_run)
    monkeypatch.setattr(calibration.shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(UsageError, match="launched"):
        calibration.calibrate((4,), SimpleNamespace(add_s_per_elem=0.0), "srun --mpi=pmi2",
                              per_node=2)
    assert commands[0][:10] == ["srun", "--mpi=pmi2", "--unbuffered", "--output=0", "-N", "2",
                               "-n", "4", "--ntasks-per-node", "2"]
