"""A run and its checkpoint: what ``--resume`` takes from it, what ``--resume auto`` and
``--save`` decide, how the state is put back, and the saver that writes it.

Hyperparameters not given explicitly continue with the checkpoint's values; a flag that
is given overrides it, and the first log line and the ``--json`` record say which. The
settings of a mode follow the mode resumed into (the look-ahead's warm-up).
"""
import dataclasses
import os

from ringnet.autosave import PeriodicSaver
from ringnet import checkpoint as checkpoints
from ringnet.checkpoint import HYPERPARAMETERS, resume_settings
from ringnet.control import agree, collective, differences
from ringnet.errors import UsageError
from ringnet.parallel import MODES

__all__ = ["check_same_start", "auto", "settings", "check_not_behind", "restore", "saver"]


def _compensation_after(cfg, size):
    """The delay compensation ``cfg`` resolves to at ``size`` ranks, or None where its settings
    are refused (:meth:`TrainConfig.resolved` says why, later)."""
    try:
        return dataclasses.replace(cfg, warmup_steps=None).resolved(size).delay_compensation
    except UsageError:
        return None


def _mode_text(mode, delay, compensation):
    alone = mode is None or (mode in MODES and not MODES[mode].distributed)
    text = f"{mode}" if alone else f"{mode} delay {delay}"
    return text + (f" {compensation}" if delay and compensation not in (None, "none") else "")


def _setting_text(name, value, bare=False):
    """A resumed setting as the flag that asks for it: --lr 0.01, --no-shuffle, --augment."""
    if name in ("shuffle", "augment"):
        on = bool(value)
        if bare:
            return "on" if on else "off"
        if name == "shuffle":
            return "shuffle on" if on else "--no-shuffle"
        return "--augment" if on else "augment off"
    return str(value) if bare else f"--{name.replace('_', '-')} {value}"


_SAME = ("every rank must resume the same checkpoint; copies of one may sit at different "
         "paths, as on node-local disks")


