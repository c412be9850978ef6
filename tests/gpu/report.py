"""The reports of tests/gpu/run.sh.

``report.py row WORK REPORT_DIR NAME RC SECONDS LIMIT COMMAND``: the row of one finished
stage, from its log ``WORK/NAME.log``, appended to ``WORK/stages.jsonl`` and, at once, to
``REPORT_DIR/report.jsonl``; the stage logs so far go to ``REPORT_DIR/gpu-logs.tar.gz``.
So a run killed at its limit leaves the rows of every stage that finished.

``report.py final WORK REPORT_DIR``: the whole report (every row, the environment, the step
times with their per-layer tables, the CPU stages' numbers) to ``REPORT_DIR/report.json``,
and one JSON line of at most ``LINE_MAX`` characters on stdout (the per-layer tables only
in the file). Exit 0 when every stage passed, else 1.
"""
import json
import os
import re
import sys
import tarfile

LINE_MAX = 8000
ERROR = re.compile(r"^(FAILED|ERROR) |^E  |rank \d+ FAILED|Error\b|error:|Traceback|"
                   r"KeyboardInterrupt|BAD TERMINATION")


def _error_lines(log, rc, limit, aborts=()):
    """The lines of a failed stage's log that say what went wrong (at most 6, 300 chars):
    first the lines of ranks that aborted the job (``aborts``), then the log's last."""
    if rc == 0:
        return None
    first = [line.rstrip()[:300] for line in aborts if line.strip()][:6]
    found = []
    for line in log:
        line = line.rstrip()[:300]
        if ERROR.search(line) and line not in found and not any(line.startswith(a) for a in first):
            found.append(line)
    rest = found or [l[:300] for l in log if l.strip()]
    lines = first + rest[max(len(rest) - (6 - len(first)), 0):]
    if rc in (124, 137):
        lines.insert(0, f"timed out at its limit of {limit} s")
    return lines


def row(work, report_dir, name, rc, seconds, limit, command):
    rc, seconds, limit = int(rc), int(seconds), int(limit)
    path = os.path.join(work, name + ".log")
    log = open(path, errors="replace").read().splitlines() if os.path.exists(path) else []
    path = os.path.join(work, name + ".aborts")
    aborts = open(path, errors="replace").read().splitlines() if os.path.exists(path) else []
    summary = next((l for l in reversed(log) if re.search(r"\d+ (passed|failed|error)", l)), None)
    out = {"stage": name, "passed": rc == 0, "exit": rc, "seconds": seconds,
           "timed_out": rc in (124, 137), "pytest": summary, "command": command}
    if command.startswith("skipped: "):
        out = {"stage": name, "passed": True, "skipped": command[len("skipped: "):]}
    error = _error_lines(log, rc, limit, aborts)
    if error:
        out["error"] = error
    line = json.dumps(out) + "\n"
    targets = [os.path.join(work, "stages.jsonl")]
    if report_dir:
        targets.append(os.path.join(report_dir, "report.jsonl"))
    for target in targets:
        with open(target, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    if report_dir:
        tmp = os.path.join(report_dir, ".gpu-logs.tar.gz")
        with tarfile.open(tmp, "w:gz") as tar:
            for entry in sorted(os.listdir(work)):
                if entry.endswith((".log", ".json", ".jsonl")):
                    tar.add(os.path.join(work, entry), arcname=entry)
        os.replace(tmp, os.path.join(report_dir, "gpu-logs.tar.gz"))
    print(f"== {name}: " + ("skipped" if "skipped" in out else
                            f"{'passed' if rc == 0 else 'FAILED'} (exit {rc}, {seconds} s)"))


def _environment():
    try:
        import cupy
        from ringnet.comm.nccl_transport import nccl_module
        from ringnet.comm.mpi_transport import mpi_cuda_aware
        nccl = nccl_module("cupy")
        return {"cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
                "gpus": [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode()
                         for i in range(cupy.cuda.runtime.getDeviceCount())],
                "nccl": nccl.get_version() if nccl is not None else None,
                "cuda_aware_mpi": list(mpi_cuda_aware())}
    except Exception as exc:  # noqa: BLE001 - the report still comes out
        return {"error": str(exc)[:300]}


def _short_steps(steps):
    keep = ("model", "step_ms", "graph_step_ms", "torch_step_ms", "ratio_vs_torch",
            "graph_ratio_vs_torch", "torch_tf32", "torch", "loss", "torch_loss")
    return [{k: r[k] for k in keep if k in r} for r in steps]


def line_of(report):
    """The report as one JSON line under LINE_MAX: long parts shortened, then dropped (they
    are in report.json)."""
    short = dict(report)
    if "step_times" in short:
        short["step_times"] = _short_steps(short["step_times"])
    text = json.dumps(short)
    for key in ("model_validation", "cpu_cores", "ddp_gpu", "step_times"):
        if len(text) < LINE_MAX:
            break
        if key in short:
            short[key] = "in report.json"
            text = json.dumps(short)
    if len(text) >= LINE_MAX:
        for stage in short["stages"]:
            stage.pop("command", None)
            if "error" in stage:
                stage["error"] = [e[:120] for e in stage["error"][-2:]]
        text = json.dumps(short)
    if len(text) >= LINE_MAX:
        short["stages"] = [{k: s.get(k) for k in ("stage", "passed", "exit", "seconds")}
                           for s in short["stages"]]
        text = json.dumps(short)
    return text


def final(work, report_dir):
    path = os.path.join(work, "stages.jsonl")
    stages = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    report = {"passed": bool(stages) and all(s["passed"] for s in stages), "stages": stages,
              "environment": _environment()}
    steps = os.path.join(work, "steps.json")
    if os.path.exists(steps):
        report["step_times"] = json.load(open(steps))
    for key in ("cpu-cores", "model-validation", "ddp-gpu"):
        part = os.path.join(work, key + ".json")
        if os.path.exists(part):
            report[key.replace("-", "_")] = json.load(open(part))
    if report_dir:
        with open(os.path.join(report_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=1)
    print(line_of(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "row":
        row(*args)
    else:
        sys.exit(final(*args))
