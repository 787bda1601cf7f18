"""Full-batch L-BFGS fits on the driver, watched as every fit: ``DistriOptimizer(solver=
"lbfgs")`` on a built-in linear model, and the linear Estimators' fits, both through the
linear Estimators' one stage (``glm_stage.fit_glm``).

``DistriOptimizer(model, None, solver="lbfgs")`` with ``models.LinearRegression``,
``LogisticRegression`` or ``SoftmaxRegression`` minimises the model's own objective, the
weighted mean of its loss over the rows plus ``regularization``'s penalty on the weights as
``train.regularisation`` defines it, to ``max_iter`` and ``tol`` (MLlib's stopping rules;
OWL-QN where the L1 part is non-zero). That objective is a ``GlmProblem`` exactly: the
logistic and softmax losses are MLlib's binomial and multinomial objectives as they are; the
squared error is the gaussian one times the label's variance, with the L2 strength not
divided by the label's std (``label_scaled_l2=False``). The answer comes back as the
``TrainedModel`` every solver returns, one history entry per iteration (``epochs[k]["loss"]``:
the objective after k iterations, k = 0 the start), so predict/save/load work unchanged.

The linear Estimators' fits (``ml.LogisticRegression``, ``ml.LinearRegression``) go through
``watched_fit_glm`` too: MLflow's tracker and TensorBoard's writer (``watchers``) hear each
iteration's objective and get the same built-in model's ``TrainedModel`` with the
Estimator's Params, so autolog logs them as it logs every other fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.glm import GlmProblem, GlmSolution
from allreduce_param.models.linear import LinearRegression, LogisticRegression, SoftmaxRegression
from allreduce_param.train.driver.glm_stage import fit_glm
from allreduce_param.train.driver.glm_start import GlmFacts
from allreduce_param.train.driver.watchers import WatchedFit, Watchers, watchers_of
from allreduce_param.train.regularisation import Regularization
from allreduce_param.train.result import History, TrainedModel
from allreduce_param.train.settings import FitSettings

#: The settings solver="lbfgs" reads; every other one must keep its default.
LBFGS_SETTINGS = frozenset(
    {
        "solver",
        "max_iter",
        "tol",
        "seed",
        "progress",
        "tensorboard_dir",
        "tracking",
        "regularization",
        "fit_intercept",
        "checkpoints",
        "data_in",
    }
)
#: The built-in models solver="lbfgs" fits, by their family of MLlib's objectives.
FAMILIES = {
    LinearRegression: "gaussian",
    LogisticRegression: "binomial",
    SoftmaxRegression: "multinomial",
}


def check_lbfgs(
    model: Any,
    optimizer: Any,
    settings: FitSettings,
    data: Any,
    validation: Any = None,
    initial: Any = None,
) -> None:
    """Refuse, before any Spark job, what ``solver="lbfgs"`` cannot do, by name."""
    if type(model) not in FAMILIES:
        raise ConfigurationError(
            f"solver='lbfgs' fits the built-in LinearRegression, LogisticRegression and "
            f"SoftmaxRegression (allreduce_param.models), not {type(model).__name__}: train it "
            "with solver='minibatch' (the default) and an optimizer"
        )
    if optimizer is not None:
        raise ConfigurationError(
            f"solver='lbfgs' is the optimizer itself and would not use {optimizer!r}: pass "
            "None, DistriOptimizer(model, None, solver='lbfgs'), or solver='minibatch'"
        )
    refuse_unused(unused_settings(settings))
    for name, value in (
        ("validation", validation),
        ("initial", initial),
    ):
        if value is not None:
            raise ConfigurationError(
                f"solver='lbfgs' does not take fit({name}=...): it solves from MLlib's start "
                "to the minimiser; use solver='minibatch' for it"
            )
    if not hasattr(data, "columns"):
        raise InputError(
            "solver='lbfgs' reads a DataFrame of features and label columns, not "
            f"{type(data).__name__}: spark.createDataFrame(...) it first"
        )


def unused_settings(settings: FitSettings) -> list[str]:
    """The settings ``solver="lbfgs"`` does not read that ``settings`` changes from their
    defaults, each as ``"name=value"``."""
    defaults = FitSettings()
    return [
        f"{name}={getattr(settings, name)!r}"
        for name in sorted(FitSettings.__dataclass_fields__)
        if name not in LBFGS_SETTINGS and getattr(settings, name) != getattr(defaults, name)
    ]


def refuse_unused(changed: list[str]) -> None:
    """The one rule for mini-batch settings under ``solver="lbfgs"`` (DistriOptimizer's and
    the AllReduce Estimators' Params alike): each changed one (``"name=value"``) refused by
    name, never ignored."""
    if changed:
        raise ConfigurationError(
            f"solver='lbfgs' is one full-batch solve and does not use {', '.join(changed)}: "
            "leave each at its default (max_iter and tol stop it), or use "
            "solver='minibatch'"
        )


def glm_problem(model: Any, settings: FitSettings, n_features: int) -> GlmProblem:
    """The built-in ``model``'s objective under ``settings`` as MLlib's problem (see the
    module's docstring); the data's width must be the model's."""
    if model.n_features != n_features:
        raise InputError(
            f"the features have {n_features} columns where the model takes "
            f"{model.n_features}: make the model with n_features={n_features}"
        )
    family = FAMILIES[type(model)]
    classes = {"gaussian": 1, "binomial": 2}.get(family) or model.n_classes
    rule: Regularization = settings.regularization
    return GlmProblem(
        family=family,
        num_features=n_features,
        num_classes=classes,
        fit_intercept=settings.fit_intercept,
        reg_param=rule.reg_param,
        elastic_net_param=rule.elastic_net_param,
        standardization=rule.standardization,
        max_iter=settings.max_iter,
        tol=settings.tol,
        label_scaled_l2=False,
    )


def builtin_model(problem: GlmProblem) -> Any:
    """The built-in model whose predictions are ``problem``'s solution's."""
    if problem.family == "gaussian":
        return LinearRegression(problem.num_features)
    if problem.family == "binomial":
        return LogisticRegression(problem.num_features)
    return SoftmaxRegression(problem.num_features, problem.num_classes)


def trained_model(
    model: Any, solution: GlmSolution, seconds: float, label_units: bool = True
) -> TrainedModel:
    """``solution`` as the ``TrainedModel`` of the built-in ``model``: its coefficients in
    ``w1`` (features x outputs), its intercepts in ``b1``; one history epoch per iteration
    with its objective, in the label's units (``label_units``: DistriOptimizer's objective)
    or as MLlib's ``objectiveHistory`` has it."""
    weights = np.zeros(model.size, np.float32)
    tensors = model.tensors(weights)
    tensors["w1"][...] = solution.coefficients.T
    tensors["b1"][...] = solution.intercepts
    scale = solution.objective_scale if label_units else 1.0
    epochs = [
        {"epoch": k, "loss": float(value) * scale}
        for k, value in enumerate(solution.objective_history)
    ]
    history = History([], epochs, seconds)
    return TrainedModel(
        model,
        weights,
        history,
        model.n_features,
        steps_done=0,
        epochs_done=solution.iterations,
    )


def watched_fit_glm(
    data: Any,
    features_col: str,
    label_col: str,
    weight_col: str | None,
    classification: bool,
    problem_for: Callable[[GlmFacts], GlmProblem],
    watched_for: Callable[[GlmProblem], WatchedFit],
    num_classes: int | None = None,
    trained: bool = False,
    **fit_options: Any,
) -> tuple[GlmSolution, TrainedModel | None]:
    """``fit_glm`` with the fit's watchers (``watched_for(problem)`` says what they watch,
    its ``model`` the built-in one the solution becomes): opened once the problem is made
    (the columns and settings checked on the driver, before the stage, which checks the
    rows: data it refuses ends the run as failed, naming why, as MLflow's autolog of
    MLlib's fits does); told each iteration's objective as an
    ``"epoch"`` event and the result, or the error that ended the fit. The solution, and
    its ``TrainedModel`` where anyone watches or ``trained`` asks for it (else None: a wide
    model's float32 copy is not made for nobody). ``fit_options``: ``fit_glm``'s
    ``checkpoints``, ``data_in`` and ``after_iteration``."""
    started = time.perf_counter()
    opened: list[tuple[GlmProblem, WatchedFit, Watchers]] = []

    def problem_then_watchers(facts: GlmFacts) -> GlmProblem:
        problem = problem_for(facts)
        fit = watched_for(problem)
        opened.append((problem, fit, watchers_of(fit)))
        return problem

    try:
        solution = fit_glm(
            data,
            features_col,
            label_col,
            weight_col,
            classification,
            problem_then_watchers,
            num_classes,
            **fit_options,
        )
    except BaseException as error:
        if opened:
            opened[0][2].fail(error)
        raise
    problem, fit, watchers = opened[0]
    if not (watchers or trained):
        return solution, None
    seconds = time.perf_counter() - started
    result = trained_model(fit.model, solution, seconds, not problem.label_scaled_l2)
    for epoch in result.history.epochs:
        watchers.listen("epoch", epoch)
    return solution, watchers.finish(lambda: result)


def fit_lbfgs(
    trainer: Any,
    data: Any,
    features_col: str,
    label_col: str,
    weight_col: str | None,
    validation: Any = None,
    resume_from: str | None = None,
    initial: Any = None,
) -> TrainedModel:
    """``DistriOptimizer.fit`` (``trainer``'s) with ``solver="lbfgs"``: checked
    (``check_lbfgs``), then the model's objective minimised in one barrier stage, watched as
    every fit."""
    model, settings = trainer.model, trainer.settings
    check_lbfgs(model, trainer.optimizer, settings, data, validation, initial)
    family = FAMILIES[type(model)]

    def watched_for(problem: GlmProblem) -> WatchedFit:
        return WatchedFit(
            model, None, settings, data, features_col, label_col, weight_col=weight_col
        )

    _, trained = watched_fit_glm(
        data,
        features_col,
        label_col,
        weight_col,
        family != "gaussian",
        lambda facts: glm_problem(model, settings, facts.n_features),
        watched_for,
        num_classes=None if family == "gaussian" else problem_classes(model),
        trained=True,
        # the linear Estimators' checkpoints (every ``every`` iterations; a lost task's stage
        # runs again from the newest) and row files (data_in="disk")
        checkpoints=settings.checkpoints,
        data_in=settings.data_in,
        resume_from=resume_from,  # a checkpoint of this problem's fit (fit_glm checks it)
    )
    assert trained is not None  # (asked for)
    return trained


def problem_classes(model: Any) -> int:
    """How many classes a built-in classifier's labels may take."""
    return 2 if isinstance(model, LogisticRegression) else model.n_classes


def estimator_watch(
    estimator: Any,
    data: Any,
    features_col: str,
    label_col: str,
    weight_col: str | None,
    tensorboard_dir: str | None = None,
) -> Callable[[GlmProblem], WatchedFit]:
    """What the watchers of a linear Estimator's fit watch: the built-in model of its
    problem, the problem as settings (solver="lbfgs"), and the Estimator's Params by name."""
    params = {param.name: value for param, value in estimator.extractParamMap().items()}

    def watched_for(problem: GlmProblem) -> WatchedFit:
        settings = FitSettings(
            solver="lbfgs",
            max_iter=int(problem.max_iter),
            tol=float(problem.tol),
            fit_intercept=problem.fit_intercept,
            regularization=Regularization(
                problem.reg_param, problem.elastic_net_param, problem.standardization
            ),
            tensorboard_dir=tensorboard_dir,
            progress=False,
        )
        return WatchedFit(
            builtin_model(problem),
            None,
            settings,
            data,
            features_col,
            label_col,
            weight_col=weight_col,
            params=params,
        )

    return watched_for
