"""The places Keras 3 gives a model for its own training logic, and what Crossbow training does with
each when a model's class overrides it: honoured as Keras honours it, run per learner, or refused
in one line before training. The one list of them: use_sma, crossbow_tf.run's user models and
docs/keras.md's table all read it.
"""
import dataclasses

HONOURED, PER_LEARNER, REFUSED = "honoured", "per learner", "refused"


@dataclasses.dataclass(frozen=True)
class Hook:
    name: str
    treatment: str       # HONOURED, PER_LEARNER or REFUSED
    why: str             # what use_sma does with an override, or why it cannot
    instead: str = ""    # for a refused hook: what the user can do


HOOKS = (
    Hook("compute_loss", PER_LEARNER,
         "each learner's loss is the override, called with that learner's slice, predictions and weights "
         "(Keras's stateless_compute_loss); the forward pass stays fused"),
    Hook("train_step", PER_LEARNER,
         "it runs once per learner, on that learner's slice, with its weights and states in the model's "
         "variables; what it hands to model.optimizer (apply, apply_gradients) is that learner's gradient, and "
         "SMA's correction and central update follow; its trackers are the model's own, fit shows the logs it "
         "returns; a step that drives another optimizer (a GAN's) is refused when fit traces it"),
    Hook("test_step", HONOURED, "evaluate, predict and validation are Keras's own, on the central model z"),
    Hook("predict_step", HONOURED, "evaluate, predict and validation are Keras's own, on the central model z"),
    Hook("compute_metrics", HONOURED,
         "called after each step with the learners' predictions of the step's real rows, as Keras calls it"),
    Hook("make_train_function", REFUSED,
         "use_sma makes the model's train function itself, to run the learners' step",
         "train this model without use_sma, or leave make_train_function to Keras"),
    Hook("train_on_batch", REFUSED,
         "use_sma replaces train_on_batch with one Crossbow iteration of all learners",
         "train this model without use_sma, or leave train_on_batch to Keras"),
    Hook("fit", REFUSED,
         "use_sma replaces fit, to run the learners, their data and the synchronisation",
         "call Keras's fit (leave fit to Keras), or train this model without use_sma"),
)
BY_NAME = {hook.name: hook for hook in HOOKS}
# What crossbow_tf.run, its engine methods and the harness take of a user's model file: the engine runs
# a compute_loss or train_step of the model's own per learner (crossbow_tf.experiment.build_engine), and
# tf_ssgd's Keras fit runs them as Keras does. Its test_step and predict_step are taken but not run: every
# side records accuracy and loss computed from the model's outputs, the same measure for each method.
RUN_PATH_HONOURS = frozenset(hook.name for hook in HOOKS if hook.treatment != REFUSED)


def overrides(model_class, name):
    """Whether MODEL_CLASS, or a class of its own above keras.Model, defines NAME (a Keras class does not
    count: Sequential and Functional are Keras's, as are their methods)."""
    for klass in model_class.__mro__:
        if name in vars(klass):
            return not klass.__module__.split(".")[0] == "keras"
    return False


def overridden(model_class):
    """The hooks MODEL_CLASS overrides, in HOOKS' order."""
    return [hook for hook in HOOKS if overrides(model_class, hook.name)]


def refusal(model_class, who="use_sma"):
    """One line refusing MODEL_CLASS for its first refused override, or None when every override is
    honoured or run per learner."""
    refused = [hook for hook in overridden(model_class) if hook.treatment == REFUSED]
    if not refused:
        return None
    hook = refused[0]
    return (f"{model_class.__name__} overrides {hook.name}, which {who} cannot honour ({hook.why}): "
            f"{hook.instead}")


def markdown_table():
    """docs/keras.md's table of the hooks."""
    rows = ["| Keras hook | with use_sma | why, and what to do |", "|---|---|---|"]
    for hook in HOOKS:
        rows.append(f"| `{hook.name}` | {hook.treatment} | {hook.why}" + (f"; {hook.instead}" if hook.instead else "")
                    + " |")
    return "\n".join(rows)
