"""Documentation matches the code: every environment variable the code reads is documented."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("ringnet", "hpc", "launch")


def variables_in_code():
    paths = [os.path.join(ROOT, "tests", "run.sh")]      # the suite's, beside the project's
    for folder in SOURCES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.join(dirpath, name) for name in files
                      if name.endswith((".py", ".sh", ".sbatch"))]
    found = set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            found |= set(re.findall(r"\bRINGNET_[A-Z][A-Z0-9_]*[A-Z0-9]", f.read()))
    return found


def documented():
    with open(os.path.join(ROOT, "docs", "environment.md"), encoding="utf-8") as f:
        return set(re.findall(r"^\| `(RINGNET_[A-Z0-9_]+)` \|", f.read(), re.M))


def test_every_environment_variable_is_in_the_table():
    code, docs = variables_in_code(), documented()
    assert len(code) >= 6
    assert not code - docs, f"read by the code but not in docs/environment.md: {sorted(code - docs)}"
    assert not docs - code, f"in docs/environment.md but read nowhere: {sorted(docs - code)}"


def code_blocks(doc):
    """Return [(language, code)] of the fenced blocks of ``docs/<doc>``, in order."""
    with open(os.path.join(ROOT, "docs", doc), encoding="utf-8") as f:
        return re.findall(r"^```(\w+)\n(.*?)^```", f.read(), re.M | re.S)


def run_doc(doc, tmp_path, monkeypatch):
    """Run every block of a page in order: shell blocks in ``tmp_path``, Python in one namespace."""
    import subprocess
    import sys
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    namespace = {"__name__": "__doc__"}
    blocks = code_blocks(doc)
    assert blocks
    for language, code in blocks:
        if language == "bash":
            proc = subprocess.run(code, shell=True, capture_output=True, text=True, env=env,
                                  timeout=600)
            assert proc.returncode == 0, f"{code}\n{proc.stderr[-3000:]}"
        elif language == "python":
            exec(compile(code, f"docs/{doc}", "exec"), namespace)  # noqa: S102
    return namespace


def test_pytorch_page_runs(tmp_path, monkeypatch):
    import pytest
    pytest.importorskip("torch")
    ns = run_doc("pytorch.md", tmp_path, monkeypatch)
    assert ns["torch_accuracy"] >= 0.9             # five epochs of digits
    assert (tmp_path / "from-torch.h5").exists()


def test_comm_page_example_runs_under_mpirun(tmp_path):
    import subprocess
    import sys
    [(language, code)] = [b for b in code_blocks("comm.md") if "ring.allreduce(buf)" in b[1]]
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    for n in (1, 4):                               # at 4 the tree has an inner node
        proc = subprocess.run(["mpirun", "-np", str(n), sys.executable, str(script)],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # mpirun forwards each rank's output; lines of different ranks may interleave
        assert sorted(map(int, re.findall(r"rank (\d+): ok", proc.stdout))) == list(range(n))


def test_the_exit_codes_table_and_help_are_the_codes_of_ringnet_errors():
    from ringnet import errors
    from ringnet.config import build_parser
    with open(os.path.join(ROOT, "docs", "reliability.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("| exit code | meaning |"):]
    section = section[:section.index("\n\n")]
    table = re.findall(r"^\| (\d+) \| (.+) \|$", section, re.M)
    codes = {0, errors.EXIT_FAILURE, errors.EXIT_USAGE, errors.EXIT_DIVERGED, errors.EXIT_STOPPED,
             errors.EXIT_INTERRUPTED}
    assert sorted(int(c) for c, _ in table) == sorted(codes)
    epilog = build_parser().epilog
    listed = re.search(r"Exit codes: (.*?)\.", epilog.replace("\n", " ")).group(1)
    assert sorted(int(c) for c in re.findall(r"(\d+) \w", listed)) == sorted(codes)
