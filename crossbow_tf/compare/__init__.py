"""The head-to-head harness: SMA against stock-TensorFlow baselines on time to accuracy.

    crossbow-compare --config C --out DIR        (python -m crossbow_tf.compare)
    crossbow-sweep --config C --out DIR          (python -m crossbow_tf.compare.sweep)
    crossbow-reproduce --config C --out DIR      (python -m crossbow_tf.reproduce)

Its parts, each a module: ``spec`` reads and validates the YAML's compare: and sweep: sections and
each run's config; ``plan`` turns grids and budgets into trials; ``runner`` runs one process per
run (progress, ETA, resume); ``stats`` summarises runs and seeds; ``plots`` draws the figures;
``report`` and ``study_report`` write the reports. The commands are ``cli`` (compare), ``sweep``
and ``reproduce``. Nothing here imports TensorFlow: every run is its own process (docs/harness.md).
"""
from crossbow_tf.compare.plan import (choose_trials, count_compare_runs, count_runs, describe, expand_grid,
                                      plan_compare, plan_study, plan_sweep, searched_budgets)
from crossbow_tf.compare.runner import (RunRecord, Runner, prepare_out_dir, run_compare, run_study, run_sweep,
                                        same_run, trial_hparams)
from crossbow_tf.compare.spec import (is_study, load_harness_config, parse_compare, parse_study, parse_sweep,
                                      run_config)
from crossbow_tf.compare.stats import best_trial, compare_rows, run_summary, seed_statistics, time_to_target, tta_ratio

__all__ = ["best_trial", "choose_trials", "compare_rows", "count_compare_runs", "count_runs", "describe",
           "expand_grid", "is_study", "load_harness_config", "parse_compare", "parse_study", "parse_sweep",
           "plan_compare", "plan_study", "plan_sweep", "prepare_out_dir", "run_compare", "run_config", "run_study",
           "run_summary", "run_sweep", "RunRecord", "Runner", "same_run", "searched_budgets", "seed_statistics",
           "time_to_target", "trial_hparams", "tta_ratio"]
