"""Runs one experiment configuration end to end: data, model, strategy, engine, training."""
import dataclasses
import os
import time

from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.distribute.devices import split_cpu, start_cluster
from crossbow_tf.errors import ConfigError


def make_algorithm(cfg):
    """CFG's update rule; its keys left null take the rule's defaults (config.py refuses keys set
    for a rule that does not take them)."""
    from crossbow_tf.config import make_rule
    overrides = _rule_momentum_and_decay(cfg, _keras_optimizer(cfg)) if cfg.optimizer is not None else {}
    return make_rule(cfg.algorithm, **overrides)


def _keras_optimizer(cfg):
    from crossbow_tf.config import build_keras_optimizer
    return build_keras_optimizer(cfg.optimizer, cfg.learning_rate.base)


def _rule_momentum_and_decay(cfg, optimizer):
    """The rule's learner momentum and weight decay under CFG's ``optimizer:``: a plain momentum SGD's
    own (its weight decay as the rule's L2 term, Crossbow's form); none for any other optimizer,
    whose own step the learners take."""
    from crossbow_tf.engine.optimizers import is_momentum_sgd
    if not is_momentum_sgd(optimizer):
        return dict(momentum=0.0, weight_decay=0.0)
    own, rule = float(optimizer.weight_decay or 0.0), cfg.algorithm.weight_decay
    if own and rule and own != rule:
        raise ConfigError(f"optimizer.weight_decay: {own} conflicts with algorithm.weight_decay {rule}; "
                          "set it in one place")
    return dict(momentum=float(optimizer.momentum), weight_decay=own or rule)


def make_optimizer(cfg):
    """The engine's ``optimizer=`` for CFG: None for the default and for a plain momentum SGD (the
    rule's fused update runs them, see make_algorithm), else the Keras optimizer whose own step the
    learners take (its rate is replaced every iteration by the learning-rate schedule's)."""
    if cfg.optimizer is None:
        return None
    from crossbow_tf.engine.optimizers import learner_optimizer
    try:
        return learner_optimizer(_keras_optimizer(cfg))
    except ValueError as e:
        raise ConfigError(f"optimizer: {e}") from None


def make_devices(cfg, cluster=None, log=print):
    """CFG's device names (splitting the CPU first when asked); call before TensorFlow runs anything.

    Every visible GPU when there is one, else devices.logical_cpu logical CPU devices
    (crossbow_tf.device_choice, as the baselines and the harness's plans count them); LOG gets one
    line when logical_cpu is given on a GPU machine. With a multi-worker CLUSTER this starts the
    worker's server and waits for the other workers."""
    from crossbow_tf.device_choice import apply_choice, choose_devices, physical_gpus
    choice = choose_devices(physical_gpus(), cfg.devices.logical_cpu)
    if choice.note:
        log(choice.note)
    if not choice.logical_cpu:
        start_cluster(cluster)
    return apply_choice(choice, lambda n: split_cpu(n, cluster))


def make_strategy(cfg, devices=None, learners_per_device=None, cluster=None):
    """CFG's strategy; LEARNERS_PER_DEVICE replaces cfg's (needed when cfg says "auto")."""
    return CrossbowStrategy(learners_per_device=learners_per_device or cfg.learners_per_device,
                            cross_device_reduction=cfg.devices.cross_device_reduction,
                            devices=devices if devices is not None else make_devices(cfg, cluster),
                            cluster=cluster)


