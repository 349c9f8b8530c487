"""The studies' run loops: every study is one search-then-replicate loop over Jobs.

A Group is what one best trial is chosen from: a compare entry or a reproduction study's cell. Its
trials run on the search seeds (the search), then its best trial runs on the other seeds (the
replications, claimable once the group's search has finished). compare runs its entries one after
another; the study runs point by point (every cell's search at a global batch, then every cell's
replications). The sweep has no replications: every point runs on every seed. Each run is a trial
of the runner's Optuna study (trials.py). Nothing here imports TensorFlow.
"""
import dataclasses
import itertools

from crossbow_tf.compare import trials as trials_lib
from crossbow_tf.compare.plan import describe
from crossbow_tf.compare.runner import Job, run_text
from crossbow_tf.compare.stats import best_trial, seed_statistics


@dataclasses.dataclass
class Group:
    """Runs of one method whose search decides the best trial, replicated on every seed."""
    name: str                  # its runs' folder under runs/ (an entry's name, "<series>/G<g>")
    method: str
    trials: list               # [(label, point, {seed: (experiment, options)})]
    search_seeds: list         # every trial runs on these
    seeds: list                # the best trial runs on these
    rank_by: str = "tta"       # stats.best_trial's ranking
    untuned: bool = False      # one setting, not searched: its best is its only trial
    workers: int = 1

    def job(self, trial, seed, best=False):
        label, point, configs = trial
        experiment, options = configs[seed]
        return Job(self.method, experiment, options, self.name, f"{label}_s{seed}",
                   f"{label} {describe(point)}" + (" (best)" if best else ""), seed, self.workers)

    def search_jobs(self):
        return [self.job(trial, seed) for trial in self.trials for seed in self.search_seeds]

    def replication_seeds(self):
        return [seed for seed in self.seeds if seed not in self.search_seeds]

    def best(self, runner, attrs, target):
        """Its best trial, from the search runs' files and trials."""
        if self.untuned:
            return self.trials[0]
        search = [[load(runner, attrs, self.job(trial, seed), target).summary for seed in self.search_seeds]
                  for trial in self.trials]
        return self.trials[best_trial(search, by=self.rank_by)]

    def outcome(self, runner, attrs, target):
        """{runs: {(label, seed): RunRecord}, best: label, best_point, final: [RunRecord per seed]}."""
        runs = {(job.name[:-len(f"_s{job.seed}")], job.seed): load(runner, attrs, job, target)
                for job in self.search_jobs()}
        best = self.best(runner, attrs, target)
        label, point, _ = best
        for seed in self.seeds:
            if (label, seed) not in runs:
                runs[(label, seed)] = load(runner, attrs, self.job(best, seed, best=True), target)
        return dict(runs=runs, best=label, best_point=point, final=[runs[(label, seed)] for seed in self.seeds])


def _item(job, group):
    """A search run's trials.Item (its config hashed into the plan's fingerprint)."""
    text = run_text(job.experiment, job.options) + (f"\n# workers: {job.workers}\n" if job.workers > 1 else "")
    return trials_lib.Item(job.key, group, job.seed, config_hash=trials_lib.config_hash(text))


_NONE = object()


def _taking_turns(lists):
    """The lists' elements, one from each in turn: [[a1, a2], [b1]] -> [a1, b1, a2]."""
    return [x for row in itertools.zip_longest(*lists, fillvalue=_NONE) for x in row if x is not _NONE]


def plan_items(phases, interleaved=False):
    """(items, {key: Job}) of PHASES (lists of Groups): per phase, every group's search runs, then
    every group's replications (a trials.Item each, in the order one process runs them). INTERLEAVED:
    within a phase the groups take turns, run by run, instead of one group after another."""
    items, jobs = [], {}
    for phase in phases:
        searches = [[(job, group) for job in group.search_jobs()] for group in phase]
        replications = [[trials_lib.Item(f"{group.name}/best_s{seed}", group.name, seed, replicate=True)
                         for seed in group.replication_seeds()] for group in phase]
        if interleaved:
            searches, replications = [_taking_turns(searches)], [_taking_turns(replications)]
        for job, group in itertools.chain.from_iterable(searches):
            jobs[job.key] = job
            items.append(_item(job, group.name))
        items += itertools.chain.from_iterable(replications)
    return items, jobs


