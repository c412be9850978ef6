"""Documentation matches the code: every environment variable the code reads is documented."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("ringnet", "hpc", "launch")


def variables_in_code():
    found = set()
    for folder in SOURCES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".py", ".sh", ".sbatch")):
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
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