def tune_learners(cfg, devices, data, loss, algorithm, log=print, **engine_kwargs):
    """Crossbow's auto-tuning of learners per device for CFG on DEVICES; returns a TuningResult."""
    import keras

    from crossbow_tf.engine.autotune import autotune_learners
    from crossbow_tf.models import build_model

    def fresh_model():
        keras.utils.set_random_seed(cfg.seed)
        return build_model(cfg.model, data.input_shape, data.num_classes)

    if algorithm.has_central_loop:
        # The tuner measures images/s only: every m is measured, and the stability guard applies
        # to the m it chooses, before training.
        algorithm = dataclasses.replace(algorithm, allow_unstable=True)
    t = cfg.autotune
    # The tuner never tries more learners than one iteration's examples the training set holds.
    max_learners = max(1, min(t.max_learners_per_device, data.train.size // (len(devices) * cfg.batch_size)))
    log(f"auto-tuning learners per device on {len(devices)} device(s): adding one while images/s "
        f"gain more than {t.threshold:.0%} (at most {max_learners})")
    tuning = autotune_learners(fresh_model, loss, algorithm, devices, data.train, cfg.batch_size,
                               threshold=t.threshold, max_learners=max_learners,
                               warmup_iterations=t.warmup_iterations, measure_iterations=t.measure_iterations,
                               learning_rate=cfg.learning_rate.base,
                               cross_device_reduction=cfg.devices.cross_device_reduction,
                               map_fn=data.train_map, seed=cfg.seed, engine_factory=build_engine, **engine_kwargs)
    log(tuning.summary())
    return tuning


def find_resume_point(cfg, resume, log=print, workers=1):
    """(path, record) of the checkpoint CFG's run continues from, or None to start afresh.

    Refuses (CheckpointError, one line) a directory holding another run's checkpoints without
    RESUME, and a checkpoint whose configuration differs in anything that changes the trajectory.
    """
    from crossbow_tf.config import to_dict
    from crossbow_tf.engine.checkpoint import newest_record, trajectory_differences
    from crossbow_tf.errors import CheckpointError

    directory = cfg.checkpoint.dir
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: checkpoint directory is a file")
    newest = newest_record(directory, log=log) if os.path.isdir(directory) else None
    if newest is None:
        if resume:
            log(f"no checkpoint in {directory} yet: starting from the beginning")
        return None
    path, record = newest
    if not resume:
        raise CheckpointError(f"{directory}: holds checkpoints of a run ({path}); pass --resume to continue it, "
                              "or choose another checkpoint directory")
    saved_workers = record.get("workers", 1)
    if saved_workers != workers:
        raise CheckpointError(f"{path}: written by a run on {saved_workers} worker(s), this one has {workers}: "
                              "resume on the cluster that wrote it")
    differences = trajectory_differences(record.get("config", {}), to_dict(cfg))
    if differences:
        raise CheckpointError(f"{path}: written with a different configuration: {'; '.join(differences)}")
    return newest


def chief_resume_point(cfg, resume, log, cluster):
    """``find_resume_point`` on several workers: the chief looks at its checkpoint directory and
    every worker follows its decision (or stops with its error)."""
    from crossbow_tf.errors import CheckpointError
    found = cluster.decided_by_chief(lambda: find_resume_point(cfg, resume, log, workers=cluster.num_workers),
                                     CheckpointError)
    return tuple(found) if found else None


def run_experiment(cfg, log=print, resume=False, stop_signals=None, cluster=None):
    """Trains CFG's model with its algorithm; returns RunResults.

    With cfg.checkpoint.dir the run is checkpointed there; RESUME continues it from the newest
    checkpoint. STOP_SIGNALS (crossbow_tf.engine.signals.StopSignals) stops it cleanly.
    CLUSTER (crossbow_tf.distribute.cluster.Cluster) trains on several workers, each running this
    same call: only the chief logs to LOG, the others log to stderr with a worker prefix.
    """
    from crossbow_tf.config import check_engine_precision
    from crossbow_tf.policy import divergence_refused
    check_engine_precision(cfg)
    refused = divergence_refused(cfg.on_divergence, cfg.checkpoint.dir)
    if refused:
        raise ConfigError(f"on_divergence: {refused}: give checkpoint.dir (--checkpoint-dir)")
    # Before the devices: a checkpoint that cannot be resumed is refused before TensorFlow starts work.
    # (On several workers only the chief has the checkpoints: it decides once the workers are up.)
    resume_point = find_resume_point(cfg, resume, log) if cfg.checkpoint.dir and cluster is None else None
    devices = make_devices(cfg, cluster, log)   # first to touch the devices: it fixes TensorFlow's device list
    if cluster is not None:
        log = cluster.log_function(log)
        with cluster.guard():
            if cfg.checkpoint.dir:
                resume_point = chief_resume_point(cfg, resume, log, cluster)
            return _run(cfg, devices, log, resume_point, stop_signals, cluster)
    return _run(cfg, devices, log, resume_point, stop_signals, None)


def _run(cfg, devices, log, resume_point, stop_signals, cluster):
    from crossbow_tf.config import check_fits_data
    from crossbow_tf.data import load_dataset
    from crossbow_tf.engine.trainer import train

    data = load_dataset(cfg.data.name, cfg.data.data_dir, path=cfg.data.path)
    check_fits_data(cfg, learners=True, train_size=data.train.size, devices=len(devices))
    engine, strategy, tuning = _build_engine(cfg, devices, data, log, resume_point, cluster)
    schedule, per_epoch = _schedule(cfg, data, strategy)
    log(_start_line(cfg, data, engine, strategy, per_epoch))
    results = _results(cfg, engine, strategy, cluster, tuning)
    checkpoints = _checkpoints(cfg, engine, strategy)
    progress = None
    if resume_point is not None:
        path, progress = checkpoints.restore_newest(results, log=log)
        results.extra.setdefault("resumed_at_iterations", []).append(progress.iteration)
        tuned = " (auto-tuned m kept)" if cfg.learners_per_device == "auto" else ""
        log(f"resuming from {path}: iteration {progress.iteration}, {progress.epoch} epoch(s) done{tuned}")
    tensorboard = None
    if cfg.tensorboard and (cluster is None or cluster.is_chief):   # only the chief writes files
        from crossbow_tf.tensorboard import EvaluationWriter
        tensorboard = EvaluationWriter(cfg.tensorboard)
    start = time.perf_counter()
    train(engine, data, cfg.batch_size, cfg.epochs, schedule, results,
          _train_options(cfg, log, checkpoints, progress, stop_signals, tensorboard))
    results.extra["total_time"] = time.perf_counter() - start
    if cluster is not None:   # per iteration: compute, waits in the all-reduce, bytes sent per worker
        results.extra["cross_worker"] = cross_worker_figures(results, progress)
    if cfg.target_accuracy is not None:
        log(results.target_summary(cfg.target_accuracy))
    return results


def _build_engine(cfg, devices, data, log, resume_point, cluster):
    """(Engine, strategy, TuningResult or None) of CFG on DEVICES: learners per device from the
    checkpoint resumed, the tuner or the config; the central loop checked with the k chosen."""
    import keras

    from crossbow_tf.config import check_central_loop, noise_matching_on
    from crossbow_tf.models import build_model

    # As a Keras user sets it, before any model is built (the tuner's included): the layers compute
    # in the policy's dtype, and their variables, the learners' stacks and z stay float32.
    keras.mixed_precision.set_global_policy(cfg.precision)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    algorithm = make_algorithm(cfg)
    engine_kwargs = dict(jit_compile=cfg.jit_compile, jit_update=cfg.jit_update, learners=cfg.learners,
                         optimizer=make_optimizer(cfg),   # the tuner measures the Engine that will train
                         loss_scale=cfg.precision == "mixed_float16",   # as Keras's LossScaleOptimizer
                         noise_matching=noise_matching_on(cfg))
    tuning, learners_per_device = None, None
    if resume_point is not None:
        learners_per_device = resume_point[1]["learners_per_device"]   # the tuner's choice is kept
    elif cfg.learners_per_device == "auto":
        tuning = tune_learners(cfg, devices, data, loss, algorithm, log=log, **engine_kwargs)
        if cluster is not None:
            # Measured on each worker; every worker must build the same step: the smallest m.
            own, tuning.chosen = tuning.chosen, cluster.agree_min(tuning.chosen)
            log(f"learners per device agreed by the {cluster.num_workers} workers: m={tuning.chosen} "
                f"(the smallest of their choices; this worker chose {own})")
        learners_per_device = tuning.chosen
    strategy = make_strategy(cfg, devices, learners_per_device, cluster)
    check_central_loop(cfg, strategy.num_learners)   # with this machine's k, before any training
    # Seeded after tuning, which draws random numbers: the run is the one a fixed m would give.
    keras.utils.set_random_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    return build_engine(model, loss, algorithm, strategy, **engine_kwargs), strategy, tuning


def build_engine(model, loss, algorithm, strategy, **engine_kwargs):
    """The Engine training MODEL on the objective its author wrote (crossbow_tf/training_hooks.py): LOSS;
    a compute_loss of the model's own, per learner as use_sma runs it; or the model's own train_step, run
    per learner as use_sma runs it. The model is compiled as tf_ssgd compiles it for Keras's fit (LOSS, an
    accuracy metric), so that the override's super() calls and metrics mean what they mean there."""
    import keras

    from crossbow_tf import training_hooks
    from crossbow_tf.engine.core import Engine
    own_step = training_hooks.overrides(type(model), "train_step")
    own_loss = training_hooks.overrides(type(model), "compute_loss")
    if not (own_step or own_loss):
        return Engine(model, loss, algorithm, strategy, **engine_kwargs)
    from crossbow_tf.engine.replicated import per_example_loss_fn
    from crossbow_tf.keras.structure import CompiledLoss, OverriddenLoss
    from crossbow_tf.keras.user_step import UserTrainStep
    check_own_step(model, loss_scale=engine_kwargs.get("loss_scale", False))
    # The step's optimizer is asked for each learner's gradient step, never applied: the engine steps.
    model.compile(optimizer=keras.optimizers.SGD(), loss=loss,
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    if not own_step:
        return Engine(model, OverriddenLoss(model), algorithm, strategy, **engine_kwargs)
    engine = Engine(model, loss, algorithm, strategy, **dict(engine_kwargs, learners="replicated"))
    engine.run_learners_through(UserTrainStep(model, CompiledLoss(model), own_loss_per_learner=True,
                                              per_example_loss=per_example_loss_fn(loss)))
    return engine


def check_own_step(model, loss_scale):
    """Refuses (ConfigError) a model whose own train_step the engine cannot run: under loss scaling
    (mixed_float16), whose scaled loss is computed inside the user's step."""
    from crossbow_tf import training_hooks
    from crossbow_tf.errors import ConfigError
    if loss_scale and training_hooks.overrides(type(model), "train_step"):
        raise ConfigError(f"precision: mixed_float16: {type(model).__name__} has a train_step of its own, whose "
                          "loss the engine cannot scale; use float32 or mixed_bfloat16")


def _schedule(cfg, data, strategy):
    """(StepSchedule, iterations per epoch) of CFG's learning rate with STRATEGY's global batch."""
    from crossbow_tf.data.pipeline import iterations_per_epoch
    from crossbow_tf.engine.schedule import StepSchedule
    per_epoch = iterations_per_epoch(data.train.size, strategy.num_learners * cfg.batch_size)
    lr = cfg.learning_rate
    return StepSchedule.from_epochs(lr.base, lr.drops_at_epochs, lr.drop_factor, lr.warmup_epochs, per_epoch), per_epoch


def _start_line(cfg, data, engine, strategy, per_epoch):
    return (f"{cfg.name}: {cfg.model} on {data.name} ({data.train.size} train / {data.test.size} test), "
            f"{engine.algorithm.name} with k={strategy.num_learners} learners "
            f"({_placement(strategy)}), batch {cfg.batch_size} per learner, "
            f"{per_epoch} iterations per epoch, on {_device_line(strategy)}"
            f"{'' if cfg.precision == 'float32' else f', precision {cfg.precision}'}"
            f"{f', noise matching (decay {engine.noise_decay:g})' if engine.noise_decay is not None else ''}")


def _results(cfg, engine, strategy, cluster, tuning):
    from crossbow_tf.config import to_dict
    from crossbow_tf.results import RunResults
    results = RunResults(engine.algorithm.name, to_dict(cfg), devices=strategy.devices,
                         num_learners=strategy.num_learners, global_batch=strategy.num_learners * cfg.batch_size)
    if cluster is not None:
        results.extra["workers"] = cluster.num_workers
    if tuning is not None:
        results.extra["autotune"] = tuning.to_dict()
    return results


def _train_options(cfg, log, checkpoints, progress, stop_signals, on_evaluation):
    """The trainer's TrainOptions of CFG, with this run's log, checkpoints and resume point."""
    from crossbow_tf.engine.trainer import TrainOptions
    return TrainOptions(seed=cfg.seed, target_accuracy=cfg.target_accuracy, stop_at_target=cfg.stop_at_target,
                        eval_batch_size=cfg.eval_batch_size, log=log, learner_diagnostics=cfg.learner_diagnostics,
                        collapse_epochs=cfg.collapse_epochs, batchnorm_eval=cfg.batchnorm_eval,
                        batchnorm_batches_count=cfg.batchnorm_batches, checkpoints=checkpoints, progress=progress,
                        on_divergence=cfg.on_divergence, max_rollbacks=cfg.max_rollbacks,
                        stop_signals=stop_signals, on_evaluation=on_evaluation)


def _checkpoints(cfg, engine, strategy):
    """CFG's Checkpoints of ENGINE, or None without checkpoint.dir."""
    if not cfg.checkpoint.dir:
        return None
    from crossbow_tf.config import to_dict
    from crossbow_tf.engine.checkpoint import Checkpoints
    c = cfg.checkpoint
    checkpoints = Checkpoints(c.dir, engine, every_iterations=c.every_iterations, at_epoch_end=c.at_epoch_end,
                              max_to_keep=c.max_to_keep)
    checkpoints.base_record = dict(config=to_dict(cfg), learners_per_device=strategy.learners_per_device,
                                   workers=strategy.num_workers)
    return checkpoints


def cross_worker_figures(results, progress):
    """The cross-worker measurements of the iterations this process trained (since PROGRESS, a resume point)."""
    from crossbow_tf.distribute.cross_worker import measurements
    if not results.evaluations:
        return None
    since = progress.iteration if progress is not None else 0
    before = [e["wall_time"] for e in results.evaluations if e["iteration"] <= since]
    last = results.evaluations[-1]
    return measurements(last["iteration"] - since, last["wall_time"] - (before[-1] if before else 0.0))


def _device_line(strategy):
    from crossbow_tf.device_choice import device_line
    reduction = {"none": None, "nccl": "NCCL"}.get(strategy.reduction_name, strategy.reduction_name)
    return device_line(strategy.devices, reduction)


def _placement(strategy):
    local = f"{strategy.num_devices} device(s) x {strategy.learners_per_device}"
    return local if strategy.num_workers == 1 else f"{strategy.num_workers} workers x {local}"
