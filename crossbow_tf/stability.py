"""The stability of a central loop (SMA's, EASGD's): pure arithmetic, shared by the update rules and
the configuration's check (which the stock baselines also load, without any of the engine)."""


def central_loop_bound(alpha, central_momentum):
    """The central step beta at and past which SMA's central loop diverges: (1 + mu_z)(2 - alpha).

    Ignoring gradients, one synchronisation maps e = (learners' mean) - z and the central velocity u
    to ((1 - alpha - beta) e - mu_z u, mu_z u + beta e); Jury's test on that 2x2 map gives stability
    exactly for 0 < beta < (1 + mu_z)(2 - alpha). EASGD is the same loop with mu_z = 0."""
    return (1.0 + central_momentum) * (2.0 - alpha)


def largest_stable_alpha(num_learners, central_momentum):
    """The supremum of the stable alphas when beta = k*alpha (Crossbow's coupling):
    k*alpha < (1 + mu_z)(2 - alpha) <=> alpha < 2(1 + mu_z) / (k + 1 + mu_z)."""
    return 2.0 * (1.0 + central_momentum) / (num_learners + 1.0 + central_momentum)


def check_central_loop(rule, alpha, central_step, central_momentum, num_learners, allow_unstable):
    """Raises ValueError naming the bound when the central loop of RULE is unstable for K learners.

    CENTRAL_STEP None means Crossbow's beta = k*alpha."""
    bound = central_loop_bound(alpha, central_momentum)
    coupled = central_step is None
    beta = num_learners * alpha if coupled else central_step
    if beta < bound or allow_unstable:
        return
    momentum = f"central momentum {central_momentum:g}" if central_momentum else "no central momentum"
    if coupled:
        what = f"its central step k*alpha = {num_learners}*{alpha:g} = {beta:.4g}"
        fix = (f"the largest stable alpha for k={num_learners} is just below "
               f"{largest_stable_alpha(num_learners, central_momentum):.4g}")
        if rule == "SMA":
            fix += f" (or decouple the step: central_step below {bound:.4g})"
    else:
        what = f"its central step beta = {beta:.4g}"
        fix = f"the largest stable central_step for alpha {alpha:g} is just below {bound:.4g}"
    raise ValueError(f"{rule}: the central loop is unstable: {what} is at or past the bound "
                     f"(1 + mu_z)(2 - alpha) = {bound:.4g} ({momentum}, alpha {alpha:g}); {fix}; "
                     "allow_unstable=True (algorithm.allow_unstable: true) runs it anyway")