def _ranks(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _resumed_text(every):
    """'rank 0 resumed a.h5 (step 20), rank 1 b.h5 (step 25)': what each rank resumed, ranks
    that resumed the same grouped. ``every``: by rank, (text of what it resumed, key)."""
    groups = {}
    for rank, (text, key) in enumerate(every):
        groups.setdefault((key, text), []).append(rank)
    parts = [f"{_ranks(ranks)} {text}" for (_, text), ranks in groups.items()]
    return "ranks resumed different checkpoints: " + "; ".join(parts) + f" ({_SAME})"


def check_same_start(cfg, world):
    """Refuse, on every rank and before any rank acts on it, ranks that were asked to start
    differently: ``--resume`` on some ranks only (or ``auto`` on some, a path on others), or
    ``--save`` on some only. The error names the ranks and what each resumes (its path and
    the step its checkpoint holds). Collective."""
    asked = cfg.resume
    step = None
    if asked not in (None, "auto"):
        step = checkpoints.stored_step(asked)
    mine = ("none" if asked is None else "auto" if asked == "auto" else "path",
            None if asked in (None, "auto") else str(asked), step, cfg.save is not None)
    every = agree(world, mine, phase="setup")
    if len({kind for kind, *_ in every}) > 1:
        def text(kind, path, step):
            if kind == "none":
                return "nothing (no --resume: it starts at step 0)"
            if kind == "auto":
                return "--resume auto"
            return f"{path} ({'step ' + str(step) if step is not None else 'not a readable checkpoint'})"
        raise UsageError(_resumed_text([(text(k, p, s), (k, p, s)) for k, p, s, _ in every]))
    problems = differences([{"--save": "given" if saved else "not given"}
                            for *_, saved in every])
    if problems:
        raise UsageError("ranks were started with different settings or data: "
                         + "; ".join(problems) + " (every rank must run the same command)")


def _check_same_checkpoint(cfg, world, checkpoint):
    """Refuse checkpoints that differ between the ranks: their steps or their content (a
    fingerprint of the loaded arrays), naming each rank's path and step. Collective."""
    params, momentum, prev, attrs = checkpoint
    mine = (str(cfg.resume), int(attrs.get("step", 0)),
            checkpoints.content_fingerprint(params, momentum, prev))
    every = agree(world, mine, phase="setup")
    if len({(step, content) for _, step, content in every}) > 1:
        contents = len({content for *_, content in every}) > 1
        raise UsageError(_resumed_text([
            (f"{path} (step {step}" + (f", content {content}" if contents else "") + ")",
             (step, content)) for path, step, content in every]))


def auto(cfg, world):
    """``--resume auto``: resume from ``--save`` when it exists (rank 0 looks), else start
    fresh. Return (cfg, the line that says which)."""
    exists = agree(world, os.path.exists(cfg.save) if world.Get_rank() == 0 else None,
                   phase="setup")[0]
    if exists:
        return dataclasses.replace(cfg, resume=cfg.save), None
    return (dataclasses.replace(cfg, resume=None),
            f"--resume auto: no checkpoint at {cfg.save} yet, starting at step 0")


def check_not_behind(cfg, saved, step, total_steps):
    """Refuse a run whose first save would overwrite a ``--save`` checkpoint (at step
    ``saved``, None: no checkpoint there) with one that is not as far along: what a requeued
    job started without --resume would do to its own newer checkpoint."""
    first = total_steps if not cfg.save_every else min(total_steps,
                                                       (step // cfg.save_every + 1) * cfg.save_every)
    if saved is not None and saved > first:
        raise UsageError(f"--save {cfg.save} holds a checkpoint at step {saved}, further along "
                         f"than this run's first save (step {first}), and would be overwritten; "
                         f"continue it with --resume auto (or --resume {cfg.save}), or start over "
                         f"with another --save path or after removing it")


def settings(cfg, world):
    """Load the checkpoint of ``cfg.resume``; return (cfg with its settings, checkpoint,
    (note, record)).

    Hyperparameters not given explicitly continue with the checkpoint's values; a flag that
    is given overrides (giving it is the explicit request to leave the trajectory). Without
    ``--model`` the run takes the checkpoint's model. Settings that belong to a mode follow
    the mode resumed into: ``--warmup-steps`` continues from the checkpoint only where both
    runs use the look-ahead compensation; into a look-ahead run from one without it the
    default warm-up applies (its synchronous steps are the synchronous run's, counted from
    step 0), and into a run without it the warm-up is dropped. The log note and the --json
    record say which were taken, which a flag overrode, and what followed the mode.
    """
    checkpoint = collective(world, checkpoints.load_checkpoint, cfg.resume)
    _check_same_checkpoint(cfg, world, checkpoint)     # before any rank acts on what it read
    attrs = checkpoint[3]
    size = world.Get_size()
    done = int(attrs.get("step", 0))
    model_note = None
    if cfg.model is None and attrs.get("model"):
        cfg = dataclasses.replace(cfg, model=attrs["model"])
        model_note = f"--model {cfg.model}"
    given = {n: getattr(cfg, n) for n in HYPERPARAMETERS}
    was = _mode_text(attrs.get("mode"), attrs.get("delay"),
                     attrs.get("delay_compensation"))
    stored_lookahead = attrs.get("delay_compensation") == "lookahead"
    target_lookahead = _compensation_after(cfg, size) == "lookahead"
    followed = None     # (what the warm-up became, why), for the note
    own_default = False     # the warm-up is the mode resumed into's own default
    if given["warmup_steps"] is None:
        if stored_lookahead and target_lookahead and "warmup_steps" not in attrs:
            given["warmup_steps"] = 0       # written before the warm-up existed: none was run
        elif stored_lookahead and not target_lookahead:
            stored = int(attrs.get("warmup_steps", 0) or 0)
            attrs = {k: v for k, v in attrs.items() if k != "warmup_steps"}
            if stored:
                followed = (0, f"dropped the checkpoint's --warmup-steps {stored} of {was}: "
                               f"the warm-up belongs to the look-ahead compensation of delay 1")
        elif not stored_lookahead:
            # The checkpoint's warm-up (0 or absent) belonged to a run without the look-ahead:
            # this run's own default follows its mode (resolved below).
            attrs = {k: v for k, v in attrs.items() if k != "warmup_steps"}
            own_default = True
    settings, overridden = resume_settings(attrs, given)
    if given["warmup_steps"] is not None:
        cfg = dataclasses.replace(cfg, warmup_steps=given["warmup_steps"])
    cfg = dataclasses.replace(cfg, **settings)
    if "batch_size" in settings and cfg.batch_size % size:
        raise UsageError(f"checkpoint {cfg.resume} was trained with global batch {cfg.batch_size}, "
                         f"which {size} ranks cannot split; pass --batch-size with a multiple "
                         f"of {size} to change it")
    if own_default and target_lookahead:        # else no warm-up before and none now
        resolved = cfg.resolved(size)
        warmup = resolved.warmup_steps
        if warmup:
            cfg = dataclasses.replace(cfg, warmup_steps=warmup)
            after = (f"steps {done} to {warmup} synchronous, then delayed" if warmup > done
                     else f"already past at step {done}: delayed from the start")
            followed = (warmup, f"--warmup-steps {warmup}, the default of "
                                f"{_mode_text(resolved.mode, resolved.delay, 'lookahead')}, "
                                f"as the checkpoint's {was} had none ({after})")
    note = f"resuming from {cfg.resume} at step {done}"
    taken = ([model_note] if model_note else []) + [_setting_text(n, v) for n, v in settings.items()]
    if taken:
        note += "; from the checkpoint: " + ", ".join(taken)
    if overridden:
        note += "; overridden: " + ", ".join(
            f"{_setting_text(n, asked)} (checkpoint: {_setting_text(n, stored, bare=True)})"
            for n, stored, asked in overridden)
    if followed is not None:
        note += "; " + followed[1]
    # The same for --json: a changed trajectory is on record even under --quiet.
    record = {"checkpoint": str(cfg.resume), "step": done,
              "from_checkpoint": dict(settings, **({"model": cfg.model} if model_note else {})),
              "overridden": {n: {"checkpoint": stored, "given": asked}
                             for n, stored, asked in overridden}}
    if followed is not None:
        record["followed_mode"] = {"warmup_steps": followed[0], "why": followed[1]}
    return cfg, checkpoint, (note, record)


def saver(cfg, world, strategy, spe, dataset):
    """Return the PeriodicSaver that writes cfg.save (every --save-every K steps and at the end)."""
    size = world.Get_size()

    def collect():              # every rank
        return strategy.full_state(), strategy.lookahead_state()

    def write(state, step):     # rank 0 only
        (params, momentum, prev), base = state
        checkpoints.save_checkpoint(cfg.save, params, momentum, prev if cfg.delay else None,
                        lookahead_base=base, model=cfg.model, mode=cfg.mode,
                        delay=cfg.delay, delay_compensation=cfg.delay_compensation,
                        ranks=size, step=step, epoch=step // spe, data_content=dataset.content,
                        **{n: getattr(cfg, n) for n in HYPERPARAMETERS})
    return PeriodicSaver(world, cfg.save_every, collect, write)


def restore(cfg, world, strategy, checkpoint, total_steps, dataset, resumed):
    """Load ``checkpoint`` into ``strategy`` on every rank; return the checkpoint's step.

    A data set whose content differs from the checkpoint's is refused unless ``--dataset``
    was given (then it is listed as overridden in ``resumed``, the --json record)."""
    params, momentum, prev, attrs = checkpoint
    base = collective(world, checkpoints.load_lookahead_base, cfg.resume)

    def restore():
        if attrs.get("model") != cfg.model:
            raise UsageError(f"checkpoint {cfg.resume} holds model {attrs.get('model')!r}, "
                             f"not {cfg.model!r}")
        done = int(attrs.get("step", 0))
        stored = attrs.get("data_content") or None
        if stored and stored != dataset.content:
            if "dataset" in resumed["from_checkpoint"]:
                raise UsageError(f"checkpoint {cfg.resume} was trained on data set {cfg.dataset} "
                                 f"with content {stored}, which now reads {dataset.content}: "
                                 f"the data changed; pass --dataset {cfg.dataset} to continue "
                                 f"on it anyway")
            resumed["overridden"]["data_content"] = {"checkpoint": stored,
                                                     "given": dataset.content}
        if done >= total_steps:
            asked = (f"--steps {cfg.steps}" if cfg.steps is not None else
                     f"--epochs {cfg.epochs} ({total_steps} steps)")
            raise UsageError(f"checkpoint {cfg.resume} is already at step {done}; {asked} "
                             f"leaves nothing to run (steps count from step 0: ask for more "
                             f"than {done})")
        try:
            strategy.load_full_state(params, momentum, prev if cfg.delay else None,
                                     base if cfg.delay else None)
        except ValueError as exc:
            raise UsageError(f"checkpoint {cfg.resume}: {exc}") from None
    collective(world, restore)
    return int(attrs.get("step", 0))