def search_then_replicate(phases, runner, target, timeout, interleaved=False, limit_runs=()):
    """Runs PHASES' groups (plan_items' order), then LIMIT_RUNS (limit_plan's), as the runner's
    study; {group name: its outcome}."""
    groups = {group.name: group for phase in phases for group in phase}
    items, jobs = plan_items(phases, interleaved)
    at_limit = {run.item.key: run for run in limit_runs}
    items += [run.item for run in limit_runs]

    def resolve(item):
        if not item.replicate:
            return jobs[item.key]
        group = groups[item.group]
        best = group.best(runner, current_attrs(runner), target)
        job = group.job(best, item.seed, best=True)
        return at_limit[item.key].job(job) if item.key in at_limit else job
    attrs = execute(runner, items, resolve, target, timeout)
    return {name: group.outcome(runner, attrs, target) for name, group in groups.items()}


def execute(runner, items, resolve, target, timeout):
    """Runs ITEMS (trials.Item) as the trials of the runner's study until none is left, in the
    runner's slots; RESOLVE(item) gives the Job of an item's run (for a replication, once its
    group's search has finished). Returns {run key: user attributes of the trial that counts for
    it} ("resolved": a replication's run key)."""
    opts = runner.trials or trials_lib.Options()
    if opts.storage is None and runner.trials is None:
        import optuna
        storage = optuna.storages.InMemoryStorage()   # a library call without a study of its own
    else:
        storage = trials_lib.open_storage(opts.storage or trials_lib.default_storage(runner.out_dir), opts.heartbeat)
    study = trials_lib.Study(storage, opts.name or "crossbow", items, replan=opts.replan, worker=opts.worker,
                             say=runner.say, heartbeat=opts.heartbeat)
    runner.study, runner.offset = study, runner.done

    def run_item(item, slot):
        job = resolve(item)
        record = runner.run_job(job, target, timeout, slot=slot)
        summary = record.summary
        attrs = dict(status="finished" if summary is not None else "failed", resolved=job.key,
                     duration=round(record.duration, 3), error=record.error,
                     load=list(record.load_before) if record.load_before else None,
                     epochs_to_target=summary["epochs_to_target"] if summary else None,
                     tta=summary["tta"] if summary else None)
        best = summary["best_accuracy"] if summary else None
        return (best if isinstance(best, (int, float)) and best == best else 0.0), attrs

    def counted(item, slot):
        value, attrs = run_item(item, slot)
        runner.say(runner.progress_line())
        return value, attrs
    study.work(counted, trials_lib.make_slots(opts.parallel, opts.gpus_per_trial))
    return current_attrs(runner)


def current_attrs(runner):
    """{run key: user attributes of the trial that counts for it}, by plan key and by run key."""
    attrs = {}
    for key, trial in runner.study.current().items():
        attrs[key] = attrs[trial.user_attrs.get("resolved", key)] = dict(trial.user_attrs)
    return attrs


def load(runner, attrs, job, target):
    """The RunRecord of JOB from its results file and its trial's attributes."""
    a = attrs.get(job.key, {})
    load_before = tuple(a["load"]) if a.get("load") else None
    record = runner._record(job.label, job.seed, job.paths(runner.out_dir)["json"], target,
                            a.get("duration") or 0.0, load_before)
    if a.get("status") == "failed" and record.summary is not None:
        record.summary, record.error = None, a.get("error") or "failed"
    elif a.get("status") == "failed":
        record.error = a.get("error") or record.error
    return record


# ---------------------------------------------------------------------------------------------
# The three studies.


def run_compare(spec, plan, runner):
    """Search (every trial on the search seeds), then the best trial on every seed; returns the outcome."""
    groups = [Group(entry.name, entry.method, trials, spec.search_seeds, spec.seeds,
                    workers=entry.workers) for entry, trials in plan]
    outcome = search_then_replicate([[group] for group in groups], runner, spec.target, spec.timeout)
    return {entry.name: dict(entry=entry, trials=trials, **outcome[entry.name]) for entry, trials in plan}


