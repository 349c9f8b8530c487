"""The command of an engine method other than crossbow_tf.run's own: the experiment's config with
algorithm.name set to the method's rule, trained through crossbow_tf.experiment, its results filed
under the method's name (baselines/crossbow_ssgd.py, baselines/easgd.py).

Not imported by the stock baseline, whose command line must load none of the engine.
"""
from baselines import _cli


def command(method, algorithm, doc):
    """(run, main) of METHOD's command: ALGORITHM is the rule's registry name, DOC the module's
    docstring, whose first line is the command's description."""
    prog = f"python -m baselines.{method}"

    def run(args, log=print):
        cfg, _ = _cli.build(args, algorithm=algorithm)
        from crossbow_tf.errors import TrainingDiverged
        from crossbow_tf.experiment import run_experiment
        try:
            results = run_experiment(cfg, log=log)
        except TrainingDiverged as e:   # its results are written too: under this method's name
            e.results.method = method
            raise
        results.method = method
        return results

    def main(argv=None):
        return _cli.main(prog, doc.splitlines()[0], run, argv)

    return run, main