def run_sweep(spec, plan, runner):
    """Runs every sweep point; returns {series: [(global batch, epochs to target or None, best point, records)]}."""
    jobs, items = {}, []
    workers = spec.workers
    for series, g, label, point, configs in plan:
        group = Group(f"sweep_{series}", spec.ssgd_method if series == "ssgd" else "sma", [(label, point, configs)],
                      spec.seeds, spec.seeds, workers=workers.get(series, 1))
        for job in group.search_jobs():
            jobs[job.key] = job
            items.append(_item(job, job.key))
    attrs = execute(runner, items, lambda item: jobs[item.key], spec.target, spec.timeout)
    by = {}
    for series, g, label, point, configs in plan:
        records = [load(runner, attrs, jobs[f"sweep_{series}/{label}_s{seed}"], spec.target) for seed in spec.seeds]
        by.setdefault((series, g), []).append((point, records))
    out = {"ssgd": [], "sma": []}
    for (series, g), trials in by.items():
        best = best_trial([[r.summary for r in records] for _, records in trials], by="epochs")
        point, records = trials[best]
        epochs = seed_statistics([r.summary["epochs_to_target"] for r in records if r.summary is not None])[0]
        out[series].append((g, epochs, point, records))
    return out


def cell_group(spec, cell):
    """The Group of a reproduction study's cell: an untuned series runs its one setting on every seed."""
    seeds = sorted(set(spec.seeds) | set(spec.search_seeds)) if cell.series.untuned else spec.search_seeds
    return Group(f"{cell.series.name}/G{cell.global_batch}", cell.series.method, cell.trials, seeds, spec.seeds,
                 rank_by="epochs", untuned=cell.series.untuned, workers=cell.series.workers)


def study_phases(spec, cells):
    """The study's Groups point by point, in the order of the global batches given."""
    points = list(dict.fromkeys(cell.global_batch for cell in cells))
    return [[cell_group(spec, cell) for cell in cells if cell.global_batch == g] for g in points]


@dataclasses.dataclass(frozen=True)
class LimitRun:
    """A run of the limits phase: its cell's best trial on SEED, each worker behind LIMIT."""
    item: trials_lib.Item      # "<series>/G<g>/net-<limit>/best_s<seed>", claimable once the cell's search is done
    limit: object              # netns.Limit
    cell: object

    @property
    def subdir(self):
        return f"{self.item.group}/net-{self.limit.label()}"

    def job(self, best_job):
        """The cell's best trial's Job (BEST_JOB, on this run's seed) behind the limit, in its folder."""
        return dataclasses.replace(best_job, subdir=self.subdir, network=self.limit,
                                   label=f"{best_job.label} at {self.limit.text()}")


def limit_plan(spec, cells):
    """[LimitRun] of the study's limits phase: at each of spec.network_limits, the best trial of every
    multi-worker cell on every seed (the series taking turns within a seed when the study's order is
    interleaved, else each cell's seeds one after another). One-worker cells have no network: none."""
    runs = []
    for limit in spec.network_limits:
        per_cell = [[LimitRun(trials_lib.Item(f"{cell_group(spec, cell).name}/net-{limit.label()}/best_s{seed}",
                                              cell_group(spec, cell).name, seed, replicate=True), limit, cell)
                     for seed in spec.seeds] for cell in cells if cell.series.workers > 1]
        runs += _taking_turns(per_cell) if spec.order == "interleaved" else itertools.chain.from_iterable(per_cell)
    return runs


def study_items(spec, cells, limits=False):
    """(items, {key: Job} of the search runs, {group: cell}) of the reproduction study, its trials in
    the order one process runs them (point by point: every cell's search, then every cell's
    replications; with LIMITS, then the limits phase's runs, limit_plan)."""
    items, jobs = plan_items(study_phases(spec, cells), spec.order == "interleaved")
    items += [run.item for run in limit_plan(spec, cells)] if limits else []
    return items, jobs, {cell_group(spec, cell).name: cell for cell in cells}


def run_study(spec, cells, runner, limits=False):
    """Point by point, in the order of the global batches given: every cell's search trials at that
    point on the search seeds, then each cell's best trial on every seed (the order of the trials in
    the study; one process runs them in this order, so a study stopped part-way has whole points,
    searched and replicated, before the one it stopped in; side by side, a replication starts once
    its cell's search has finished).

    With LIMITS, then the limits phase (limit_plan): each multi-worker cell's best trial on every seed
    behind each of spec.network_limits, its files under runs/<series>/G<g>/net-<limit>/.

    Returns {(series name, G): outcome dict}. Trials are ranked by fewest median epochs to target,
    then time (best_trial(by="epochs")): the study's question is statistical efficiency.
    """
    outcome = search_then_replicate(study_phases(spec, cells), runner, spec.target, spec.timeout,
                                    spec.order == "interleaved", limit_plan(spec, cells) if limits else ())
    return {(cell.series.name, cell.global_batch): dict(cell=cell, **outcome[cell_group(spec, cell).name])
            for cell in cells}
